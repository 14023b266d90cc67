"""ToxiGen's demonstration files repeat sentences (``religion__*_muslim.txt`` are contained in
their ``_sentences`` twins; the LGBTQ hate file repeats some of its own): each sentence is read
once, so the classifier's held-out sentences are never trained on, and one group and kind is one
set of sentences whichever files hold it."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.safety.classifier import split
from llmflow.tasks.safety.config import PACKAGED, TOXIGEN_DIR, ToxicityClassifierConfig
from llmflow.tasks.safety.data import packaged_root, read_toxigen, safety_files


def raw_sentences() -> dict[str, set[str]]:
    """The packaged files' distinct non-empty lines, by file name, read without the code
    tested (no line starts with the '- ' the reader strips)."""
    folder = packaged_root() / TOXIGEN_DIR
    return {
        path.name: {line.strip() for line in path.read_text().splitlines() if line.strip()}
        for path in sorted(folder.glob("*.txt"))
    }


def test_train_and_held_out_share_no_sentence():
    raw = raw_sentences()
    distinct = set().union(*raw.values())
    assert sum(len(s) for s in raw.values()) > len(distinct)  # the files do repeat sentences
    for seed in (0, 1, 2):
        train, held = split(
            read_toxigen(safety_files(PACKAGED)), ToxicityClassifierConfig(seed=seed)
        )
        assert not {t for t, _ in train} & {t for t, _ in held}
        # every distinct sentence, once, with its file's label
        assert sorted(t for t, _ in train + held) == sorted(distinct)
        hate = {s for name, lines in raw.items() if "__hate_" in name for s in lines}
        assert {t for t, y in train + held if y == 1} == hate


def test_a_group_and_kind_is_one_set_whichever_files_hold_it():
    raw = raw_sentences()
    demos = read_toxigen(safety_files(PACKAGED))
    by_key = {(d.target, d.kind): d.sentences for d in demos}
    assert len(by_key) == len(demos) == 28  # 30 files, the two muslim pairs one set each
    muslim = raw["religion__hate_muslim.txt"] | raw["religion__hate_muslim_sentences.txt"]
    assert sorted(by_key[("muslim", "hate")]) == sorted(muslim)
    assert len(by_key[("lgbtq", "hate")]) == len(raw["sexual_orientation__hate_lgbtq.txt"])


def test_a_sentence_labelled_both_ways_is_named(tmp_path: Path):
    folder = tmp_path / TOXIGEN_DIR
    folder.mkdir()
    (folder / "race__hate_asian_sentences.txt").write_text("- they are all alike\n- a b c\n")
    (folder / "race__neutral_asian_sentences.txt").write_text("- they are all alike \n- d e f\n")
    files = sorted(str(p) for p in folder.glob("*.txt"))
    with pytest.raises(BadInputError, match=r"'they are all alike'.*hate_asian.*neutral_asian"):
        read_toxigen(files)


def test_split_refuses_a_sentence_on_both_sides():
    """Sets built by hand, not read by ``read_toxigen``: the split checks them itself."""
    from llmflow.tasks.safety.data import ToxigenFile

    same = tuple(f"sentence {i}" for i in range(10))
    files = [ToxigenFile("a", "hate", same), ToxigenFile("b", "hate", same)]
    with pytest.raises(ValueError, match="both trained on and held out"):
        split(files, ToxicityClassifierConfig())
