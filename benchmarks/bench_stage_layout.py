"""One stage output against one output per shard: the store a mapped stage leaves, and its cost.

A mapped stage over N shards used to commit N outputs, ``{root}/{step}/{name}-{shard}-{hash}``,
each with its own ``lineage.json`` (config, packages, host, inputs) and ``_COMMITTED``. Now it
commits one stage output: the shards under ``shards/{label}/`` with a marker each, one
``lineage.json`` with a row per shard. This runs the same no-op mapped stage
(``tasks/framework/stage_overhead.py``, the local threads engine, no Prefect) with the code of
``--old-ref`` (the per-shard layout, from git) and with this checkout, alternating, each run in
a fresh process:

- ``stage_s``: the stage's wall time (every shard computed and committed);
- ``cached_s``: the same graph again, everything in the store (what a re-run pays first);
- ``verify_s``: ``llmflow verify`` over the root (every file's sha256 checked);
- ``outputs``, ``folders``, ``files``, ``lineage_files``, ``lineage_bytes``: what the stage
  leaves in the store (the source step's output excluded).

Ratios are old / new (above 1: the stage layout is faster). One JSON line per shard count.

    python benchmarks/bench_stage_layout.py [--shards 2000 10000] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OLD_REF = "25c8928"  # the last commit with one output per shard
STEP = "overhead-noop"


def _thread_engine(workers: int):
    """A stage engine on threads, in this tree or in the old checkout (before `backend.py`)."""
    try:
        from llmflow.tasks.framework.backend import ThreadBackend
        from llmflow.tasks.framework.engine import StageEngine
    except ImportError:  # the old layout's checkout has its own thread engine
        from llmflow.tasks.framework.engine import ThreadEngine

        return ThreadEngine(workers)
    return StageEngine(ThreadBackend(workers))


def worker(root: str, shards: int) -> dict:
    """In a fresh process: the stage, the cached walk, verify, and what the store holds."""
    from llmflow.tasks.framework.executor import Executor
    from llmflow.tasks.framework.graph import Graph
    from llmflow.tasks.framework.stage_overhead import (
        OverheadShards,
        overhead_noop,
        overhead_shards,
    )
    from llmflow.tasks.framework.verify import verify_root

    graph = Graph()
    source = graph.add(overhead_shards, OverheadShards(num_shards=shards), "n")
    noop = graph.add(overhead_noop, OverheadShards(), "n", map_over="shard", shard=source)
    engine = _thread_engine(2)
    try:
        Executor(root).run(Graph(nodes=[source]))  # the source, untimed
        started = time.perf_counter()
        outcome = Executor(root, engine=engine).run(graph)
        stage_s = time.perf_counter() - started
        started = time.perf_counter()
        again = Executor(root, engine=engine).run(graph)
        cached_s = time.perf_counter() - started
    finally:
        engine.close()
    assert all(r.cached for r in again[noop].results) and len(outcome[noop].results) == shards
    started = time.perf_counter()
    checks = verify_root(root)
    verify_s = time.perf_counter() - started
    assert all(c.status == "ok" for c in checks), [c for c in checks if c.status != "ok"][:3]
    step_dir = Path(root) / STEP
    entries = [p for p in step_dir.rglob("*") if ".partial" not in p.parts]
    lineage = [p for p in entries if p.name == "lineage.json"]
    return {
        "outputs": sum(not p.name.startswith(".") for p in step_dir.iterdir()),
        "stage_s": round(stage_s, 3),
        "cached_s": round(cached_s, 3),
        "verify_s": round(verify_s, 3),
        "folders": sum(p.is_dir() for p in entries),
        "files": sum(p.is_file() for p in entries),
        "lineage_files": len(lineage),
        "lineage_bytes": sum(p.stat().st_size for p in lineage),
        "outputs_verified": len(checks),
    }


def old_tree(ref: str, into: Path) -> Path:
    """The llmflow package at ``ref`` (from git), importable from the returned folder."""
    package = into / "llmflow"
    package.mkdir(parents=True)
    folders = ["tasks", "flows", "model", "configs", "deployments"]
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, *folders], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(package)], input=archive.stdout, check=True)
    (package / "__init__.py").write_text("")
    return into


def run_way(way: str, shards: int, work: Path, old: Path) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"{way}-{shards}-", dir=work))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if way == "old":  # NOTE: a folder on PYTHONPATH wins over the editable install's finder
        env["PYTHONPATH"] = str(old)
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[3])\n"
        "from bench_stage_layout import worker\n"
        "print(json.dumps(worker(sys.argv[1], int(sys.argv[2]))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root), str(shards), str(ROOT / "benchmarks")],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{way} at {shards} shards failed:\n{out.stderr[-3000:]}")
    subprocess.run(["rm", "-rf", str(root)], check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[2000, 10000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--old-ref", default=OLD_REF)
    parser.add_argument("--quick", action="store_true", help="seconds, tiny; not a result")
    parser.add_argument("--results", help="append the JSON lines to this file")
    args = parser.parse_args()
    if args.quick:
        args.shards, args.rounds = [50], 1
    from common import order

    with tempfile.TemporaryDirectory(prefix="stage-layout-") as tmp:
        work = Path(tmp)
        old = old_tree(args.old_ref, work / "old")
        for shards in args.shards:
            load_start = os.getloadavg()
            runs: dict[str, list[dict]] = {"old": [], "new": []}
            for way in order(["old", "new"], args.rounds):
                runs[way].append(run_way(way, shards, work, old))
            med = {
                way: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                for way, rs in runs.items()
            }
            record = {
                "bench": "stage_layout",
                "quick": args.quick,
                "shards": shards,
                "rounds": args.rounds,
                "old_ref": args.old_ref,
                "ratio": {
                    k: round(med["old"][k] / med["new"][k], 3)
                    for k in ("stage_s", "cached_s", "verify_s", "outputs", "lineage_files")
                },
                "ratio_means": "old (one output per shard) / new (one stage output)",
                "median": med,
                "runs": runs,
                "load_start": [round(x, 2) for x in load_start],
                "load_end": [round(x, 2) for x in os.getloadavg()],
            }
            line = json.dumps(record)
            print(line, flush=True)
            if args.results:
                with open(args.results, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
