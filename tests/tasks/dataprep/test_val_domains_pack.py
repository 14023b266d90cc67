"""The validation set records each document's domain when asked (``validation.by_domain``), and
the loader gives every label the domain of the document its target token belongs to.

The reference is the tokens themselves: the two domains of the hand-made corpus draw their
tokens from disjoint ranges, so a label's domain is read off its target token (off the token
before it when the target is a document's eos), independently of the packed index.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from llmflow.tasks.dataprep.config import ValidationConfig
from llmflow.tasks.dataprep.loader import IGNORE_INDEX, PackedLoader
from llmflow.tasks.dataprep.mixture import build_validation
from llmflow.tasks.dataprep.pack import INDEX_FILES

EOS, PAD = 1, 0
EASY = (2, 10)  # token range of domain "easy"
HARD = (10, 120)  # token range of domain "hard"


def make_two_domain_tokenized(root: Path, seed: int = 0, docs: int = 40) -> Path:
    """A tokenized folder (tokenize_corpus's layout) with domains "easy" and "hard" in both
    splits. "easy" documents repeat one token, "hard" ones are uniform noise: a model tells them
    apart at once, and their tokens never overlap."""
    rng = np.random.default_rng(seed)
    meta = {"vocab_size": 128, "dtype": "uint16", "eos_id": EOS, "pad_id": PAD}
    for split in ("train", "validation"):
        meta[split] = {}
        for domain, (lo, hi) in (("easy", EASY), ("hard", HARD)):
            lengths = rng.integers(3, 30, docs)
            if domain == "easy":
                pieces = [np.full(n, rng.integers(lo, hi)) for n in lengths]
            else:
                pieces = [rng.integers(lo, hi, n) for n in lengths]
            folder = root / split / domain
            folder.mkdir(parents=True)
            np.concatenate(pieces).astype(np.uint16).tofile(folder / "tokens.bin")
            np.save(folder / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]))
            meta[split][domain] = {
                "dir": f"{split}/{domain}",
                "num_docs": int(len(lengths)),
                "num_tokens": int(lengths.sum()),
            }
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def expected_domains(batch: dict) -> np.ndarray:
    """The domain index (0 easy, 1 hard) of each label, read off the tokens; -1 where masked."""
    labels, inputs = batch["labels"].numpy(), batch["input_ids"].numpy()
    token = np.where(labels == EOS, inputs, labels)  # an eos ends the document before it
    out = np.where(token >= HARD[0], 1, 0)
    return np.where(labels == IGNORE_INDEX, -1, out)


def _sha256s(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_validation_by_domain_gives_every_label_its_documents_domain(tmp_path):
    tokenized = make_two_domain_tokenized(tmp_path / "tokenized")
    out = tmp_path / "val"
    out.mkdir()
    cfg = ValidationConfig(seq_len=16, rows_per_shard=7, seed=3, by_domain=True)
    build_validation(cfg, tokenized, out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["domains"] == ["easy", "hard"]
    loader = PackedLoader(out, meta["num_sequences"], with_domains=True)
    assert loader.domain_names == ["easy", "hard"]
    batch = loader.next_batch()  # every row once
    loader.close()
    want = expected_domains(batch)
    got = batch["domains"].numpy()
    valid = want >= 0
    assert valid.sum() > 500 and set(np.unique(want[valid])) == {0, 1}
    np.testing.assert_array_equal(got[valid], want[valid])
    # without the domains the loader's batches are as they were
    plain = PackedLoader(out, meta["num_sequences"]).next_batch()
    assert sorted(plain) == ["cu_seqlens", "input_ids", "labels", "position_ids"]
    for key, value in plain.items():
        assert (value == batch[key]).all(), key


def test_validation_without_by_domain_writes_what_it_wrote_before(tmp_path):
    tokenized = make_two_domain_tokenized(tmp_path / "tokenized")
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    cfg = ValidationConfig(seq_len=16, rows_per_shard=7, seed=3)
    assert cfg.by_domain is False
    build_validation(cfg, tokenized, tmp_path / "off")
    build_validation(cfg.model_copy(update={"by_domain": True}), tokenized, tmp_path / "on")
    off, on = _sha256s(tmp_path / "off"), _sha256s(tmp_path / "on")
    meta_off = json.loads((tmp_path / "off" / "meta.json").read_text())
    meta_on = json.loads((tmp_path / "on" / "meta.json").read_text())
    # off: no domain file, no new meta key, the index as ever
    assert "domains" not in meta_off and meta_off["index"] == INDEX_FILES
    assert sorted(set(on) - set(off)) == ["segment_domains.bin"]
    # on: the rows and their document index are the same bytes; meta only gains the domains
    assert {k: v for k, v in on.items() if k in off and k != "meta.json"} == {
        k: v for k, v in off.items() if k != "meta.json"
    }
    assert {k: v for k, v in meta_on.items() if k not in ("domains", "index")} == {
        k: v for k, v in meta_off.items() if k != "index"
    }


def test_loader_asked_for_domains_of_a_set_without_them_names_the_flag(tmp_path):
    tokenized = make_two_domain_tokenized(tmp_path / "tokenized")
    (tmp_path / "val").mkdir()
    build_validation(ValidationConfig(seq_len=16), tokenized, tmp_path / "val")
    with pytest.raises(ValueError, match="no per-document domains.*by_domain"):
        PackedLoader(tmp_path / "val", 2, with_domains=True)
