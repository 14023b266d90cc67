"""Training time blocked per checkpoint: synchronous saves against ``checkpoint.async_save``.

The trainer runs the same short job twice per round, once with each setting (alternating order,
ABBA), on a model large enough that a save takes measurable time (default: the 135m preset with
AdamW, ~1.6 GB of weights and optimizer state), saving a step checkpoint every ``--interval``
steps. Each checkpoint's notice in ``checkpoints.jsonl`` carries ``blocked_s``, the training time
it held up: the whole save when synchronous; when asynchronous, the setup (state dicts, folder,
RNG/loader files), any wait of the next optimizer step for the state copy, the wait for the
write at the next save, and the commit. ``final/`` is synchronous in both and left out.

The headline ``ratio`` is the median async blocked time over the median sync one.
An asynchronous write hides only behind the steps until the next save: with ``--interval 1`` and a
write slower than a step, the next save waits for it and async blocks about as long as sync.
``identical_work``: both settings ended on the same loss, bit for bit. The runs' wall times are
reported too (the background write shares the CPU with training). Prints ONE JSON line.

    python benchmarks/bench_async_ckpt.py [--preset 135m] [--num-layers N] [--steps 5] [--interval 2]
        [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from common import emit, order

from llmflow.model.config import preset
from llmflow.tasks.dataprep.pack import write_packed
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.launch import launch_training
from llmflow.tasks.pretrain.notices import NOTICES


def read_notices(out_dir: Path) -> list[dict]:
    """The checkpoint notices of a run folder (``checkpoints.jsonl``), oldest first."""
    path = Path(out_dir) / NOTICES
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def make_data(out: Path, vocab: int, seq_len: int, rows: int) -> Path:
    """Random documents packed into ``rows`` rows of ``seq_len`` tokens."""
    rng = np.random.default_rng(0)
    out.mkdir(parents=True, exist_ok=True)
    lengths = np.full(rows, seq_len, dtype=np.int64)
    tokens = rng.integers(1, vocab, size=int(lengths.sum()), dtype=np.int64)
    write_packed([(tokens, lengths)], out, seq_len=seq_len, vocab_size=vocab, eos_id=0, pad_id=0,
                 seed=0, rows_per_shard=rows)  # fmt: skip
    return out


def config(args: argparse.Namespace, async_save: bool) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "model": {"preset": args.preset, "overrides": {"num_layers": args.num_layers}},
            "optimizer": {"lr": 1e-4},
            "schedule": {"name": "constant"},
            "batch": {"micro_batch_size": 1},
            "max_steps": args.steps,
            "checkpoint": {"interval": args.interval, "keep_last": 1, "async_save": async_save},
            "eval_interval": 10_000,
            "tracker": {"tensorboard": False},
            "progress_bar": False,
        }
    )


def run(args: argparse.Namespace, data: Path, out: Path, async_save: bool) -> dict:
    """One training job; its step checkpoints' blocked seconds, wall time and final loss."""
    started = time.perf_counter()
    summary = launch_training(
        config(args, async_save),
        data,
        out,
        num_processes=args.num_processes,
        on_line=lambda _: None,
    )
    wall = time.perf_counter() - started
    blocked = [n["blocked_s"] for n in read_notices(out) if not n["final"]]
    return {"blocked_s": blocked, "wall_s": wall, "last_loss": summary["last_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="135m", help="model preset")
    parser.add_argument("--num-layers", type=int, default=None, help="override the preset's")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per job")
    parser.add_argument("--interval", type=int, default=2, help="steps between checkpoints")
    parser.add_argument("--rounds", type=int, default=2, help="jobs per setting")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per row")
    parser.add_argument("--num-processes", type=int, default=1, help="trainer processes (gloo)")
    args = parser.parse_args()
    vocab = preset(args.preset).vocab_size
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        rows = 4 * args.steps * args.num_processes
        data = make_data(Path(tmp) / "data", vocab, args.seq_len, rows)
        for i, name in enumerate(order(["sync", "async"], args.rounds)):
            out = Path(tmp) / f"{name}-{i}"
            results[name].append(run(args, data, out, async_save=name == "async"))
    blocked = {k: [b for r in v for b in r["blocked_s"]] for k, v in results.items()}
    median = {k: statistics.median(v) for k, v in blocked.items()}
    losses = {r["last_loss"] for v in results.values() for r in v}
    emit(
        "async_checkpoint",
        preset=args.preset,
        num_layers=args.num_layers,
        num_processes=args.num_processes,
        ratio=round(median["async"] / median["sync"], 3),
        sync_blocked_s=median["sync"],
        async_blocked_s=median["async"],
        blocked_s=blocked,
        wall_s={k: [r["wall_s"] for r in v] for k, v in results.items()},
        checkpoints_per_job=len(results["sync"][0]["blocked_s"]),
        rounds=args.rounds,
        identical_work=len(losses) == 1,
        last_loss=json.loads(json.dumps(sorted(losses))),
    )


if __name__ == "__main__":
    main()
