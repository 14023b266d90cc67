"""Sweep with pruning vs a full grid of learning rates, and the scaling ladder's prediction error.

Both searches run the real ``llmflow sweep`` flow on the quickstart corpus (its first-stage
mixture and held-out set), with trials cut into the same segments, so a grid trial and a sweep
trial of the same learning rate are the same cached steps:

- grid: ``--grid`` learning rates log-spaced over [lo, hi], every trial trained to the end
  (Optuna's GridSampler, no pruner);
- sweep: TPE over the same log range with successive-halving pruning (ASHA), ``--trials`` trials.

Reported: the grid's best final validation loss, the sweep's best complete trial's (and its
relative gap), and the sweep's training tokens as a share of the grid's. Then the ladder
(``llmflow ladder``'s flow, without the ranking runs) fits L(N, D) and predicts a larger model's
loss (and the relative error). Prints ONE JSON line. Outputs are cached under ``--root``: a re-run
reports the same numbers without training.

    python benchmarks/bench_sweep.py [--root runs-bench] [--grid 8] [--trials 6]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from llmflow.flows.scaling import LadderConfig, Size, scaling_ladder
from llmflow.flows.sweep import run_sweep
from llmflow.tasks.config import load_config
from llmflow.tasks.scaling.space import SweepSpace

LR = "pretrain.train.optimizer.lr"
SMALL_MODEL = [  # seconds per trial on 2 CPU cores: the embedding is most of the model
    "pretrain.train.model.overrides.hidden_size=32",
    "pretrain.train.model.overrides.num_layers=2",
    "pretrain.train.model.overrides.num_heads=2",
    "pretrain.train.model.overrides.num_kv_heads=1",
    "pretrain.train.model.overrides.intermediate_size=96",
    "pretrain.train.batch.micro_batch_size=4",
    "pretrain.train.eval_batches=4",
    "pretrain.train.schedule.warmup_steps=5",
    "pretrain.train.tracker.tensorboard=false",
    "pretrain.train.progress_bar=false",
]


def spaces(args: argparse.Namespace) -> tuple[SweepSpace, SweepSpace]:
    """The grid study and the pruned TPE study over the same range and trial length."""
    common = {"max_steps": args.steps, "segments": args.segments, "concurrency": args.concurrency}
    grid = [float(f"{x:.3g}") for x in np.geomspace(args.lo, args.hi, args.grid)]
    grid_space = SweepSpace.model_validate(
        {
            **common,
            "study": f"grid-{args.grid}",
            "trials": args.grid,
            "sampler": {"name": "grid"},
            "pruner": {"name": "none"},
            "params": {LR: {"type": "categorical", "choices": grid}},
        }
    )
    sweep_space = SweepSpace.model_validate(
        {
            **common,
            "study": f"tpe-asha-{args.trials}",
            "trials": args.trials,
            "sampler": {"name": "tpe", "seed": args.seed, "n_startup_trials": args.startup},
            "pruner": {"name": "asha", "min_resource": 1, "reduction_factor": args.eta},
            "params": {LR: {"type": "float", "low": args.lo, "high": args.hi, "log": True}},
        }
    )
    return grid_space, sweep_space


def bench_ladder(config, ranking_tokens: int = 0) -> dict:
    """The ladder's fit and held-out prediction; with ``ranking_tokens``, also cosine vs WSD
    ranked at three sizes (the flow's default variants and sizes) on that many tokens each."""
    ranking = {"ranking_tokens": ranking_tokens} if ranking_tokens else {"variants": {}}
    ladder = LadderConfig(
        sizes=[Size(hidden_size=h, num_layers=n) for h, n in ((16, 1), (32, 1), (48, 1), (64, 2))],
        flops=[2e9, 6e9, 1.8e10],
        min_tokens=8192,
        max_tokens=100_000,
        heldout=Size(hidden_size=96, num_layers=2),
        heldout_tokens=60_000,
        **ranking,
    )
    started = time.perf_counter()
    result = scaling_ladder(config, ladder)
    return {
        "ladder_runs": len(result.points),
        "ladder_law": {k: round(v, 4) for k, v in result.law.items()},
        "ladder_predicted": round(result.predicted, 4),
        "ladder_actual": round(result.actual, 4),
        "ladder_error": round(result.error, 4),
        "ladder_within_3pct": result.error <= 0.03,
        "ladder_s": round(time.perf_counter() - started, 1),
        **(
            {"ranking": result.ranking, "ranking_consistent": result.consistent}
            if ranking_tokens
            else {}
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="runs-bench-sweep", help="Artifact root (cached).")
    parser.add_argument("--grid", type=int, default=8, help="Learning rates in the grid.")
    parser.add_argument("--trials", type=int, default=6, help="Trials of the pruned sweep.")
    parser.add_argument("--startup", type=int, default=3, help="TPE's random startup trials.")
    parser.add_argument("--eta", type=int, default=3, help="ASHA's reduction factor.")
    parser.add_argument("--lo", type=float, default=1e-3)
    parser.add_argument("--hi", type=float, default=1e-1)
    parser.add_argument("--steps", type=int, default=36, help="Steps of a full trial.")
    parser.add_argument("--segments", type=int, default=3, help="Report points of a trial.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=1, help="Trials training at once.")
    parser.add_argument("--skip-ladder", action="store_true", help="Only the searches.")
    parser.add_argument("--ladder-only", action="store_true", help="Only the ladder.")
    parser.add_argument(
        "--ranking-tokens",
        type=int,
        default=0,
        help="Also rank cosine vs WSD at three sizes on this many tokens each (0: skip).",
    )
    args = parser.parse_args()
    config = load_config(None, [f"root={os.path.abspath(args.root)}", *SMALL_MODEL])
    if args.ladder_only:
        print(json.dumps({**bench_ladder(config, args.ranking_tokens), "loadavg": os.getloadavg()}))
        return
    grid_space, sweep_space = spaces(args)
    started = time.perf_counter()
    grid = run_sweep(config, grid_space)
    grid_s = time.perf_counter() - started
    started = time.perf_counter()
    found = run_sweep(config, sweep_space)
    sweep_s = time.perf_counter() - started
    gap = found.best_value / grid.best_value - 1
    row = {
        "bench": "sweep_vs_grid",
        "grid_lrs": args.grid,
        "grid_best_lr": grid.best_params[LR],
        "grid_best_loss": round(grid.best_value, 5),
        "sweep_trials": len(found.rows),
        "sweep_pruned": sum(r["state"] == "pruned" for r in found.rows),
        "sweep_best_lr": round(found.best_params[LR], 6),
        "sweep_best_loss": round(found.best_value, 5),
        "loss_gap": round(gap, 5),
        "within_1pct": gap <= 0.01,
        "token_share": round(found.tokens / grid.tokens, 4),
        "within_half_tokens": found.tokens <= 0.5 * grid.tokens,
        "grid_s": round(grid_s, 1),
        "sweep_s": round(sweep_s, 1),
        "steps_per_trial": args.steps,
        "segments": args.segments,
    }
    if not args.skip_ladder:
        row.update(bench_ladder(config, args.ranking_tokens))
    row["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(row))


if __name__ == "__main__":
    main()
