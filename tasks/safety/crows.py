"""CrowS-Pairs through lm-eval, as its ``crows_pairs_english`` task scores it, from a local file.

lm-eval's task loads the pairs from the Hub; here the same task definition (its own
``doc_to_choice`` and ``process_results``) reads a local copy, so it runs offline. A pair counts
as preferring the stereotype when the more-stereotyping sentence has the higher log-likelihood;
50% is unbiased. Per bias type is aggregated from the logged samples.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from llmflow.tasks.safety.data import read_crows

TASK = "crows_pairs_local"
UTILS = "from lm_eval.tasks.crows_pairs.utils import doc_to_choice, process_results  # noqa\n"


def write_task(rows: list[dict], folder: Path) -> Path:
    """lm-eval's crows_pairs_english YAML, pointed at ``rows`` written as local JSONL."""
    data = folder / "crows_pairs.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    (folder / "crows_utils.py").write_text(UTILS)
    task = {
        "task": TASK,
        "dataset_path": "json",
        # NOTE: absolute data_files: lm-eval resolves relative ones against the CWD.
        "dataset_kwargs": {
            "data_files": {"test": str(data.resolve())},
            "cache_dir": str(folder / ".hf_datasets_cache"),
        },
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "",
        "doc_to_target": 0,
        "target_delimiter": "",
        "metric_list": [
            {"metric": "likelihood_diff", "aggregation": "mean", "higher_is_better": False},
            {"metric": "pct_stereotype", "aggregation": "mean", "higher_is_better": False},
        ],
        "metadata": {"version": 1.0},
    }
    functions = (
        "doc_to_choice: !function crows_utils.doc_to_choice\n"
        "process_results: !function crows_utils.process_results\n"
    )
    path = folder / f"{TASK}.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False) + functions)
    return folder


def crows_pairs(lm, csv_path: Path, limit: int | None) -> dict[str, Any]:
    """Share of pairs where ``lm`` prefers the stereotype, overall and per bias type."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    rows = read_crows(csv_path, limit)
    with tempfile.TemporaryDirectory(prefix="llmflow-crows-") as tmp:
        manager = TaskManager(include_path=str(write_task(rows, Path(tmp))), include_defaults=False)
        raw = simple_evaluate(
            model=lm, tasks=[TASK], task_manager=manager, log_samples=True, bootstrap_iters=0
        )
    return summarize(raw["samples"][TASK])


def summarize(samples: list[dict]) -> dict[str, Any]:
    """Overall and per-bias-type stereotype share and mean likelihood gap of logged samples."""
    by_type: dict[str, list[dict]] = defaultdict(list)
    for sample in samples:
        by_type[sample["doc"]["bias_type"]].append(sample)
    return {
        "pairs": len(samples),
        "pct_stereotype": _mean(samples, "pct_stereotype"),
        "likelihood_diff": _mean(samples, "likelihood_diff"),
        "by_bias_type": {
            kind: {"pairs": len(group), "pct_stereotype": _mean(group, "pct_stereotype")}
            for kind, group in sorted(by_type.items())
        },
    }


def _mean(samples: list[dict], key: str) -> float:
    return sum(float(s[key]) for s in samples) / len(samples)
