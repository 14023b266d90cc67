"""Corpora for curation tests: synthetic prose, real text from ../shared/data, planted copies."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from llmflow.tasks.curation.config import CurateConfig
from llmflow.tasks.curation.recipe import add_curation
from llmflow.tasks.framework.graph import Graph, Node
from llmflow.tasks.framework.step import Metrics, step

SHARED_TEXT = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "text"

_SYLLABLES = "ka to ri ne su mo la pe chi dan vor el bi ur sa".split()


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))


def prose(rng: random.Random, num_sentences: int) -> str:
    """English-like sentences of random words around stop words (passes the prose filters and
    shares no long n-grams with other documents)."""
    sentences = []
    for _ in range(num_sentences):
        w = [_word(rng) for _ in range(7)]
        sentences.append(f"The {w[0]} {w[1]} of {w[2]} and {w[3]} {w[4]} with the {w[5]} {w[6]}.")
    lines = [" ".join(sentences[i : i + 3]) for i in range(0, len(sentences), 3)]
    return "\n".join(lines)


def near_copy(rng: random.Random, text: str, num_edits: int) -> str:
    """`text` with `num_edits` words replaced (as the quickstart sample plants them)."""
    words = text.split(" ")
    for i in rng.sample(range(len(words)), num_edits):
        words[i] = rng.choice(["alpha", "bravo", "delta", "omega", "zeta"])
    return " ".join(words)


def real_documents(max_docs: int | None = None, text_dir: Path = SHARED_TEXT) -> list[str]:
    """WikiText-2 validation articles and tinyshakespeare in 2,000-character chunks."""
    wiki = (text_dir / "wikitext2_valid.txt").read_text(encoding="utf-8")
    docs = [a for a in re.split(r"\n(?= = [^=].* = \n)", wiki) if a.strip()]
    shakespeare = (text_dir / "tinyshakespeare.txt").read_text(encoding="utf-8")
    docs += [shakespeare[i : i + 2000] for i in range(0, len(shakespeare), 2000)]
    return docs[:max_docs]


def write_shards(directory: Path, records: list[dict], num_shards: int = 2) -> list[Path]:
    """Writes records (id, text, domain, source) as `directory/shards/shard-NNNNN.parquet`."""
    shard_dir = directory / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(num_shards):
        rows = records[shard::num_shards]
        table = pa.table(
            {k: [r.get(k, "test") for r in rows] for k in ("id", "text", "domain", "source")}
        )
        path = shard_dir / f"shard-{shard:05d}.parquet"
        pq.write_table(table, path)
        paths.append(path)
    return paths


def ids_in(directory: Path) -> set[str]:
    """Ids in every document shard under `directory` (recursively, stage files excluded)."""
    return {
        i
        for p in directory.rglob("*.parquet")
        if "." not in p.stem
        for i in pq.read_table(p, columns=["id"]).column("id").to_pylist()
    }


class RowsConfig(BaseModel):
    """Test records and how many shards to deal them into."""

    records: list[dict]
    num_shards: int = 2


@step("test-rows")
def write_rows(cfg: RowsConfig, out: Path) -> Metrics:
    """Write test records as `shards/*.parquet` (a stand-in for the ingest step)."""
    write_shards(out, cfg.records, cfg.num_shards)
    return {"documents": len(cfg.records)}


def curation_graph(
    records: list[dict], cfg: CurateConfig | None = None, num_shards: int = 2
) -> tuple[Graph, Node]:
    """A graph: the records as an ingested corpus, then every curation stage; and its last node."""
    graph = Graph()
    ingested = graph.add(write_rows, RowsConfig(records=records, num_shards=num_shards), "test")
    cfg = cfg or CurateConfig(skip_domains=["code", "math"])  # the quickstart's prose-only rules
    return graph, add_curation(graph, cfg, ingested, "test")
