"""What evaluating a running stage costs its training, and how far clean runs differ by seed.

    python benchmarks/bench_eval_overhead.py [--rounds 3] [--steps 200] [--seeds 5] [--quick]

Overhead: a quickstart-shaped stage 1 (the quickstart's trainer settings, shrunk; tests/flows/
running_fixtures.py) trains on one thread, alone and with the running evaluation following it
in a second process (flows/evaluate_running.py's pass: held-out loss and a 40-item cloze task on
each checkpoint, one torch thread, niced), in alternating rounds. The figure is the training's
tokens/s alone over with the evaluation (``slowdown`` = that - 1; run_all.py's bound: 0.10, with
one of two cores free for the evaluation).

Noise band: ``--seeds`` clean runs (seeds 0..N-1) are scored at every checkpoint; the band is the
largest held-out loss gap between two seeds at equal tokens (``band_measured``), and
``band_default`` that times 1.5 rounded up to 0.05 (``DEFAULT_NOISE_BAND`` in
tasks/evaluation/running.py). It also counts the clean pairs that would alert at the default
band (none should) and the gap of a planted bug (learning rate cut 10x) for contrast.

Prints ONE JSON line (the overhead, with the noise record under ``noise``).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from itertools import permutations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import emit, order  # noqa: E402
from tests.flows import running_fixtures as rf  # noqa: E402


def _follow(config_json: str, ready_file: str, stop_file: str) -> None:
    """The running evaluation's passes over one stage until it writes final/ (a process)."""
    from llmflow.flows.evaluate_running import RunningEvaluationConfig, evaluate_pass, finished
    from llmflow.tasks.evaluation.running import Scorer, one_core

    config = RunningEvaluationConfig.model_validate_json(config_json)
    scorer = Scorer(config.scoring, config.results_dir())
    scorer.suite_dir()
    Path(ready_file).touch()  # NOTE: imports and the suite ready: the trainer starts now
    with one_core(config.threads, config.niceness):
        while not Path(stop_file).exists():
            done = finished(config)
            evaluate_pass(config, scorer, [])
            if done:
                break
            time.sleep(config.poll_s)
    scorer.close()


def train_round(
    work: Path, data: Path, steps: int, evaluate: dict | None, scored: list[int]
) -> float:
    """Train one stage (one thread); with ``evaluate``, the evaluation follows it from its first
    checkpoint (started, imports done, before the trainer). Tokens/s; appends to ``scored``
    how many checkpoints the evaluation scored while the stage trained."""
    out = Path(tempfile.mkdtemp(dir=work, prefix="run-"))
    follower = None
    if evaluate is not None:
        from llmflow.flows.evaluate_running import RunningEvaluationConfig

        config = RunningEvaluationConfig.model_validate(
            {**evaluate, "stages": [str(out)], "results": str(work / "scores"), "poll_s": 0.2}
        )
        follower = multiprocessing.get_context("spawn").Process(
            target=_follow, args=(config.model_dump_json(), str(out / "ready"), str(out / "stop"))
        )
        follower.start()
        while not (out / "ready").exists() and follower.is_alive():
            time.sleep(0.1)
    trainer = rf.start_trainer(rf.stage1_config(keep_last=2, steps=steps), data, out)
    output, _ = trainer.communicate(timeout=1800)
    assert trainer.returncode == 0, output[-3000:]
    if follower is not None:
        scored.append(len(list((work / "scores" / out.name).glob("step-*.json"))))
        (out / "stop").touch()
        follower.join(timeout=600)
    return json.loads((out / "summary.json").read_text())["tokens_per_s"]


