"""The ``decontaminate-posttrain`` step: SFT, DPO and GRPO data checked against the eval sets.

Each post-training step's data (the user's file, or the generated quickstart data, resolved as
the step resolves it) is scanned with the same index as the pretraining corpus. A record is
read as its step reads it, as conversations of message texts without role names (an SFT chat; a
DPO prompt with each reply; a GRPO prompt with its answer), and each message is scanned after the
one before it, so an item is found across a question/answer boundary as it reads. The output holds
``contamination.json`` (per task: items found in the data and their share; records matched) and
``examples.json`` (per matched record: its position in the data and the items it holds). In
``remove`` mode the post-training step drops those records, each listed in its rejects with the
item it matched; in ``flag`` mode they stay, recorded.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.decontam.config import DecontamConfig
from llmflow.tasks.decontam.evalsets import eval_items
from llmflow.tasks.decontam.ngrams import build_index, scan_texts, whole_item_indexes
from llmflow.tasks.framework.step import Metrics, RawFiles, report_table, step

REPORT_FILE = "contamination.json"
EXAMPLES_FILE = "examples.json"
STEP_NAME = "decontaminate-posttrain"
BATCH = 512


class PostTrainDecontConfig(BaseModel):
    """Which post-training data to check (as its step resolves it) and against what."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["sft", "dpo", "grpo"]
    data: str = Field("quickstart", description="The step's data: 'quickstart' or a file.")
    num_quickstart_examples: int = 0
    num_heldout: int = 0
    seed: int = 0
    decontam: DecontamConfig


# a message's speaker, and a content part's type: never text an eval item could hold
ROLE_KEYS = ("role", "from", "type")


