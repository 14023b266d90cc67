"""Trainer components that own their cadence, in the torchtitan / OLMo-core manner.

The loop (``Trainer.fit``) only calls hooks; each component decides when it acts:

- :class:`MetricsLogger`: metrics.jsonl, TensorBoard, trackers and the console, every
  ``log_interval`` steps (rank 0 only);
- :class:`Validator`: held-out loss every ``eval_interval`` steps and at the stage's end;
- :class:`RankInfo`: this rank's init fingerprint, first batch and sharding (checked by tests);
- the checkpointer (``checkpointer.py``), the stability guard (``guard.py``) and the test-only
  fault injector (``faults.py``) are components too.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llmflow.model.loss import IGNORE_INDEX
from llmflow.tasks.dataprep.loader import PackedLoader
from llmflow.tasks.dataprep.pack import read_meta
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.distributed import sharding_report
from llmflow.tasks.pretrain.state import StepOutput
from llmflow.tasks.pretrain.trackers import open_trackers

if TYPE_CHECKING:
    from llmflow.tasks.pretrain.train import Trainer


class Callback:
    """A trainer component. Hooks run on every rank, in the order of ``Trainer.callbacks``."""

    def on_train_start(self, trainer: Trainer) -> None:
        """Before the first step of this process (after any resume)."""

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        """Before a step draws its batches (again after a skipped or rewound step)."""

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        """After an accepted optimizer step; ``trainer.state`` already counts it."""

    def on_train_end(self, trainer: Trainer) -> None:
        """After the stage's last step, before ``summary.json`` is written."""


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def truncate_jsonl(path: Path, after_step: int) -> None:
    """Drop rows logged after ``after_step`` (they are replayed after a resume)."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [r for r in rows if json.loads(r).get("step", 0) <= after_step]
    path.write_text("".join(r + "\n" for r in kept))


class MetricsLogger(Callback):
    """Writes a metric row every ``log_interval`` steps (and at each validation and the end).

    Rows go to metrics.jsonl, TensorBoard, MLflow / W&B and the console (a tqdm bar when
    stderr is a TTY). Only rank 0 has one.
    """

    def __init__(self, cfg: TrainConfig, out_dir: Path):
        self.cfg, self.out_dir = cfg, Path(out_dir)
        self.path = self.out_dir / "metrics.jsonl"
        self.writer = self.bar = None
        self.trackers: list[Any] = []
        self.tokens, self.seconds = 0, 0.0
        self.last_row: dict[str, Any] | None = None  # what the detectors judge

    def on_train_start(self, trainer: Trainer) -> None:
        start, cfg = trainer.state.step, self.cfg
        truncate_jsonl(self.path, start)
        if cfg.tracker.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.out_dir / "tb"), purge_step=start + 1)
        self.trackers = open_trackers(cfg, self.out_dir, getattr(trainer, "data_dir", None))
        if cfg.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            end = trainer.state.end_step
            self.bar = tqdm(total=end, initial=start, unit="step", file=sys.stderr)

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        self.tokens += out.num_tokens
        self.seconds += out.seconds
        if self.bar is not None:
            self.bar.update(1)
        cfg, step = self.cfg, out.step
        due = step % cfg.log_interval == 0 or step % cfg.eval_interval == 0
        if due or step == trainer.state.end_step:
            self.log(self.row(trainer, out))
            self.tokens, self.seconds = 0, 0.0

    def row(self, trainer: Trainer, out: StepOutput) -> dict[str, Any]:
        """The metric row of ``out``: throughput and where the time went since the last row,
        per-layer statistics when some were measured."""
        tokens_per_s = self.tokens / max(self.seconds, 1e-9)
        row = {
            "step": out.step,
            "loss": out.loss,
            "grad_norm": out.grad_norm,
            "lr": out.lr,
            "tokens_seen": trainer.state.tokens_seen,
            "tokens_per_s": tokens_per_s,
            "skipped_batches": trainer.guard.num_skipped,
            "memory_gib": _memory_gib(),
        }
        clock = getattr(trainer, "clock", None)
        split = clock.take() if clock is not None else {}
        if split:  # the step split (health.py); a clock that timed nothing has none
            row.update(split, time_step_s=self.seconds)
            row["data_share"] = split["time_data_s"] / max(self.seconds, 1e-9)
        mfu = trainer.mfu(tokens_per_s)
        if mfu is not None:
            row["mfu"] = mfu
        layer_stats = getattr(trainer, "layer_stats", None)
        if layer_stats is not None:
            row.update(layer_stats.take())
        return {**row, **out.metrics}

    def log(self, row: dict[str, Any]) -> None:
        """Record one row (must hold ``step``)."""
        step = row["step"]
        self.last_row = row
        append_jsonl(self.path, {**row, "time": time.time()})
        scalars = _scalars(row)
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(f"train/{key}", value, step)
        for tracker in self.trackers:
            tracker.log(scalars, step=step)
        text = f"step {step} loss {row.get('loss', float('nan')):.4f}"
        if "tokens_per_s" in row:
            text += f" tok/s {row['tokens_per_s']:.0f}"
        if "val_loss" in row:
            text += f" val_loss {row['val_loss']:.4f}"
        if "moe/load_max_mean" in row:  # a mixture of experts (moe_balance.py)
            text += f" moe_load_max/mean {row['moe/load_max_mean']:.2f}"
        if self.bar is not None:
            self.bar.set_postfix_str(text)
        else:
            print(text, flush=True)

    def on_train_end(self, trainer: Trainer) -> None:
        if self.writer is not None:
            self.writer.close()
        for tracker in self.trackers:
            tracker.finish(trainer.summary())
        if self.bar is not None:
            self.bar.close()


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a row for TensorBoard and trackers; a dict of numbers (per layer) becomes
    ``key/name`` scalars."""
    scalars = {}
    for key, value in row.items():
        if isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, (int, float)):
                    scalars[f"{key}/{name}"] = sub
        elif isinstance(value, (int, float)) and key != "step":
            scalars[key] = value
    return scalars