def noise(work: Path, data: Path, heldout: Path, steps: int, seeds: int, band: float) -> dict:
    """Held-out loss of clean seeds and a planted lr/10 run at every checkpoint; the band."""
    from llmflow.tasks.evaluation.running import (
        HELDOUT_LOSS,
        Scorer,
        ScoringConfig,
        interpolate,
        one_core,
        stage_checkpoints,
    )

    runs = {f"seed{s}": rf.stage1_config(seed=s, keep_last=1000, steps=steps) for s in range(seeds)}
    runs["lr_div_10"] = rf.stage1_config(seed=0, lr_scale=0.1, keep_last=1000, steps=steps)
    scorer = Scorer(ScoringConfig(heldout=str(heldout)), work / "noise-scores")
    curves = {}
    for name, cfg in runs.items():
        out = rf.train(cfg, data, work / name)
        with one_core(1):
            curves[name] = [scorer.score(name, c) for c in stage_checkpoints(out)]
    clean = [n for n in curves if n.startswith("seed")]
    gaps = []  # (run, reference) -> the largest gap where the run is worse
    for run, ref in permutations(clean, 2):
        worst = max(
            p["metrics"][HELDOUT_LOSS] - interpolate(curves[ref], p["tokens_seen"], HELDOUT_LOSS)
            for p in curves[run]
        )
        gaps.append(worst)
    measured = max(gaps)
    planted = min(
        p["metrics"][HELDOUT_LOSS] - interpolate(curves["seed0"], p["tokens_seen"], HELDOUT_LOSS)
        for p in curves["lr_div_10"]
    )
    return {
        "metric": HELDOUT_LOSS,
        "seeds": seeds,
        "steps": steps,
        "checkpoints_per_run": len(curves["seed0"]),
        "band_measured": round(measured, 4),
        "band_default": math.ceil(measured * 1.5 / 0.05) * 0.05,
        "band_in_use": band,
        "clean_pairs": len(gaps),
        "clean_pairs_alerting": sum(g > band for g in gaps),
        "planted_lr_div_10_smallest_gap": round(planted, 4),
        "curves": {
            n: [[p["tokens_seen"], round(p["metrics"][HELDOUT_LOSS], 4)] for p in c]
            for n, c in curves.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="0: the noise band only")
    parser.add_argument("--steps", type=int, default=200, help="training steps per round")
    parser.add_argument("--seeds", type=int, default=5, help="clean runs for the noise band")
    parser.add_argument("--noise-steps", type=int, default=16)
    parser.add_argument("--items", type=int, default=40, help="cloze items per checkpoint")
    parser.add_argument("--quick", action="store_true", help="seconds: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.seeds, args.noise_steps, args.items = 1, 12, 2, 8, 8
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from llmflow.tasks.evaluation.running import DEFAULT_NOISE_BAND, HELDOUT_LOSS

    with tempfile.TemporaryDirectory(prefix="bench-eval-overhead-") as tmp:
        work = Path(tmp)
        data = rf.write_packed_text(work / "train", 2400, seed=0)
        heldout = rf.write_packed_text(work / "heldout", 120, seed=99)
        tokenizer = rf.write_tokenizer(work / "tokenizer")
        evaluate = {
            "scoring": {
                "heldout": str(heldout),
                "tokenizer": str(tokenizer),
                "suite": {"tasks": ["cf_arith"], "num_items": args.items, "batch_size": 16},
            },
            "threads": 1,
            "niceness": 10,
        }
        scored: list[int] = []
        sides = {
            "alone": lambda: train_round(work, data, args.steps, None, scored),
            "with_eval": lambda: train_round(work, data, args.steps, evaluate, scored),
        }
        tokens_per_s: dict[str, list[float]] = {name: [] for name in sides}
        for name in order(list(sides), args.rounds):
            tokens_per_s[name].append(sides[name]())
        band = DEFAULT_NOISE_BAND[HELDOUT_LOSS]
        seeds = noise(work, data, heldout, args.noise_steps, args.seeds, band)
    per_round = [
        a / w for a, w in zip(tokens_per_s["alone"], tokens_per_s["with_eval"], strict=True)
    ]
    slowdown = None  # --rounds 0: the noise band only
    if per_round:
        alone, with_eval = (statistics.median(tokens_per_s[n]) for n in ("alone", "with_eval"))
        slowdown = round(alone / with_eval - 1, 3)
    emit(
        "eval_overhead",
        slowdown=slowdown,
        slowdown_rounds=[round(r - 1, 3) for r in per_round],
        tokens_per_s=tokens_per_s,
        checkpoints_scored_while_training=scored,
        rounds=args.rounds,
        steps=args.steps,
        cores=os.cpu_count(),
        quick=args.quick,
        noise=seeds,
    )


if __name__ == "__main__":
    main()