def record_strings(value: Any) -> list[str]:
    """Every string of a record in order, less the speakers' names (any layout)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() if k not in ROLE_KEYS for s in record_strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in record_strings(v)]
    return []


def _contents(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages]


def record_conversations(kind: str, record: Any) -> list[list[str]]:
    """The record's conversations as its step reads them, each a list of message texts.

    SFT: its one chat; DPO: the prompt with the chosen reply, and with the rejected one (never
    one reply after the other); GRPO: the prompt, then the reference answer. A record its step
    cannot read (it rejects it) gives its strings, one message each.
    """
    from llmflow.tasks.posttrain.formats import RecordError, normalize_preference, normalize_sft

    try:
        if kind == "sft":
            return [_contents(normalize_sft(record)["messages"])]
        if kind == "dpo":
            pair = normalize_preference(record)
            prompt = _contents(pair["prompt"])
            return [prompt + _contents(pair["chosen"]), prompt + _contents(pair["rejected"])]
    except RecordError:
        pass
    if kind == "grpo" and isinstance(record, dict) and "answer" in record:
        prompt = record.get("prompt", record.get("question"))
        return [record_strings(prompt) + record_strings(record["answer"])]
    return [record_strings(record)]


def record_texts(kind: str, record: Any) -> list[str]:
    """The texts of a record to scan: each message after the one before it (a question, then
    its answer, as an eval item reads), or alone in a conversation of one.

    NOTE: role names are left out: between a question and its answer they break every window
    that spans the two, so an item whose question and answer are each under n words (and an
    item matched whole) was never found in a chat.
    """
    texts = []
    for turns in record_conversations(kind, record):
        turns = [t for t in turns if t.strip()]
        if len(turns) == 1:
            texts.append(turns[0])
        texts += [f"{a}\n{b}" for a, b in pairwise(turns)]
    return texts


def posttrain_records(cfg: PostTrainDecontConfig, data_file: Path | None) -> list[Any]:
    """The records the post-training step reads, in its order (positions match its rejects)."""
    from llmflow.tasks.posttrain.formats import read_records
    from llmflow.tasks.posttrain.quickstart import (
        quickstart_grpo_prompts,
        quickstart_preference_pairs,
        quickstart_sft_examples,
    )

    if data_file is not None:
        return read_records(data_file)
    if cfg.data != "quickstart":
        return read_records(Path(cfg.data))
    n, seed = cfg.num_quickstart_examples, cfg.seed
    if cfg.kind == "sft":
        return quickstart_sft_examples(n, seed)
    if cfg.kind == "dpo":
        return quickstart_preference_pairs(n, seed)
    return quickstart_grpo_prompts(n, cfg.num_heldout, seed)[0]


@step(STEP_NAME, version=2)
def decontaminate_posttrain(
    cfg: PostTrainDecontConfig,
    out: Path,
    data: RawFiles | None = None,
    eval_files: RawFiles | None = None,
) -> Metrics:
    """Scan one post-training data set for eval items; write the report and matched records."""
    from llmflow.tasks.decontam.step import _local_files
    from llmflow.tasks.posttrain.common import local_data

    records = posttrain_records(cfg, local_data(data, out))
    decont = cfg.decontam
    with tempfile.TemporaryDirectory(prefix="llmflow-evalsets-") as tmp:
        items, _ = eval_items(decont, _local_files(eval_files, Path(tmp)))
    flat = [item for task_items in items.values() for item in task_items]
    indexes = [build_index(flat, decont.n, decont.query_ngrams, decont.overlap_ngrams)]
    indexes += whole_item_indexes(flat, decont.n, decont.min_item_words)
    texts, rows = [], []
    for position, record in enumerate(records):
        found = record_texts(cfg.kind, record)
        texts += found
        rows += [position] * len(found)
    matched: dict[int, set[tuple[str, int]]] = defaultdict(set)
    for index in (i for i in indexes if len(i.hashes)):
        for start in range(0, len(texts), BATCH):
            for hit in scan_texts(index, texts[start : start + BATCH]):
                owners = index.owners[hit.owner_slice[0] : hit.owner_slice[1]].tolist()
                matched[rows[start + hit.row]].update(index.items[o] for o in owners)
    report = posttrain_report(cfg, items, matched, len(records))
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1))
    examples = {str(i): sorted([t, k] for t, k in found) for i, found in sorted(matched.items())}
    (out / EXAMPLES_FILE).write_text(json.dumps({"mode": decont.mode, "records": examples}))
    rows = [{"task": t, **counts} for t, counts in report["tasks"].items()]
    report_table("posttrain-contamination", rows, f"Eval items in the {cfg.kind} data, per task")
    metrics: Metrics = {
        "records": report["records"],
        "records_contaminated": report["records_contaminated"],
    }
    metrics.update({f"{t}/share": c["share"] for t, c in report["tasks"].items()})
    return metrics


def posttrain_report(cfg, items: dict[str, list], matched, num_records: int) -> dict[str, Any]:
    found: dict[str, set[int]] = defaultdict(set)
    records: dict[str, set[int]] = defaultdict(set)
    for row, owners in matched.items():
        for task, item in owners:
            found[task].add(item)
            records[task].add(row)
    return {
        "kind": cfg.kind,
        "n": cfg.decontam.n,
        "mode": cfg.decontam.mode,
        "records": num_records,
        "records_contaminated": len(matched),
        "tasks": {
            task: {
                "items": len(task_items),
                "contaminated_items": len(found[task]),
                "share": round(len(found[task]) / len(task_items), 6) if task_items else None,
                "records": len(records[task]),
            }
            for task, task_items in items.items()
        },
    }


def excluded_records(check: Path | None) -> dict[int, str]:
    """Positions of the records a post-training step drops (``remove`` mode), with the reason."""
    if check is None:
        return {}
    found = json.loads((Path(check) / EXAMPLES_FILE).read_text())
    if found["mode"] != "remove":
        return {}
    return {
        int(i): "contaminated: " + ", ".join(f"{t}#{k}" for t, k in owners)
        for i, owners in found["records"].items()
    }


def drop_excluded(
    records: list, indices: list[int], exclude: dict[int, str]
) -> tuple[list, list[int], list[dict]]:
    """``records`` (at source ``indices``) less the excluded ones, and a reject for each."""
    kept, kept_indices, rejects = [], [], []
    for record, index in zip(records, indices, strict=True):
        if index in exclude:
            rejects.append({"index": index, "reason": "contaminated", "detail": exclude[index]})
        else:
            kept.append(record)
            kept_indices.append(index)
    return kept, kept_indices, rejects


def _posttrain_decont_config(kind: str, step_cfg, decont) -> PostTrainDecontConfig:
    """The check's config: the step's data, quickstart size, held-out share (GRPO) and seed."""
    return PostTrainDecontConfig(
        kind=kind,
        data=step_cfg.data,
        num_quickstart_examples=step_cfg.num_quickstart_examples,
        num_heldout=getattr(step_cfg, "num_heldout", 0) if kind == "grpo" else 0,
        seed=step_cfg.seed,
        decontam=decont,
    )


def add_posttrain_check(graph, kind: str, step_cfg, settings, evaluate, name: str, phase: str):
    """The ``decontaminate-posttrain`` node of one post-training step's data (the data input is
    the step's own: the user's file, hashed, or None for the generated quickstart data)."""
    from llmflow.tasks.decontam.config import decontam_config
    from llmflow.tasks.decontam.step import eval_set_files
    from llmflow.tasks.framework.graph import Raw

    decont = decontam_config(settings, evaluate)
    files = eval_set_files(decont, evaluate.data_root)
    cfg = _posttrain_decont_config(kind, step_cfg, decont)
    data = None if step_cfg.data == "quickstart" else Raw((step_cfg.data,))
    return graph.add(
        decontaminate_posttrain,
        cfg,
        f"{name}-{kind}",
        phase=phase,
        data=data,
        eval_files=Raw(files) if files else None,
    )
