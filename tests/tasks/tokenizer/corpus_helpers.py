"""Small curated corpora for tests: synthetic (always available) and real (shared data)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SHARED_DATA = Path(__file__).resolve().parents[3] / ".." / "shared" / "data"

WORDS = (
    "the of and model token data train loss naïve café 東京 数据 Ελλάδα — “quoted” emoji 🙂 "
    "def return import numpy self x = 1 + 2 ** 3 if else while for in range print"
).split()


def synthetic_docs(num_docs: int, domains=("web", "code", "books"), seed: int = 0) -> list[dict]:
    """Documents of random words with unicode, tabs, newlines and code, ids unique."""
    rng = np.random.default_rng(seed)
    syllables = ["ka", "to", "ri", "ne", "su", "mo", "la", "pe", "chi", "dan", "vor", "éa"]
    made = ["".join(rng.choice(syllables, size=int(rng.integers(1, 5)))) for _ in range(400)]
    vocabulary = WORDS + made
    docs = []
    for i in range(num_docs):
        words = rng.choice(vocabulary, size=int(rng.integers(5, 120)))
        seps = rng.choice([" ", " ", " ", "\n", "\t", "  ", "\n\n"], size=len(words))
        text = "".join(w + s for w, s in zip(words, seps, strict=True)).strip() or "x"
        domain = domains[i % len(domains)]
        docs.append(
            {"id": f"{domain}-{i}", "text": text, "domain": domain, "source": f"{domain}-src"}
        )
    return docs


def write_corpus(docs: list[dict], corpus_dir: Path, num_files: int = 2) -> Path:
    """Write ``docs`` as ``corpus_dir/shards/part-k.parquet`` files (string columns)."""
    shards = corpus_dir / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([(c, pa.string()) for c in ("id", "text", "domain", "source")])
    for k in range(num_files):
        part = docs[k::num_files]
        table = pa.Table.from_pylist(part, schema=schema)
        pq.write_table(table, shards / f"part-{k}.parquet")
    return corpus_dir


def real_docs(text_dir: Path = SHARED_DATA / "text") -> list[dict]:
    """Tinyshakespeare in 2,000-character chunks and WikiText-2 validation articles."""
    if not text_dir.is_dir():
        from tests.needs import skip_unless_required

        skip_unless_required(f"shared data not found at {text_dir}")
    shakespeare = (text_dir / "tinyshakespeare.txt").read_text()
    docs = [
        {
            "id": f"shakespeare-{i}",
            "text": shakespeare[i : i + 2000],
            "domain": "books",
            "source": "tinyshakespeare",
        }
        for i in range(0, len(shakespeare), 2000)
    ]
    wiki = (text_dir / "wikitext2_valid.txt").read_text()
    articles, current = [], []
    for line in wiki.splitlines(keepends=True):
        if line.startswith(" = ") and not line.startswith(" = = ") and current:
            articles.append("".join(current))
            current = []
        current.append(line)
    articles.append("".join(current))
    docs += [
        {"id": f"wiki-{i}", "text": a, "domain": "wiki", "source": "wikitext2"}
        for i, a in enumerate(articles)
        if a.strip()
    ]
    return docs
