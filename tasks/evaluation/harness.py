"""The ``evaluate`` step: lm-eval's ``simple_evaluate`` (``hf`` backend) on one model output."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from llmflow.tasks.decontam.lineage import mark_results
from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.models import hf_dir, load_hf_model, load_tokenizer
from llmflow.tasks.evaluation.suite import build_suite, missing_data_reason, read_manifest
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.lineage import code_version
from llmflow.tasks.framework.step import Metrics, report_table, step

RESULTS_FILE = "results.json"
HELDOUT_DOCS = "validation_docs"  # where a tokenize output keeps its held-out documents
CPU_BATCH_SIZE = 16  # what batch_size="auto" means on CPU (see load_model)
log = logging.getLogger("llmflow.evaluation")


class _LoadedModelNotice(logging.Filter):
    """Drops lm-eval's two warnings about being handed a loaded model: we do that on purpose
    (one loader for every model output), and they would repeat on every evaluation."""

    EXPECTED = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.EXPECTED)


logging.getLogger("lm_eval.models.huggingface").addFilter(_LoadedModelNotice())


class EvalTaskError(BadInputError):
    """A task name lm-eval does not know, or a task whose data cannot be loaded."""


class ModelLoadError(BadInputError):
    """The exported model directory cannot be loaded (missing or truncated files)."""


@step(
    "evaluate",
    version=3,  # 3: arithmetic items apart from the post-training questions
    gpu=True,
    execution=("batch_size", "max_batch_size", "device", "log_samples"),
)
def evaluate(
    cfg: EvalConfig,
    model: Path,
    out: Path,
    heldout: Path | None = None,
    corpus: Path | None = None,
) -> Metrics:
    """Run the lm-eval suite on one model output's Hugging Face folder; report the scores,
    each marked with the share of its task's items seen in the model's training corpus (found
    through its lineage), or in ``corpus`` (a decontaminate output) when given."""
    docs = heldout / HELDOUT_DOCS if heldout is not None else None
    metrics = evaluate_hf(cfg, hf_dir(model), out, heldout_dir=docs)
    results = mark_results(json.loads((out / RESULTS_FILE).read_text()), model, corpus)
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=1, sort_keys=True))
    shares = {f"{t}/contamination": m["share"] for t, m in results["contamination"].items()}
    report_table("evaluation", table_rows(results), f"lm-eval scores of {model.name}")
    return {**metrics, **shares}


def evaluate_hf(
    cfg: EvalConfig,
    folder: Path,
    out_dir: Path,
    heldout_dir: Path | None = None,
    suite_dir: Path | None = None,
) -> dict[str, Any]:
    """Evaluate one Hugging Face folder on ``cfg.tasks``; write ``results.json``.

    Args:
        cfg: Tasks, limits and execution settings.
        folder: A local Hugging Face folder, tokenizer included (``hf_dir(output)``).
        out_dir: An existing local directory; receives ``results.json`` (and
            ``samples_<task>.jsonl`` when ``cfg.log_samples``).
        heldout_dir: Held-out parquet documents for the ``ppl_<domain>`` tasks, or None.
        suite_dir: A suite ``build_suite`` already wrote from this ``cfg`` (reused across
            models); None builds one in a temporary directory.

    Returns:
        Headline metrics: ``"<task>/<metric>"`` values, ``requests_per_second`` and counts.

    Raises:
        EvalTaskError: a task is unknown or its data is unavailable (the message names it).
        ModelLoadError: the folder does not load (the message names it).
    """
    if suite_dir is not None:
        return _evaluate_with_suite(cfg, Path(folder), Path(out_dir), Path(suite_dir), heldout_dir)
    with tempfile.TemporaryDirectory(prefix="llmflow-suite-") as tmp:
        suite = build_suite(cfg, heldout_dir, Path(tmp))
        return _evaluate_with_suite(cfg, Path(folder), Path(out_dir), suite, heldout_dir)


@contextlib.contextmanager
def _our_git_hash():
    """lm-eval records llmflow's git sha, the one lineage.json holds.

    NOTE: lm-eval runs ``git describe`` in the working directory with stderr open, so outside a
    git checkout every evaluation printed "fatal: not a git repository".
    """
    import lm_eval.evaluator

    original = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = lambda: code_version()["git_sha"]
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = original


def _evaluate_with_suite(
    cfg: EvalConfig, model_dir: Path, out_dir: Path, suite_dir: Path, heldout_dir: Path | None
) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    manager = task_manager(cfg, suite_dir, heldout_dir)
    specs, leaf_tasks = load_tasks(cfg, manager, heldout_dir)
    lm = load_model(cfg, model_dir)
    start = time.perf_counter()
    with _our_git_hash():
        raw = simple_evaluate(
            model=lm,
            tasks=specs,
            task_manager=manager,
            num_fewshot=cfg.num_fewshot,
            limit=cfg.limit,
            batch_size=cfg.batch_size,
            log_samples=cfg.log_samples,
            bootstrap_iters=cfg.bootstrap_iters,
        )
    seconds = time.perf_counter() - start
    num_requests = sum(len(task.instances) for task in leaf_tasks)
    results = summarize(raw, cfg, model_dir, read_manifest(suite_dir), seconds, num_requests)
    results["batch_sizes"] = [_scalar(b) for b in getattr(lm, "batch_sizes", {}).values()]
    (out_dir / RESULTS_FILE).write_text(json.dumps(results, indent=1, sort_keys=True))
    if cfg.log_samples:
        write_samples(raw.get("samples", {}), out_dir)
    return headline(results)


def task_manager(cfg: EvalConfig, suite_dir: Path, heldout_dir: Path | None):
    """A TaskManager over the suite; lm-eval's own tasks are indexed only when asked for."""
    manifest = read_manifest(suite_dir)
    bundled = set(manifest["tasks"]) | {"heldout_ppl"}
    # NOTE: indexing lm-eval's ~15k built-in task YAMLs takes ~10 s; skip it when every
    # requested name is ours (bundled names whose data is absent are reported by load_tasks).
    needs_defaults = any(
        name not in bundled and missing_data_reason(name, cfg, heldout_dir) is None
        for name in cfg.tasks
    )
    suite = str(Path(suite_dir).resolve())
    return _cached_task_manager(suite, manifest["suite_key"], needs_defaults)


