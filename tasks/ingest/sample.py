"""The quickstart corpus, made on the user's machine from what every Python installation has.

Three domains: English prose (the Python reference documentation in ``pydoc_data.topics``), code
(the standard library's own sources) and generated arithmetic word problems with their answers.
Curation gets real work: exact duplicates, near duplicates (a few words changed) and junk
documents (boilerplate, symbol soup, repeated lines) are planted, and ``manifest.json`` lists every
planted document and what it is, so tests can score curation. Deterministic by seed for a given
Python installation; nothing is downloaded.
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.framework.step import Metrics, step

_NAMES = ["Ada", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo"]
_ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stamps", "shells", "cards"]
_BOILERPLATE = [
    "Home | About us | Contact | Privacy policy | Terms of service",
    "We use cookies to improve your experience. Click accept to continue.",
    "Subscribe to our newsletter! Sign up now and get 10% off your first order.",
    "Copyright 2024 All rights reserved. Powered by WordPress.",
    "Share on Facebook Share on Twitter Share on LinkedIn Email this page",
]


class SampleConfig(BaseModel):
    """How the quickstart corpus is made."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, description="Seed for every random choice.")
    num_shards: int = Field(4, ge=1, le=64, description="Number of JSONL files written.")
    num_code_files: int = Field(
        48, ge=0, description="Standard-library modules taken as code docs."
    )
    max_code_chars: int = Field(
        6000, ge=200, description="Code documents are cut at a line below this."
    )
    num_math_docs: int = Field(400, ge=0, description="Generated arithmetic documents.")
    prose_chunk_chars: int = Field(
        3000, ge=200, description="Prose topics are split at paragraphs near this size."
    )
    num_exact_duplicates: int = Field(40, ge=0, description="Planted exact copies.")
    num_near_duplicates: int = Field(
        40, ge=0, description="Planted copies with 1-3 words replaced."
    )
    num_junk: int = Field(30, ge=0, description="Planted junk documents.")


def _prose_docs(chunk_chars: int) -> list[str]:
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        paragraphs = [p.strip() for p in topics[key].split("\n\n") if p.strip()]
        chunk: list[str] = []
        for paragraph in paragraphs:
            chunk.append(paragraph)
            if sum(len(p) for p in chunk) >= chunk_chars:
                docs.append("\n\n".join(chunk))
                chunk = []
        if chunk and sum(len(p) for p in chunk) > 200:
            docs.append("\n\n".join(chunk))
    return docs


def _code_docs(rng: random.Random, count: int, max_chars: int) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))
    docs = []
    for path in rng.sample(files, min(count, len(files))):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) > max_chars:
            text = text[: text.rfind("\n", 0, max_chars)]
        if len(text) > 200:
            docs.append(text)
    return docs


def _math_problem(rng: random.Random) -> str:
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    kind = rng.choice(["add", "sub", "mul"])
    if kind == "add":
        q = f"{name} has {a} {item}. {other} gives {name} {b} more {item}. How many {item} does {name} have now?"
        ans, work = a + b, f"{a} + {b} = {a + b}"
    elif kind == "sub":
        a = a + b
        q = f"{name} has {a} {item} and gives {b} of them to {other}. How many {item} are left?"
        ans, work = a - b, f"{a} - {b} = {a - b}"
    else:
        a, b = a % 12 + 2, b % 9 + 2
        q = f"{name} buys {a} boxes with {b} {item} in each box. How many {item} is that in total?"
        ans, work = a * b, f"{a} * {b} = {a * b}"
    return f"Question: {q}\nAnswer: {work}. The answer is {ans}."


def _math_docs(rng: random.Random, count: int) -> list[str]:
    return ["\n\n".join(_math_problem(rng) for _ in range(rng.randint(3, 8))) for _ in range(count)]


def _near_copy(rng: random.Random, text: str) -> str:
    words = text.split(" ")
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(words))
        words[i] = rng.choice(["alpha", "bravo", "delta", "omega", "zeta"])
    return " ".join(words)


