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
import hashlib
import json
import os
import time

from llmflow.flows.scaling import LadderConfig, Size, scaling_ladder
from llmflow.flows.sweep import run_sweep
from llmflow.tasks.config import load_config
from llmflow.tasks.scaling.space import SweepSpace, lr_params

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


def _named(kind: str, space: SweepSpace) -> SweepSpace:
    """The space with a study name that digests it: a cached root holds one study per space (a
    study reloaded under an old name would report the old space's trials)."""
    fields = space.model_dump(exclude={"study", "concurrency"})
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8]
    return space.model_copy(update={"study": f"{kind}-{space.trials}-{digest}"})


def spaces(args: argparse.Namespace, config) -> tuple[SweepSpace, SweepSpace]:
    """The grid study and the pruned TPE study over the recipe's learning-rate ranges."""
    common = {"max_steps": args.steps, "segments": args.segments, "concurrency": args.concurrency}
    ranges = lr_params(config)
    points = args.grid or (8 if len(ranges) == 1 else 4)  # 8 LRs, or a 4 x 4 grid for Muon
    grid = lr_params(config, points)
    trials = 1
    for param in grid.values():
        trials *= len(param.choices)
    grid_space = SweepSpace(
        **common,
        study="grid",
        trials=trials,
        sampler={"name": "grid"},
        pruner={"name": "none"},
        params=grid,
    )
    sweep_space = SweepSpace(
        **common,
        study="tpe-asha",
        trials=args.trials,
        sampler={"name": "tpe", "seed": args.seed, "n_startup_trials": args.startup},
        pruner={"name": "asha", "min_resource": 1, "reduction_factor": args.eta},
        params=ranges,
    )
    return _named("grid", grid_space), _named("tpe-asha", sweep_space)


LADDER = {
    "sizes": [Size(hidden_size=h, num_layers=n) for h, n in ((16, 1), (32, 1), (48, 1), (64, 2))],
    "flops": [2e9, 6e9, 1.8e10],
    "min_tokens": 8192,
    "max_tokens": 100_000,
    "heldout": Size(hidden_size=96, num_layers=2),
    "heldout_tokens": 60_000,
}
QUICK_LADDER = {  # a few steps per run: checks the script, measures nothing
    "sizes": [Size(hidden_size=h, num_layers=1) for h in (16, 32, 48)],
    "flops": [1e8, 2e8, 4e8],
    "min_tokens": 1024,
    "max_tokens": 8192,
    "heldout": Size(hidden_size=64, num_layers=1),
    "heldout_tokens": 4096,
}


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def bench_ladder(config, ranking_tokens: int = 0, lr_scale: float = 1.0, quick: bool = False):
    """The ladder's fit and held-out prediction (or why the fit is degenerate); with
    ``ranking_tokens``, also cosine vs WSD ranked at three sizes (the flow's default variants
    and sizes) on that many tokens each."""
    ranking = {"ranking_tokens": ranking_tokens} if ranking_tokens else {"variants": {}}
    ladder = LadderConfig(**(QUICK_LADDER if quick else LADDER), lr_scale=lr_scale, **ranking)
    started = time.perf_counter()
    result = scaling_ladder(config, ladder)
    law = {k: round(v, 4) for k, v in result.law.items() if isinstance(v, float)}
    return {
        "ladder_runs": len(result.points),
        "ladder_lr_scale": lr_scale,
        "ladder_law": law,
        "ladder_degenerate": result.degenerate,
        "ladder_predicted": _round(result.predicted),
        "ladder_actual": round(result.actual, 4),
        "ladder_error": _round(result.error),
        "ladder_within_3pct": result.error is not None and result.error <= 0.03,
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
    parser.add_argument(
        "--grid", type=int, help="Values of each learning rate in the grid (8 for one, 4 for two)."
    )
    parser.add_argument("--trials", type=int, default=6, help="Trials of the pruned sweep.")
    parser.add_argument("--startup", type=int, default=3, help="TPE's random startup trials.")
    parser.add_argument("--eta", type=int, default=3, help="ASHA's reduction factor.")
    parser.add_argument("--steps", type=int, default=36, help="Steps of a full trial.")
    parser.add_argument("--segments", type=int, default=3, help="Report points of a trial.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=1, help="Trials training at once.")
    parser.add_argument("--skip-ladder", action="store_true", help="Only the searches.")
    parser.add_argument("--ladder-only", action="store_true", help="Only the ladder.")
    parser.add_argument(
        "--ladder-lr-scale",
        type=float,
        default=1.0,
        help="Multiplies the recipe optimizer's learning rates in every ladder run.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="Tiny settings, seconds: checks the script runs."
    )
    parser.add_argument(
        "--ranking-tokens",
        type=int,
        default=0,
        help="Also rank cosine vs WSD at three sizes on this many tokens each (0: skip).",
    )
    args = parser.parse_args()
    if args.quick:
        args.grid, args.trials, args.startup, args.steps, args.segments = 2, 2, 1, 6, 2
    config = load_config(None, [f"root={os.path.abspath(args.root)}", *SMALL_MODEL])
    ladder = (config, args.ranking_tokens, args.ladder_lr_scale, args.quick)
    if args.ladder_only:
        print(json.dumps({**bench_ladder(*ladder), "loadavg": os.getloadavg()}))
        return
    grid_space, sweep_space = spaces(args, config)
    started = time.perf_counter()
    grid = run_sweep(config, grid_space)
    grid_s = time.perf_counter() - started
    started = time.perf_counter()
    found = run_sweep(config, sweep_space)
    sweep_s = time.perf_counter() - started
    gap = found.best_value / grid.best_value - 1
    short = {path: path.rsplit(".", 1)[1] for path in sweep_space.params}  # lr, muon_lr
    row = {
        "bench": "sweep_vs_grid",
        "quick": args.quick,
        "optimizer": config.pretrain.train.optimizer.name,
        "space": {short[k]: [p.low, p.high] for k, p in sweep_space.params.items()},
        "grid_trials": grid_space.trials,
        "grid_best": {short[k]: v for k, v in grid.best_params.items()},
        "grid_best_loss": round(grid.best_value, 5),
        "sweep_trials": len(found.rows),
        "sweep_pruned": sum(r["state"] == "pruned" for r in found.rows),
        "sweep_best": {short[k]: round(v, 6) for k, v in found.best_params.items()},
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
        row.update(bench_ladder(*ladder))
    row["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(row))


if __name__ == "__main__":
    main()
