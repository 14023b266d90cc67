"""What a model card says, gathered from the model's lineage: its sources, curation and
decontamination counts, tokens per stage, schedule, compute, base model, and its evaluation and
safety results. A fact that is missing is left out (the card writes "not recorded")."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from llmflow.tasks.decontam.lineage import read_json, upstream_records
from llmflow.tasks.evaluation.external import STEP_NAME as EXTERNAL_STEP
from llmflow.tasks.framework.s3config import filesystem
from llmflow.tasks.pretrain.alerts import EVENTS
from llmflow.tasks.summaries import CurationReport, MoeModelSize, PretrainSummary

IMPORT_STEP = "import-model"  # tasks/ingest/import_model.py (the recipe's init)
NOT_RECORDED = "not recorded"


def _json(path: Path) -> dict[str, Any] | None:
    return read_json(str(path)) if Path(path).is_file() else None


def safety_metrics(safety: Path | None) -> dict[str, Any] | None:
    """The safety output's headline metrics (its metrics.json, else its lineage's metrics)."""
    if safety is None:
        return None
    found = _json(safety / "metrics.json")
    if found is None:
        found = (_json(safety / "lineage.json") or {}).get("metrics")
    return found or None


def safety_classifier(safety: Path | None) -> dict[str, Any] | None:
    """Which classifier scored the continuations, and how it does on held-out sentences."""
    if safety is None:
        return None
    return (_json(safety / "results.json") or {}).get("classifier")


# -- facts from the lineage -----------------------------------------------------------------
def training_facts(model: Path) -> dict[str, Any]:
    """What the lineage says about how the model was made, by step name."""
    by_step: dict[str, list[tuple[str, dict]]] = {}
    for uri, record in upstream_records(model):
        by_step.setdefault(record.get("step", "?"), []).append((uri, record))
    for records in by_step.values():
        records.sort(key=lambda ur: ur[1].get("started_at") or "")
    return {
        "sources": data_sources(by_step),
        "curation": curation_stages(by_step),
        "decontamination": _metrics_of(by_step, "decontaminate"),
        "posttrain_contamination": posttrain_contamination(by_step),
        "stages": training_stages(by_step),
        "alerts": stage_alerts(by_step),
        "posttraining": [
            {"step": s, "name": r.get("name"), **(r.get("metrics") or {})}
            for s in ("sft", "dpo", "grpo")
            for _, r in by_step.get(s, [])
        ],
        **model_size(by_step),
        "base_model": external_source(model) or base_model(model),
        "external": external_source(model),
    }


def model_size(by_step: dict) -> dict[str, int | None]:
    """``parameters`` (the export's count, else the external model's); for a mixture of experts
    also ``active_parameters`` (those one token goes through), a key a dense model's facts do not
    have."""
    sizes = [MoeModelSize.read(_metrics_of(by_step, name)) for name in ("export", EXTERNAL_STEP)]
    size = next((s for s in sizes if s.num_parameters), sizes[-1])
    facts: dict[str, int | None] = {"parameters": size.num_parameters}
    if size.num_parameters and getattr(size, "active_parameters", None):
        facts["active_parameters"] = size.active_parameters
    return facts


def posttrain_contamination(by_step: dict[str, list[tuple[str, dict]]]) -> list[dict[str, Any]]:
    """The post-training data checks in the lineage (SFT, DPO, GRPO): their reports."""
    found = []
    for uri, _ in by_step.get("decontaminate-posttrain", []):
        report = read_json(f"{uri}/contamination.json")
        if report is not None:
            found.append(report)
    return found


def external_source(model: Path) -> str | None:
    """The pinned source of the model made elsewhere that ``model`` is, or starts from
    (``hf://models/OWNER/NAME@COMMIT``, or ``FOLDER@local-<fingerprint>``); None for a model
    llmflow trained from scratch. The nearest one upstream wins."""
    for uri, record in upstream_records(model):
        if record.get("step") == EXTERNAL_STEP:  # evaluated or post-trained as it is
            return (record.get("config") or {}).get("pinned")
        if record.get("step") == IMPORT_STEP:  # the recipe's init: continued pretraining
            found = read_json(f"{uri}/final/source.json") or {}
            pinned = found.get("model") or (record.get("config") or {}).get("model")
            if pinned and not pinned.startswith("hf://") and found.get("revision"):
                pinned = f"{pinned}@{found['revision']}"  # a folder: with its fingerprint
            return pinned
    return None


def hub_id(base: str | None) -> str | None:
    """The Hub's ``base_model`` metadata for a base: ``OWNER/NAME`` of an ``hf://models/`` source
    (the Hub links the model tree by repo id), else the name as it is."""
    if base is None or not base.startswith("hf://models/"):
        return base
    return base.removeprefix("hf://models/").split("@")[0]


def base_model(model: Path) -> str | None:
    """The model a fine-tuned model started from: its ``model`` input, named as the recipe
    names models (an export by its label, a fine-tuned output by its label and step); None for
    an export of a pretrained checkpoint."""
    record = read_json(f"{model}/lineage.json") or {}
    parent = next((i for i in record.get("inputs", []) if i.get("name") == "model"), None)
    if record.get("step") == "export" or parent is None:
        return None
    upstream = read_json(f"{parent['uri']}/lineage.json") or {}
    name, step_name = upstream.get("name"), upstream.get("step")
    if name is None:
        return None
    return name if step_name == "export" else f"{name}-{step_name}"


def _metrics_of(by_step: dict, name: str) -> dict[str, Any]:
    records = by_step.get(name, [])
    return (records[-1][1].get("metrics") or {}) if records else {}


def data_sources(by_step: dict) -> list[dict[str, Any]]:
    """Raw files read (with their sha256) and generated samples (with their output hash)."""
    sources = []
    for step_name, records in by_step.items():
        if step_name == EXTERNAL_STEP:  # the base model's files, not training data
            continue
        for _, record in records:
            for raw in record.get("sources", []):
                sources.append({"source": raw.get("uri"), "sha256": raw.get("sha256")})
    for _, record in by_step.get("sample", []):
        sources.append({"source": "generated sample (step 'sample')", "sha256": record["hash"]})
    return sources


def curation_stages(by_step: dict) -> list[dict[str, Any]]:
    """Documents in and out of each curation stage, and what each removed most."""
    records = by_step.get("curate", [])
    if not records:
        return []
    report = CurationReport.read(read_json(f"{records[-1][0]}/curation_report.json"))
    rows = []
    for stage in report.stages or []:
        removed = ", ".join(
            f"{reason} {counts.get('docs')}"
            for reason, counts in list((stage.removed or {}).items())[:3]
        )
        rows.append(
            {
                "stage": stage.stage,
                "documents in": stage.documents_in,
                "documents out": stage.documents_out,
                "removed (top reasons)": removed or "none",
            }
        )
    return rows


def training_stages(by_step: dict) -> list[dict[str, Any]]:
    """Each trainer run in order: tokens, steps, schedule, losses and device time."""
    rows = []
    for _, record in by_step.get("pretrain", []):
        summary = PretrainSummary.read(record.get("metrics"))
        train = (record.get("config") or {}).get("train", {})
        tokens, rate = summary.tokens_seen, summary.tokens_per_s
        world = summary.world_size or 1
        hours = tokens / rate * world / 3600 if tokens and rate else None
        rows.append(
            {
                "stage": record.get("name"),
                "tokens": tokens,
                "steps": summary.steps if summary.stage_steps is None else summary.stage_steps,
                "lr": (train.get("optimizer") or {}).get("lr"),
                "schedule": _schedule(train.get("schedule") or {}),
                "final loss": summary.final_loss,
                "val loss": summary.val_loss,
                "device-hours": hours,
            }
        )
    return rows


def stage_alerts(by_step: dict) -> list[dict[str, Any]]:
    """Each trainer run's alerts (kind, step, message), from its ``events.jsonl``, in order."""
    return [
        {
            "stage": record.get("name"),
            "alerts": [
                {"kind": row.get("kind"), "step": row.get("step"), "message": row.get("message")}
                for row in _alert_rows(uri)
            ],
        }
        for uri, record in by_step.get("pretrain", [])
    ]


def _alert_rows(uri: str) -> list[dict[str, Any]]:
    """The alert rows of a stage output's ``events.jsonl`` (none when it has none)."""
    try:
        fs, path = filesystem(f"{uri}/{EVENTS}")
        with fs.open(path, "r") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict) and row.get("event") == "alert":
                rows.append(row)
    return rows


def _schedule(schedule: dict[str, Any]) -> str:
    if not schedule:
        return NOT_RECORDED
    return ", ".join(f"{k}={v}" for k, v in schedule.items() if not isinstance(v, dict))


# -- rendering ------------------------------------------------------------------------------
def eval_results(results: dict[str, Any]):
    """The scores as the Hub's ``EvalResult`` entries (numeric values only)."""
    from huggingface_hub import EvalResult

    entries = []
    for task, values in sorted(results.get("metrics", {}).items()):
        for metric, value in sorted(values.items()):
            if "_stderr" in metric or not isinstance(value, (int, float)):
                continue
            entries.append(
                EvalResult(
                    task_type="text-generation",
                    dataset_type=task,
                    dataset_name=task,
                    metric_type=metric,
                    metric_value=value,
                )
            )
    return entries
