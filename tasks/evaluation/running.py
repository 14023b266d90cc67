"""Scores of a running stage's checkpoints, a reference curve on the same token axis, regressions.

A stage's intermediate checkpoints (``checkpoints/step-NNNNNN/``, DCP only, pruned to the newest
``keep_last`` by the trainer) are read while training goes on: each is held from pruning while it
is read (:func:`hold`, a hold file the checkpointer's pruning respects; a hold whose process died
or that was not refreshed expires), its weights converted (DCP -> our model, and a Hugging Face
folder for lm-eval), then scored on held-out loss (the trainer's own loss on packed held-out
sequences) and a cheap lm-eval suite. Each score is a JSON file per checkpoint, named by the
checkpoint's step and a key over the checkpoint's checksums and everything that defines the score
(content addressed), so a rerun finds it instead of scoring again.

A reference curve is the same scores of another run's checkpoints (its stage folder) or of a
series of model folders (a trainer checkpoint, a model output, a Hugging Face folder or an
``hf://models/OWNER/NAME@REVISION``), each placed at the tokens it had seen. A checkpoint of the
run regresses when a metric is worse than the reference interpolated at the same tokens by more
than the metric's noise band (what clean runs with other seeds differ by); each regression is an
``eval_regression`` alert in the stage's ``events.jsonl``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.hashing import digest, versioned_fields

log = logging.getLogger("llmflow.evaluation.running")

SCORES_VERSION = "1"
HELDOUT_LOSS = "heldout_loss"
LOWER_IS_BETTER = ("loss", "perplexity", "bits_per_byte")
# NOTE: measured at quickstart scale (benchmarks/bench_eval_overhead.py, results/eval-noise-band-
# 20261127.jsonl): 5 clean seeds differ by at most 0.129 nats of held-out loss at equal tokens,
# so 1.5x that, rounded up; a planted learning rate cut 10x sat 0.77 or more above. Larger
# models differ by less: measure a recipe's own band with the benchmark and set noise_band.
DEFAULT_NOISE_BAND = {HELDOUT_LOSS: 0.2}


class ScoringConfig(BaseModel):
    """What a checkpoint is scored on: held-out loss and, with a tokenizer, an lm-eval suite."""

    model_config = ConfigDict(extra="forbid")

    heldout: str | None = Field(
        None,
        description="Packed held-out sequences (a folder with meta.json, such as the stage's "
        "validation input) for the held-out loss; None: no held-out loss.",
    )
    heldout_batches: int = Field(8, description="Batches of held-out sequences per score.")
    batch_size: int = Field(8, description="Sequences per held-out batch.")
    tokenizer: str | None = Field(
        None,
        description="A tokenizer folder (the tokenizer step's output); None: no lm-eval suite "
        "(the converted checkpoint needs one).",
    )
    suite: EvalConfig = Field(
        default_factory=lambda: EvalConfig(
            tasks=["cf_arith", "cf_facts"], num_items=1000, batch_size=16
        ),
        description="The cheap lm-eval suite (about 1,000 items per task on real recipes).",
    )

    @field_validator("heldout_batches", "batch_size")
    @classmethod
    def _positive(cls, value: int, info) -> int:
        if value < 1:
            raise ValueError(f"{info.field_name}={value} must be >= 1")
        return value


# -- holds ------------------------------------------------------------------------------------
@contextlib.contextmanager
def hold(checkpoint: Path, ttl_s: float | None = None) -> Iterator[bool]:
    """Hold ``checkpoint`` from pruning while the block runs; yields whether it still exists.

    The hold is a file the checkpointer's pruning reads (``checkpointer.is_held``), refreshed
    every third of ``ttl_s`` by a thread, removed at the end. A holder that dies leaves a stale
    file: the pruner ignores it once the process is gone (same host) or ``ttl_s`` has passed.
    """
    from llmflow.tasks.pretrain.checkpoint import is_complete
    from llmflow.tasks.pretrain.checkpointer import HOLD_TTL_S, holds_locked

    checkpoint = Path(checkpoint)
    ttl_s = HOLD_TTL_S if ttl_s is None else ttl_s
    out_dir = checkpoint.parent.parent
    host = socket.gethostname()
    with holds_locked(out_dir) as holds:
        holds.mkdir(exist_ok=True)
        path = holds / f"{checkpoint.name}.{host}.{os.getpid()}.{threading.get_ident()}"
        path.write_text(json.dumps({"pid": os.getpid(), "host": host, "ttl_s": ttl_s}))
        present = is_complete(checkpoint)  # NOTE: checked under the lock, after the hold
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(ttl_s / 3):
            with contextlib.suppress(OSError):
                os.utime(path)

    keeper = threading.Thread(target=refresh, name="checkpoint-hold", daemon=True)
    keeper.start()
    try:
        yield present
    finally:
        stop.set()
        keeper.join()
        path.unlink(missing_ok=True)


# -- reading a model -------------------------------------------------------------------------
def progress_of(folder: Path) -> tuple[int | None, int | None]:
    """``(step, tokens_seen)`` of a trainer checkpoint (the whole curriculum's tokens) or a model
    output (``progress.json``); Nones where the folder does not say."""
    folder = Path(folder)
    state = folder / "trainer_state.json"
    if state.is_file():
        train = json.loads(state.read_text())["train"]
        return train["step"], train.get("tokens_before", 0) + train["tokens_seen"]
    from llmflow.tasks.evaluation.models import read_progress

    progress = read_progress(folder)
    return progress["step"], progress["tokens_seen"]


def read_model(folder: Path):
    """Our ``Transformer`` (CPU, float32, eval mode) from a trainer checkpoint (DCP or
    ``model.safetensors``), a model output (``hf/``) or a Hugging Face folder."""
    import torch

    from llmflow.model.config import ModelConfig
    from llmflow.model.hf import load_model
    from llmflow.model.transformer import Transformer

    folder = Path(folder)
    if (folder / "model_config.json").is_file() and (folder / "dcp").is_dir():
        from llmflow.tasks.pretrain.checkpoint import load_checkpoint

        cfg = ModelConfig(**json.loads((folder / "model_config.json").read_text()))
        model = Transformer(cfg)
        load_checkpoint(folder, model, [], load_optimizer=False)
    elif (folder / "model_config.json").is_file():
        model = load_model(folder)
    else:
        model = _read_hf_model(folder)
    return model.to(torch.float32).eval()


def _read_hf_model(folder: Path):
    """Our ``Transformer`` from a model output (``hf/``) or a Hugging Face folder."""
    from llmflow.model.hf import import_hf
    from llmflow.model.transformer import Transformer

    hf = folder / "hf" if (folder / "hf" / "config.json").is_file() else folder
    if not (hf / "config.json").is_file():
        raise BadInputError(f"{folder}: neither a trainer checkpoint nor a model folder")
    cfg, state = import_hf(hf)
    model = Transformer(cfg)
    model.load_state_dict(state)
    return model


def identity(folder: Path) -> str:
    """What the weights of ``folder`` are: its checksums (a trainer checkpoint) or its files'
    fingerprint (names, sizes, times)."""
    sums = Path(folder) / "checksums.json"
    if sums.is_file():
        return hashlib.sha256(sums.read_bytes()).hexdigest()
    from llmflow.tasks.ingest.models import fingerprint

    return fingerprint(Path(folder))


# -- scoring ---------------------------------------------------------------------------------
def heldout_loss(model, heldout: Path, batches: int, batch_size: int) -> float:
    """Token-mean cross-entropy of the first ``batches`` held-out batches: the trainer's loss
    (``model_loss``, as the stage's validator computes it), forward only, one process."""
    import torch

    from llmflow.tasks.dataprep.loader import IGNORE_INDEX, PackedLoader
    from llmflow.tasks.pretrain.train import model_loss

    loader = PackedLoader(Path(heldout), batch_size, 0, 1, seed=0)
    total = count = 0.0
    try:
        with torch.no_grad():
            for _ in range(min(batches, max(loader.num_sequences // batch_size, 1))):
                batch = loader.next_batch()
                _, metrics = model_loss(model, batch, 0.0)
                n = float((batch["labels"] != IGNORE_INDEX).sum())
                total += float(metrics["ce"]) * n
                count += n
    finally:
        loader.close()
    return total / max(count, 1.0)


def suite_scores(cfg: ScoringConfig, model, suite_dir: Path) -> dict[str, float]:
    """The lm-eval suite on ``model`` exported (with the tokenizer) to a temporary HF folder."""
    from llmflow.model.hf import export_hf
    from llmflow.tasks.evaluation.harness import evaluate_hf

    with tempfile.TemporaryDirectory(prefix="llmflow-running-eval-") as tmp:
        folder = Path(tmp) / "hf"
        export_hf(model.state_dict(), model.cfg, folder, Path(cfg.tokenizer))
        scores = evaluate_hf(cfg.suite, folder, Path(tmp), suite_dir=suite_dir)
    skip = {"requests_per_second", "num_requests", "seconds"}
    return {k: v for k, v in scores.items() if k not in skip and isinstance(v, (int, float))}


def score_key(cfg: ScoringConfig, weights: str) -> str:
    """The content address of one checkpoint's scores: its weights and what scores them."""
    heldout = None
    if cfg.heldout is not None:
        meta = Path(cfg.heldout) / "meta.json"
        heldout = hashlib.sha256(meta.read_bytes()).hexdigest() if meta.is_file() else cfg.heldout
    tokenizer = None
    if cfg.tokenizer is not None:
        files = sorted(p for p in Path(cfg.tokenizer).iterdir() if p.is_file())
        tokenizer = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    return digest(
        {
            "version": SCORES_VERSION,
            "weights": weights,
            "heldout": heldout,
            "heldout_batches": cfg.heldout_batches,
            "batch_size": cfg.batch_size,
            "tokenizer": tokenizer,
            "suite": versioned_fields(cfg.suite) if tokenizer else None,
        }
    )


@dataclass
class Scorer:
    """Scores checkpoints with one ``ScoringConfig``, caching each under ``results``."""

    cfg: ScoringConfig
    results: Path
    hold_ttl_s: float | None = None
    _suite_dir: Path | None = None

    def cached(self, label: str, step: int | None, key: str) -> dict[str, Any] | None:
        """The scores stored under ``key``: filed under this label, or under another one (the
        same weights named as a reference checkpoint and as a stage's)."""
        path = self._path(label, step, key)
        if not path.is_file():
            path = next(self.results.glob(f"*/*-{key}.json"), path)
        return json.loads(path.read_text()) if path.is_file() else None

    def _path(self, label: str, step: int | None, key: str) -> Path:
        name = f"step-{step:06d}" if step is not None else "model"
        return self.results / label / f"{name}-{key}.json"

    def score(self, label: str, folder: Path, tokens_seen: int | None = None) -> dict | None:
        """The scores of one checkpoint or model folder (cached); None when it is gone (pruned
        before its hold was placed)."""
        from llmflow.tasks.pretrain.checkpoint import is_complete

        folder = Path(folder)
        step_checkpoint = folder.parent.name == "checkpoints"
        if step_checkpoint and still_training(folder.parent.parent):
            held = hold(folder, self.hold_ttl_s)
        else:  # NOTE: a stage that wrote final/ meanwhile may have pruned it before
            held = contextlib.nullcontext(
                is_complete(folder) if step_checkpoint else folder.is_dir()
            )
        with held as present:
            if not present:
                return None
            step, seen = progress_of(folder)
            key = score_key(self.cfg, identity(folder))
            found = self.cached(label, step, key)
            if found is not None:
                return {**found, "label": label, "checkpoint": str(folder), "cached": True}
            started = time.perf_counter()
            model = read_model(folder)  # NOTE: the only read of the checkpoint's files
        metrics: dict[str, float] = {}
        if self.cfg.heldout is not None:
            metrics[HELDOUT_LOSS] = heldout_loss(
                model, Path(self.cfg.heldout), self.cfg.heldout_batches, self.cfg.batch_size
            )
        if self.cfg.tokenizer is not None:
            metrics.update(suite_scores(self.cfg, model, self.suite_dir()))
        row = {
            "label": label,
            "checkpoint": str(folder),
            "step": step,
            "tokens_seen": seen if seen is not None else tokens_seen,
            "key": key,
            "metrics": metrics,
            "seconds": round(time.perf_counter() - started, 3),
        }
        path = self._path(label, step, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(row, indent=1, sort_keys=True))
        os.replace(tmp, path)
        return {**row, "cached": False}

    def suite_dir(self) -> Path:
        """One suite (task YAMLs and items) for every checkpoint scored by this scorer."""
        if self._suite_dir is None:
            from llmflow.tasks.evaluation.suite import build_suite

            self._suite_dir = Path(tempfile.mkdtemp(prefix="llmflow-running-suite-"))
            build_suite(self.cfg.suite, None, self._suite_dir)
        return self._suite_dir

    def close(self) -> None:
        if self._suite_dir is not None:
            shutil.rmtree(self._suite_dir, ignore_errors=True)
            self._suite_dir = None


def still_training(stage: Path) -> bool:
    """Whether a stage may still prune: it has not written ``final/`` (a finished stage, such
    as a reference run's, is read without a hold: it prunes no more, and may be read-only)."""
    from llmflow.tasks.pretrain.checkpoint import is_complete

    return not is_complete(Path(stage) / "final")


def stage_checkpoints(stage: Path) -> list[Path]:
    """A stage's complete step checkpoints, oldest first, then ``final/`` when written."""
    from llmflow.tasks.pretrain.checkpoint import is_complete, list_checkpoints

    found = list_checkpoints(stage)
    final = Path(stage) / "final"
    return found + ([final] if is_complete(final) else [])


# -- the reference curve and regressions --------------------------------------------------------
def lower_is_better(metric: str) -> bool:
    return any(word in metric for word in LOWER_IS_BETTER)


def interpolate(curve: list[dict[str, Any]], tokens: int, metric: str) -> float | None:
    """The reference's ``metric`` at ``tokens``, linear between its two nearest points; None
    outside the curve (no extrapolation) or where it lacks the metric."""
    points = sorted(
        (p["tokens_seen"], p["metrics"][metric])
        for p in curve
        if p.get("tokens_seen") is not None and metric in p["metrics"]
    )
    for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
        if t0 <= tokens <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (tokens - t0) / (t1 - t0)
    if points and points[0][0] == tokens:
        return points[0][1]
    return None


def regressions(
    point: dict[str, Any], curve: list[dict[str, Any]], bands: dict[str, float]
) -> list[dict[str, Any]]:
    """Each banded metric of ``point`` worse than the reference at its tokens by more than its
    band: metric, value, reference, gap (positive: worse), band."""
    if point.get("tokens_seen") is None:
        return []
    found = (_regression(point, curve, metric, band) for metric, band in sorted(bands.items()))
    return [row for row in found if row is not None]


def _regression(
    point: dict[str, Any], curve: list[dict[str, Any]], metric: str, band: float
) -> dict[str, Any] | None:
    """``metric``'s row of `regressions` when ``point`` is worse than the reference by more
    than ``band``; None otherwise (or when either value is unknown)."""
    value = point["metrics"].get(metric)
    reference = interpolate(curve, point["tokens_seen"], metric)
    if value is None or reference is None:
        return None
    gap = value - reference if lower_is_better(metric) else reference - value
    if gap > band:
        return {"metric": metric, "value": value, "reference": reference, "gap": gap, "band": band}
    return None


def alerted(stage: Path, step: int, metric: str) -> bool:
    """Whether the stage's events already hold this regression (a rerun alerts once)."""
    from llmflow.tasks.pretrain.alerts import read_alerts

    return any(
        (row.get("kind"), row.get("step"), row.get("cause")) == ("eval_regression", step, metric)
        for row in read_alerts(stage)
    )


def alert_regressions(
    stage: Path, stage_name: str, point: dict[str, Any], found: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One ``eval_regression`` alert per regressed metric not alerted before; the rows."""
    from llmflow.tasks.pretrain.alerts import record_alert

    rows = []
    for item in found:
        if point["step"] is None or alerted(stage, point["step"], item["metric"]):
            continue
        message = (
            f"{item['metric']} {item['value']:.4g} is worse than the reference's "
            f"{item['reference']:.4g} at {point['tokens_seen']:,} tokens by {item['gap']:.4g} "
            f"(noise band {item['band']:.4g})"
        )
        details = {**item, "tokens_seen": point["tokens_seen"], "checkpoint": point["checkpoint"]}
        rows.append(
            record_alert(
                stage,
                "eval_regression",
                point["step"],
                stage_name,
                message,
                cause=item["metric"],
                details=details,
            )  # fmt: skip
        )
    return rows


@contextlib.contextmanager
def one_core(threads: int = 1, niceness: int = 0) -> Iterator[None]:
    """Torch on ``threads`` threads (restored after) and this process ``niceness`` nicer
    (kept: a process cannot lower its niceness again), so training keeps its cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    if niceness > 0:
        with contextlib.suppress(OSError):
            os.nice(niceness)
    try:
        yield
    finally:
        torch.set_num_threads(before)
