"""The safety data: CrowS-Pairs pairs, ToxiGen demonstration sentences, the offensive-word list.

Each reader names the file it could not use; nothing is silently empty.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.safety.config import (
    CROWS_FILE,
    ENABLE_HINT,
    LEXICON_FILE,
    PACKAGED,
    TOXIGEN_DIR,
)

CROWS_COLUMNS = ("sent_more", "sent_less", "bias_type")
# ToxiGen file names: <group>__<hate|neutral>_<target>[_sentences].txt
TOXIGEN_NAME = re.compile(
    r"^(?P<group>[a-z_]+)__(?P<kind>hate|neutral)_(?P<target>[a-z_]+?)(_sentences)?\.txt$"
)


@dataclass(frozen=True)
class ToxigenFile:
    """One target group and kind: the distinct sentences of the files that hold it."""

    target: str
    kind: str  # "hate" or "neutral"
    sentences: tuple[str, ...]


def packaged_root() -> Path:
    """The folder of the safety data shipped with llmflow (package data, licences beside)."""
    root = resources.files("llmflow.tasks.safety") / PACKAGED
    if not isinstance(root, Path):  # NOTE: the steps hash and read files by path
        raise BadInputError(f"the packaged safety data is not on disk ({root}); {ENABLE_HINT}")
    return root


def safety_files(data_root: str | Path) -> list[str]:
    """Every file the safety steps read under ``data_root`` (``packaged``: the copies shipped
    with llmflow), sorted; missing ones named."""
    root = packaged_root() if str(data_root) == PACKAGED else Path(data_root)
    crows, lexicon, toxigen = root / CROWS_FILE, root / LEXICON_FILE, root / TOXIGEN_DIR
    missing = [str(p) for p in (crows, lexicon, toxigen) if not p.exists()]
    if missing:
        raise BadInputError(f"safety data not found: {', '.join(missing)}; {ENABLE_HINT}")
    demos = sorted(str(p) for p in toxigen.glob("*.txt"))
    if not demos:
        raise BadInputError(f"{toxigen} holds no .txt demonstration files; {ENABLE_HINT}")
    return [str(crows), str(lexicon), *demos]


def pick(files: tuple[str, ...] | list[str], name: str) -> Path:
    """The file called ``name`` among the step's raw inputs."""
    for uri in files:
        if Path(uri).name == name:
            return Path(uri)
    raise BadInputError(f"the safety inputs hold no {name}; {ENABLE_HINT}")


def read_crows(path: Path, limit: int | None = None) -> list[dict[str, str]]:
    """CrowS-Pairs rows (sent_more, sent_less, bias_type, stereo_antistereo)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        absent = [c for c in CROWS_COLUMNS if c not in (reader.fieldnames or [])]
        if absent:
            raise BadInputError(f"{path}: CrowS-Pairs needs columns {absent}")
        rows = [
            {k: row[k] for k in (*CROWS_COLUMNS, "stereo_antistereo") if k in row} for row in reader
        ]
    if not rows:
        raise BadInputError(f"{path}: no CrowS-Pairs rows")
    return rows[:limit] if limit else rows


def read_toxigen(files: tuple[str, ...] | list[str]) -> list[ToxigenFile]:
    """The demonstration sentences among ``files``, one set per target and kind, each sentence
    once.

    NOTE: ToxiGen repeats sentences: ``religion__*_muslim.txt`` are contained in their
    ``_sentences`` twins, and a file may repeat a line. Read per file, copies of one sentence
    landed on both sides of the classifier's held-out split and the muslim prompts were taken
    twice. The first file (in ``files``' order) to hold a sentence keeps it.

    Raises:
        BadInputError: no demonstration sentence, or one sentence in a hate and a neutral file.
    """
    groups: dict[tuple[str, str], list[str]] = {}
    first: dict[str, tuple[str, str]] = {}  # sentence -> (kind, file it was first read from)
    for uri in files:
        match = TOXIGEN_NAME.match(Path(uri).name)
        if match is None or Path(uri).parent.name != TOXIGEN_DIR:
            continue
        lines = Path(uri).read_text(encoding="utf-8").splitlines()
        for sentence in (s.strip().lstrip("- ").strip() for s in lines if s.strip()):
            if sentence in first:
                kind, source = first[sentence]
                if kind != match["kind"]:
                    raise BadInputError(
                        f"ToxiGen sentence {sentence!r} is {kind} in {source} and "
                        f"{match['kind']} in {uri}: one label per sentence"
                    )
                continue
            first[sentence] = (match["kind"], uri)
            groups.setdefault((match["target"], match["kind"]), []).append(sentence)
    if not groups:
        raise BadInputError(f"no ToxiGen demonstration sentences among the inputs; {ENABLE_HINT}")
    return [ToxigenFile(target, kind, tuple(s)) for (target, kind), s in groups.items()]


def read_lexicon(path: Path) -> list[str]:
    """The offensive words and phrases, lowercased."""
    words = [w.strip().lower() for w in path.read_text(encoding="utf-8").splitlines()]
    words = [w for w in words if w]
    if not words:
        raise BadInputError(f"{path}: the word list is empty")
    return words