def _junk(rng: random.Random, kind: str) -> str:
    if kind == "boilerplate":
        return "\n".join(rng.choice(_BOILERPLATE) for _ in range(rng.randint(6, 14)))
    if kind == "symbol_soup":
        alphabet = "#$%&*@!{}[]<>|~^=+"
        return " ".join("".join(rng.choices(alphabet, k=rng.randint(3, 9))) for _ in range(120))
    line = rng.choice(_BOILERPLATE)
    return "\n".join([line] * rng.randint(20, 40))


def make_sample(cfg: SampleConfig, out_dir: Path) -> dict[str, Any]:
    """Write the quickstart corpus as JSONL shards plus ``manifest.json`` into ``out_dir``.

    Records are ``{"id", "text", "domain"}``. The manifest maps each planted id to its kind
    (``exact_copy``, ``near_copy`` or ``junk``) and, for copies, the id of the original.
    """
    rng = random.Random(cfg.seed)
    records: list[dict[str, str]] = []
    for domain, texts in (
        ("prose", _prose_docs(cfg.prose_chunk_chars)),
        ("code", _code_docs(rng, cfg.num_code_files, cfg.max_code_chars)),
        ("math", _math_docs(rng, cfg.num_math_docs)),
    ):
        records += [
            {"id": f"{domain}-{i:05d}", "text": t, "domain": domain} for i, t in enumerate(texts)
        ]
    originals = [r for r in records if r["domain"] != "code"] + [
        r for r in records if r["domain"] == "code"
    ]
    manifest: dict[str, dict[str, str]] = {}
    for i, source in enumerate(
        rng.sample(originals, min(cfg.num_exact_duplicates, len(originals)))
    ):
        copy_id = f"exact-{i:05d}"
        records.append({"id": copy_id, "text": source["text"], "domain": source["domain"]})
        manifest[copy_id] = {"kind": "exact_copy", "of": source["id"]}
    prose_like = [
        r for r in records if r["domain"] in ("prose", "math") and r["id"] not in manifest
    ]
    exact_sources = {m["of"] for m in manifest.values()}
    candidates = [
        r for r in prose_like if r["id"] not in exact_sources and len(r["text"].split()) > 60
    ]
    for i, source in enumerate(
        rng.sample(candidates, min(cfg.num_near_duplicates, len(candidates)))
    ):
        copy_id = f"near-{i:05d}"
        records.append(
            {"id": copy_id, "text": _near_copy(rng, source["text"]), "domain": source["domain"]}
        )
        manifest[copy_id] = {"kind": "near_copy", "of": source["id"]}
    for i in range(cfg.num_junk):
        kind = ("boilerplate", "symbol_soup", "repeated_lines")[i % 3]
        junk_id = f"junk-{i:05d}"
        records.append({"id": junk_id, "text": _junk(rng, kind), "domain": "prose"})
        manifest[junk_id] = {"kind": "junk", "junk_kind": kind}
    rng.shuffle(records)
    out_dir.mkdir(parents=True, exist_ok=True)
    for shard in range(cfg.num_shards):
        with open(out_dir / f"sample-{shard:02d}.jsonl", "w", encoding="utf-8") as f:
            for record in records[shard :: cfg.num_shards]:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    by_domain = {d: sum(r["domain"] == d for r in records) for d in ("prose", "code", "math")}
    return {
        "num_documents": len(records),
        "num_planted": len(manifest),
        **{f"docs_{k}": v for k, v in by_domain.items()},
    }


@step("sample")
def sample(cfg: SampleConfig, out: Path) -> Metrics:
    """Generate the quickstart corpus into ``files/`` and its ground truth into ``manifest.json``."""
    metrics = make_sample(cfg, out / "files")
    (out / "files" / "manifest.json").rename(out / "manifest.json")
    return metrics
