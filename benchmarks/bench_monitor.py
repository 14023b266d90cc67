"""What the trainer's health metrics and detectors cost, and whether they stay quiet and alert.

Three parts, in one process each on the trainer itself (``Trainer``, one rank, CPU or one GPU):

- **overhead**: the same trainer steps with the monitoring on (the step split, per-layer
  statistics every ``--layer-stats-every`` steps, the throughput and stall detectors, metric
  rows every ``--log-interval``) and off (no clock, no per-layer statistics, no detectors),
  ``--steps`` steps per side per round in paired rounds (on/off, then off/on, ...). The headline
  ``overhead`` is the median over rounds of on/off - 1, with its range (run_all.py's bound: 2%).
- **clean**: ``--clean-seeds`` clean runs of ``--clean-steps`` steps (log every step, validated
  and checkpointed on their cadence): the number of alerts they raise (a healthy run raises none).
- **noisy neighbour**: a run logging every step; after ``--noisy-at`` steps, ``--neighbours``
  CPU-bound processes (default 4 per core) start beside it and run to the end: the first
  throughput alert, its cause (``compute`` when the neighbours are what slowed it), and its
  delay in rows and seconds.

    python benchmarks/bench_monitor.py [--preset debug] [--seq-len 256] [--rounds 5] [--steps 40]
        [--quick]

Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from common import emit

from llmflow.tasks.dataprep.pack import write_packed
from llmflow.tasks.pretrain.alerts import read_alerts
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.detectors import StallDetector, ThroughputDetector
from llmflow.tasks.pretrain.distributed import teardown_runtime
from llmflow.tasks.pretrain.train import Trainer, run


def make_data(out: Path, vocab: int, seq_len: int, rows: int) -> Path:
    """Random documents of 16 to seq_len tokens packed into rows of ``seq_len``."""
    rng = np.random.default_rng(0)
    out.mkdir(parents=True, exist_ok=True)
    lengths = rng.integers(16, seq_len, size=rows * 2)
    tokens = rng.integers(1, vocab, size=int(lengths.sum()), dtype=np.int64)
    write_packed([(tokens, lengths)], out, seq_len=seq_len, vocab_size=vocab, eos_id=0, pad_id=0,
                 seed=0, rows_per_shard=rows)  # fmt: skip
    return out


def config(args: argparse.Namespace, seed: int = 0, **changes) -> TrainConfig:
    base = {
        "model": {"preset": args.preset, "overrides": {"max_seq_len": args.seq_len}},
        "optimizer": {"lr": 1e-3},
        "schedule": {"name": "constant", "warmup_steps": 2},
        "batch": {"micro_batch_size": args.micro_batch},
        "max_steps": 100_000,
        "seed": seed,
        "checkpoint": {"interval": 100_000, "keep_last": 1},
        "log_interval": args.log_interval,
        "eval_interval": 100_000,
        "monitor": {"layer_stats_every": args.layer_stats_every},
        "tracker": {"tensorboard": False},
        "progress_bar": False,
    }
    return TrainConfig.model_validate({**base, **changes})


def drive(trainer: Trainer, steps: int) -> None:
    """``steps`` steps of ``Trainer.fit``'s loop (hooks included)."""
    for _ in range(steps):
        trainer._hook("on_step_start", trainer.state.step)
        out = trainer.train_step()
        if out is not None:
            trainer._hook("on_step_end", out)


class _NoClock:
    """The step clock, off."""

    waiting_since = None

    @contextmanager
    def timing(self, part: str):
        yield

    def take(self) -> dict:
        return {}


