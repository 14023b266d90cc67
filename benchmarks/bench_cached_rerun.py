"""A cached re-run of the quickstart: wall seconds of ``llmflow run`` when every step is in the store.

The quickstart runs once into a fresh root (untimed), then ``--rounds`` more times into the same
root, each a new process as a user starts it; every step is then found in the store. Also timed:
``llmflow run --help`` (the import cost of the command line). Both are absolute wall times (the
goal is a bound in seconds, not a ratio to a peer). ``identical_work``: every re-run computed
nothing (its summary lists each step as cached). Prints ONE JSON line.

    python benchmarks/bench_cached_rerun.py [--rounds 3] [--until PHASE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import emit

LLMFLOW = [sys.executable, "-m", "llmflow.flows.cli"]


def timed(command: list[str], env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    return seconds, done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--until", default=None, help="cut the recipe after this phase")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "LLMFLOW_CACHE": f"{tmp}/cache", "PREFECT_HOME": f"{tmp}/prefect"}
        env.pop("PREFECT_API_URL", None)
        run = [*LLMFLOW, "run", "--root", f"{tmp}/runs"]
        if args.until:
            run += ["--until", args.until]
        first, _ = timed(run, env)
        cached, outputs = [], []
        for _ in range(args.rounds):
            seconds, out = timed(run, env)
            cached.append(seconds)
            outputs.append(out)
        helps = [timed([*LLMFLOW, "run", "--help"], env)[0] for _ in range(args.rounds)]
    skipped = all("nothing to run" in out for out in outputs)
    emit(
        "cached_rerun",
        cached_s=round(statistics.median(cached), 3),
        first_run_s=round(first, 1),
        cached_seconds=cached,
        help_s=round(statistics.median(helps), 3),
        ratio=round(first / statistics.median(cached), 1),
        ratio_means="first run wall s / cached re-run wall s",
        until=args.until or "leaderboard",
        rounds=args.rounds,
        identical_work=skipped,
        last_output_tail=outputs[-1].strip().splitlines()[-3:],
    )


if __name__ == "__main__":
    main()