def _memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Validator(Callback):
    """Held-out loss every ``eval_interval`` steps and at the stage's last step (all ranks); per
    domain too (``val_loss_by_domain``) when the held-out set records its documents' domains
    (packed with ``validation.by_domain``)."""

    def __init__(self, val_dir: Path, eval_interval: int):
        self.val_dir, self.eval_interval = Path(val_dir), eval_interval
        self.by_domain = "segment_domains" in read_meta(self.val_dir)["index"]

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        if out.step % self.eval_interval == 0 or out.step == trainer.state.end_step:
            loss, by_domain = self.measure(trainer)
            out.metrics["val_loss"] = trainer.state.val_loss = loss
            if by_domain is not None:
                out.metrics["val_loss_by_domain"] = by_domain
                trainer.state.val_loss_by_domain = by_domain

    def evaluate(self, trainer: Trainer) -> float:
        """The held-out loss alone (see :meth:`measure`)."""
        return self.measure(trainer)[0]

    @torch.no_grad()
    def measure(self, trainer: Trainer) -> tuple[float, dict[str, float] | None]:
        """Token-mean cross-entropy on the first ``eval_batches`` batches of the held-out set,
        and by domain (None when the set records no domains).

        The loss is the train step's (``Trainer.forward_backward``), forward only: each
        context-parallel rank takes its shard of every row, the output projection is fused into
        the loss (vocabulary-parallel under TP), so no rank holds full rows or full logits; the
        sums go over the data- and context-parallel ranks. Under PP the schedule's forward.
        A domain's loss is the same forward with every other domain's labels ignored, one pass
        per domain on every rank (the fused loss gives no per-token losses); a domain with no
        token in these batches is left out.
        """
        rt, cfg, model = trainer.runtime, trainer.cfg, trainer.model
        # NOTE: by data-parallel rank: tensor-parallel ranks must see the same sequences
        loader = PackedLoader(
            self.val_dir,
            cfg.batch.micro_batch_size,
            trainer.dp_rank,
            trainer.layout.dp,
            seed=cfg.seed,
            with_domains=self.by_domain,
        )
        batches = [loader.next_batch() for _ in range(cfg.eval_batches)]
        names = loader.domain_names if self.by_domain else []
        loader.close()
        domains = [b.pop("domains") for b in batches] if self.by_domain else []
        passes = [batches] + [_only_domain(batches, domains, d) for d in range(len(names))]
        model.eval()
        totals = torch.zeros(len(passes), 2, dtype=torch.float64, device=rt.device)
        for k, part in enumerate(passes):
            totals[k] = self._sums(trainer, part)
        model.train()
        sums = trainer.dp_sum(totals).tolist()
        loss = sums[0][0] / max(sums[0][1], 1)
        if not self.by_domain:
            return loss, None
        return loss, {n: s / c for n, (s, c) in zip(names, sums[1:], strict=True) if c > 0}

    @staticmethod
    def _sums(trainer: Trainer, batches: list[dict]) -> torch.Tensor:
        """(cross-entropy summed over tokens, tokens) of this rank's part of ``batches``."""
        return trainer.parallel.eval_sums(trainer.model, trainer.loss_fn, batches)


def _only_domain(batches: list[dict], domains: list[torch.Tensor], domain: int) -> list[dict]:
    """``batches`` with the labels of every other domain ignored (whole rows, before any
    context-parallel sharding, so each shard keeps its part of the mask)."""
    return [
        {**b, "labels": b["labels"].masked_fill(d != domain, IGNORE_INDEX)}
        for b, d in zip(batches, domains, strict=True)
    ]


class RankInfo(Callback):
    """Writes ``ranks/rank-NNNNN.json`` after this process's first step (checked by tests)."""

    def __init__(self, out_dir: Path):
        self.folder = Path(out_dir) / "ranks"
        self.written = False

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        if self.written:
            return
        self.written = True
        digest = hashlib.sha256(out.first_batch["input_ids"].numpy().tobytes()).hexdigest()
        rt = trainer.runtime
        info = {
            "rank": rt.rank,
            "world_size": rt.world_size,
            "init_checksum": trainer.init_checksum,
            "first_batch_sha256": digest,
            "matmul_dtype": trainer.matmul_dtype,
            "step": out.step - 1,
            **sharding_report(trainer.model),
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank-{rt.rank:05d}.json").write_text(json.dumps(info, indent=1))
