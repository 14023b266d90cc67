"""Is the tensor-parallel seeding bug visible to the running evaluation at this scale?

    python benchmarks/bench_tp_seed_bug.py [--steps 48] [--seeds 2] [--quick]

The bug (seen in SmolLM3's run): every TP rank draws the same init, so its shards of each
attention and MLP weight are copies of rank 0's. Here a quickstart-shaped stage 1 (the
quickstart's trainer settings, shrunk; tests/flows/running_fixtures.py) trains at tp=2 on two
processes of one thread each: clean with seeds 0..N-1, and with the bug planted
(``LLMFLOW_FAULTS='{"tp_same_init": true}'``, tasks/pretrain/faults.py) at seed 0. Every
checkpoint's held-out loss is scored as the running evaluation scores it (tasks/evaluation/
running.py), and each run is compared with clean seed 0 at equal tokens, against the default
noise band. ``detected_at`` is the first checkpoint (tokens seen) where the planted run is worse
than the band, or null.

Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import emit  # noqa: E402
from tests.flows import running_fixtures as rf  # noqa: E402


def train_tp2(cfg, data: Path, out: Path, faults: dict | None) -> Path:
    """One stage at tp=2 on two torchrun processes (one thread each)."""
    from llmflow.tasks.pretrain.config import TrainConfig
    from llmflow.tasks.pretrain.faults import ENV
    from llmflow.tasks.pretrain.launch import train_arguments
    from llmflow.tasks.pretrain.launchers import local_launcher

    cfg = TrainConfig.model_validate({**cfg.model_dump(), "parallel": {"tp": 2}})
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "train_config.json"
    cfg.save(config_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(ENV, None)
    if faults is not None:
        env[ENV] = json.dumps(faults)
    command = local_launcher(2).command(train_arguments(config_path, data, out))
    done = subprocess.run(
        command, cwd=out, env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    if faults is not None:
        assert "tensor-parallel weights copied from tp rank 0" in output, output[-3000:]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--seeds", type=int, default=2, help="clean tp=2 runs")
    parser.add_argument("--quick", action="store_true", help="seconds: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seeds = 8, 1
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from llmflow.tasks.evaluation.running import (
        DEFAULT_NOISE_BAND,
        HELDOUT_LOSS,
        Scorer,
        ScoringConfig,
        interpolate,
        one_core,
        stage_checkpoints,
    )

    band = DEFAULT_NOISE_BAND[HELDOUT_LOSS]
    with tempfile.TemporaryDirectory(prefix="bench-tp-seed-") as tmp:
        work = Path(tmp)
        data = rf.write_packed_text(work / "train", 2400, seed=0)
        heldout = rf.write_packed_text(work / "heldout", 120, seed=99)
        runs = {f"seed{s}": (s, None) for s in range(args.seeds)}
        runs["tp_same_init"] = (0, {"tp_same_init": True})
        scorer = Scorer(ScoringConfig(heldout=str(heldout)), work / "scores")
        curves = {}
        for name, (seed, faults) in runs.items():
            cfg = rf.stage1_config(seed=seed, keep_last=1000, steps=args.steps)
            out = train_tp2(cfg, data, work / name, faults)
            with one_core(1):
                curves[name] = [scorer.score(name, c) for c in stage_checkpoints(out)]
    reference = curves["seed0"]

    def gaps(name: str) -> list[list[float]]:
        return [
            [p["tokens_seen"], round(p["metrics"][HELDOUT_LOSS]
                                     - interpolate(reference, p["tokens_seen"], HELDOUT_LOSS), 4)]
            for p in curves[name]
        ]  # fmt: skip

    planted = gaps("tp_same_init")
    detected = next((tokens for tokens, gap in planted if gap > band), None)
    clean = {n: gaps(n) for n in curves if n.startswith("seed") and n != "seed0"}
    emit(
        "tp_seed_bug",
        detected_at_tokens=detected,
        checkpoints_to_detect=(
            None if detected is None else [t for t, _ in planted].index(detected) + 1
        ),
        band=band,
        planted_gaps=planted,
        clean_gaps=clean,
        clean_alerting=sum(g > band for c in clean.values() for _, g in c),
        curves={
            n: [[p["tokens_seen"], round(p["metrics"][HELDOUT_LOSS], 4)] for p in c]
            for n, c in curves.items()
        },
        steps=args.steps,
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