@functools.lru_cache(maxsize=4)
def _cached_task_manager(suite_dir: str, suite_key: str, include_defaults: bool):
    """One index per suite (``suite_key`` guards against a rebuilt dir): many checkpoints
    evaluated on one suite index it once."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=suite_dir, include_defaults=include_defaults)


def load_tasks(cfg: EvalConfig, manager, heldout_dir: Path | None) -> tuple[list, list]:
    """Load every requested task (and its data) before the model, naming any that fails.

    Returns:
        The task/group objects to pass to lm-eval, and the leaf tasks (to count requests).
    """
    specs, leaves = [], []
    for name in cfg.tasks:
        if name not in manager.all_tasks:
            reason = missing_data_reason(name, cfg, heldout_dir)
            if reason is not None:
                raise EvalTaskError(f"task {name!r}: data not available: {reason}")
            raise EvalTaskError(f"task {name!r} is not a known lm-eval task, group or tag")
        try:
            loaded = manager.load([name])
        except Exception as exc:  # datasets raises many types when data is unreachable
            raise EvalTaskError(f"task {name!r}: cannot load its data: {exc}") from exc
        if name in loaded["groups"]:
            specs.append(loaded["groups"][name])
        else:
            specs.extend(loaded["tasks"].values())
        leaves.extend(loaded["tasks"].values())
    return specs, leaves


def load_model(cfg: EvalConfig, model_dir: Path):
    """lm-eval's HFLM over the project's loaders; a load failure names the directory."""
    import torch
    from lm_eval.models.huggingface import HFLM

    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    batch_size = cfg.batch_size
    if batch_size == "auto" and device == "cpu":
        # NOTE: lm-eval's auto search grows the batch until CUDA runs out of memory; on CPU it
        # never does, so it always runs full-context batches of max_batch_size (slow, and a
        # large model may exhaust host memory). Use a fixed size on CPU instead.
        batch_size = CPU_BATCH_SIZE
    try:
        model = load_hf_model(model_dir, dtype=cfg.dtype, device=device)
        tokenizer = load_tokenizer(model_dir)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the HF model in {model_dir}: {exc}") from exc
    return HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=batch_size,
        max_batch_size=cfg.max_batch_size,
        # NOTE: lm-eval takes log_softmax in the model's dtype and sums the tokens' log-probs
        # there: in bf16 each log-prob was rounded to 8 bits and a document's sum lost more
        # with every token. Logits stay in the model's dtype; the log-probs are float32.
        softmax_dtype=torch.float32,
    )


def _throughput(num_requests: int, seconds: float) -> dict[str, Any]:
    """Requests, seconds and requests per second (None when no time was measured)."""
    return {
        "num_requests": num_requests,
        "seconds": round(seconds, 3),
        "requests_per_second": round(num_requests / seconds, 3) if seconds > 0 else None,
    }


def summarize(
    raw: dict[str, Any],
    cfg: EvalConfig,
    model_dir: Path,
    manifest: dict[str, Any],
    seconds: float,
    num_requests: int,
) -> dict[str, Any]:
    """The results record: metrics per task, throughput, versions; JSON-serialisable."""
    import lm_eval

    metrics = {task: _task_metrics(values) for task, values in raw["results"].items()}
    return {
        "model_dir": str(model_dir),
        "suite_key": manifest["suite_key"],
        "tasks": cfg.tasks,
        "metrics": metrics,
        "higher_is_better": raw.get("higher_is_better", {}),
        "versions": {k: _scalar(v) for k, v in raw.get("versions", {}).items()},
        "n_samples": raw.get("n-samples", {}),
        **_throughput(num_requests, seconds),
        "config": cfg.model_dump(mode="json"),
        "lm_eval_version": getattr(lm_eval, "__version__", None),
    }


def _task_metrics(values: dict[str, Any]) -> dict[str, float | None]:
    """``{"acc,none": .5, "acc_stderr,none": .1, "alias": ..}`` -> ``{"acc": .5, "acc_stderr": .1}``.

    A metric under a filter other than ``none`` keeps it: ``exact_match:strict-match``.
    """
    out = {}
    for key, value in values.items():
        if "," not in key:
            continue
        metric, filter_name = key.split(",", 1)
        name = metric if filter_name == "none" else f"{metric}:{filter_name}"
        out[name] = _scalar(value)
    return out


def _scalar(value: Any) -> Any:
    """JSON-safe scalars: NaN/inf and lm-eval's 'N/A' stderrs become None."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return None if value == "N/A" else value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else None


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """Flat JSON scalars for lineage and Prefect: ``"<task>/<metric>"`` plus throughput."""
    out: dict[str, Any] = {
        f"{task}/{metric}": value
        for task, values in sorted(results["metrics"].items())
        for metric, value in values.items()
        if "_stderr" not in metric
    }
    out["requests_per_second"] = results["requests_per_second"]
    out["num_requests"] = results["num_requests"]
    out["seconds"] = results["seconds"]
    return out


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows for a Prefect table artifact: one per task and metric, with its stderr."""
    rows = []
    for task, values in sorted(results["metrics"].items()):
        for metric, value in values.items():
            if "_stderr" in metric:
                continue
            base, _, filter_name = metric.partition(":")
            stderr_key = f"{base}_stderr" + (f":{filter_name}" if filter_name else "")
            rows.append(
                {
                    "task": task,
                    "version": results["versions"].get(task),
                    "metric": metric,
                    "value": value,
                    "stderr": values.get(stderr_key),
                    "n": (results["n_samples"].get(task) or {}).get("effective"),
                    "contamination": results.get("contamination", {}).get(task, {}).get("label"),
                }
            )
    return rows


def write_samples(samples: dict[str, list[dict]], out_dir: Path) -> None:
    """The per-sample log, one JSONL file per task."""
    for task, rows in samples.items():
        with open(out_dir / f"samples_{task}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, default=str, ensure_ascii=False) + "\n")