def overhead(args: argparse.Namespace, data: Path, out: Path) -> dict:
    """Seconds per step with the monitoring on and off, paired rounds."""
    out.mkdir(parents=True)
    trainer = Trainer(config(args), data, out)
    on = {"clock": trainer.clock, "every": trainer.layer_stats.every,
          "callbacks": list(trainer.callbacks)}  # fmt: skip
    off = {"clock": _NoClock(), "every": 0,
           "callbacks": [c for c in trainer.callbacks
                         if not isinstance(c, (ThroughputDetector, StallDetector))]}  # fmt: skip

    def use(side: dict) -> None:
        trainer.clock, trainer.layer_stats.every = side["clock"], side["every"]
        trainer.callbacks = side["callbacks"]

    use(on)
    trainer._hook("on_train_start")
    drive(trainer, args.warmup)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
            use(on if name == "on" else off)
            started = time.perf_counter()
            drive(trainer, args.steps)
            times[name].append((time.perf_counter() - started) / args.steps)
    use(on)
    trainer._hook("on_train_end")
    ratios = [a / b - 1 for a, b in zip(times["on"], times["off"], strict=True)]
    return {"overhead": statistics.median(ratios), "overhead_range": [min(ratios), max(ratios)],
            "step_s": {k: statistics.median(v) for k, v in times.items()}, "rounds": times}  # fmt: skip


def clean(args: argparse.Namespace, data: Path, val: Path, out: Path) -> dict:
    """Alerts raised by clean runs with different seeds (validated, checkpointed)."""
    counts = []
    for seed in range(args.clean_seeds):
        folder = out / f"seed{seed}"
        cfg = config(args, seed, max_steps=args.clean_steps, log_interval=1,
                     eval_interval=max(args.clean_steps // 4, 1),
                     checkpoint={"interval": max(args.clean_steps // 3, 1), "keep_last": 1})  # fmt: skip
        run(cfg, data, folder, val_dir=val)
        counts.append(len(read_alerts(folder)))
    return {"alerts_per_seed": counts, "clean_alerts": sum(counts)}


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def noisy(args: argparse.Namespace, data: Path, out: Path) -> dict:
    """CPU-bound neighbours started mid-run: the first throughput alert and its cause."""
    out.mkdir(parents=True)
    trainer = Trainer(config(args, log_interval=1), data, out)
    trainer._hook("on_train_start")
    drive(trainer, args.noisy_at)
    start_step, started = trainer.state.step, time.time()
    stop = multiprocessing.Event()
    procs = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
             for _ in range(args.neighbours)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        for _ in range(args.noisy_steps):
            drive(trainer, 1)
            if any(a["kind"] == "throughput" for a in read_alerts(out)):
                break
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
    trainer._hook("on_train_end")
    teardown_runtime()
    drops = [a for a in read_alerts(out) if a["kind"] == "throughput"]
    if not drops:
        return {"neighbours": args.neighbours, "alerted": False}
    first = drops[0]
    return {"neighbours": args.neighbours, "alerted": True, "cause": first["cause"],
            "rows_to_alert": first["step"] - start_step,
            "seconds_to_alert": first["time"] - started, "message": first["message"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="steps per side per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--layer-stats-every", type=int, default=50)
    parser.add_argument("--clean-seeds", type=int, default=5)
    parser.add_argument("--clean-steps", type=int, default=60)
    parser.add_argument("--noisy-at", type=int, default=20)
    parser.add_argument("--noisy-steps", type=int, default=30)
    parser.add_argument("--neighbours", type=int, default=4 * (os.cpu_count() or 1))
    parser.add_argument("--quick", action="store_true", help="seconds: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.seq_len, args.micro_batch, args.rounds, args.steps, args.warmup = 64, 2, 1, 3, 1
        args.clean_seeds, args.clean_steps, args.noisy_at, args.noisy_steps = 1, 12, 8, 6
        args.neighbours = min(args.neighbours, 2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        vocab = config(args).model_config_obj().vocab_size
        data = make_data(root / "train", vocab, args.seq_len, rows=512)
        val = make_data(root / "val", vocab, args.seq_len, rows=32)
        try:
            cost = overhead(args, data, root / "overhead")
        finally:
            teardown_runtime()
        quiet = clean(args, data, val, root / "clean")
        neighbour = noisy(args, data, root / "noisy")
    emit("monitor", **cost, **quiet, noisy_neighbour=neighbour, quick=args.quick,
         args={k: v for k, v in vars(args).items() if k != "quick"})  # fmt: skip


if __name__ == "__main__":
    main()
