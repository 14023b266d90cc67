"""Corpora for curation tests: synthetic prose, real text from ../shared/data, planted copies."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SHARED_TEXT = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "text"

_NOUNS = ("river city garden teacher engine market letter village doctor window forest "
          "student bridge kitchen painter soldier island station museum harbor").split()  # fmt: skip
_VERBS = "visited painted described repaired admired followed crossed opened found built".split()
_ADJ = "old quiet bright narrow famous small ancient busy gentle distant".split()


def prose(rng: random.Random, num_sentences: int) -> str:
    """Grammatical-looking English sentences with stop words (passes the prose filters)."""
    sentences = []
    for _ in range(num_sentences):
        s = (f"The {rng.choice(_ADJ)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the "
             f"{rng.choice(_NOUNS)} of the {rng.choice(_ADJ)} {rng.choice(_NOUNS)} and that was "
             f"{rng.choice(_ADJ)} to have with {rng.choice(_NOUNS)}s {rng.randint(2, 999)} times.")  # fmt: skip
        sentences.append(s)
    lines = [" ".join(sentences[i : i + 3]) for i in range(0, len(sentences), 3)]
    return "\n".join(lines)


def near_copy(rng: random.Random, text: str, num_edits: int) -> str:
    """`text` with `num_edits` words replaced (as the quickstart sample plants them)."""
    words = text.split(" ")
    for i in rng.sample(range(len(words)), num_edits):
        words[i] = rng.choice(["alpha", "bravo", "delta", "omega", "zeta"])
    return " ".join(words)


def real_documents(max_docs: int | None = None) -> list[str]:
    """WikiText-2 validation articles and tinyshakespeare in 2,000-character chunks."""
    wiki = (SHARED_TEXT / "wikitext2_valid.txt").read_text(encoding="utf-8")
    docs = [a for a in re.split(r"\n(?= = [^=].* = \n)", wiki) if a.strip()]
    shakespeare = (SHARED_TEXT / "tinyshakespeare.txt").read_text(encoding="utf-8")
    docs += [shakespeare[i : i + 2000] for i in range(0, len(shakespeare), 2000)]
    return docs[:max_docs]


def write_shards(directory: Path, records: list[dict], num_shards: int = 2) -> list[Path]:
    """Writes records (id, text, domain, source) as `directory/shards/shard-NNNNN.parquet`."""
    shard_dir = directory / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(num_shards):
        rows = records[shard::num_shards]
        table = pa.table({k: [r.get(k, "test") for r in rows] for k in ("id", "text", "domain", "source")})
        path = shard_dir / f"shard-{shard:05d}.parquet"
        pq.write_table(table, path)
        paths.append(path)
    return paths


def ids_in(directory: Path) -> set[str]:
    """Ids in every document shard under `directory` (recursively, stage files excluded)."""
    return {i for p in directory.rglob("*.parquet") if "." not in p.stem
            for i in pq.read_table(p, columns=["id"]).column("id").to_pylist()}  # fmt: skip
