"""Peak RSS per rank of building a sharded model: meta-device init against full init then shard.

Two gloo ranks on CPU (torchrun) build the model the trainer's two ways:

- ``full``: every rank builds the whole model on CPU, draws the seeded init, then FSDP2 shards it
  (the trainer before meta-device init);
- ``meta``: every rank builds on the meta device, shards, ``to_empty`` on CPU, then draws only its
  shard's rows of the same seeded init (``tasks.pretrain.distributed.materialize_sharded``).

Each rank reports its peak RSS (``ru_maxrss``) and its RSS before the model is built (Python,
torch and the process group); ``identical_work`` says whether both ways ended with the same
weights (checksum over all shards). Prints ONE JSON line.

    python benchmarks/bench_meta_init.py [--preset 360m] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit

SEED = 0


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(mode: str, preset_name: str, out: Path) -> None:
    """One rank: build the sharded model one way, write its RSS figures and the checksum."""
    import torch

    from llmflow.model.config import preset
    from llmflow.model.transformer import Transformer
    from llmflow.tasks.pretrain.distributed import (
        materialize_sharded,
        param_checksum,
        setup_runtime,
        shard_model,
        teardown_runtime,
    )

    torch.set_num_threads(1)
    rt = setup_runtime()
    before = _rss_mib()
    started = time.perf_counter()
    if mode == "meta":
        with torch.device("meta"):
            model = Transformer(preset(preset_name))
        shard_model(model, rt)
        materialize_sharded(model, rt, SEED)
    else:
        model = Transformer(preset(preset_name))
        model.init_weights(seed=SEED)
        shard_model(model, rt)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    record = {"rank": rt.rank, "before_mib": before, "peak_mib": peak, "seconds": seconds}
    record["checksum"] = param_checksum(model)
    (out / f"{mode}-{rt.rank}.json").write_text(json.dumps(record))
    teardown_runtime()


def launch(mode: str, preset_name: str, out: Path) -> list[dict]:
    """Run the two ranks of one mode; return their records."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", __file__, "--worker", mode]
    command += ["--preset", preset_name, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, env=env, check=True, timeout=600, capture_output=True)
    return [json.loads((out / f"{mode}-{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="360m")
    parser.add_argument("--rounds", type=int, default=1, help="launches per mode, alternating")
    parser.add_argument("--worker", choices=["meta", "full"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.preset, args.out)
        return
    runs: dict[str, list[dict]] = {"full": [], "meta": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in ("full", "meta") if r % 2 == 0 else ("meta", "full"):
                runs[mode].append(launch(mode, args.preset, Path(tmp)))
    peak = {m: max(rank["peak_mib"] for run in v for rank in run) for m, v in runs.items()}
    base = {m: max(rank["before_mib"] for run in v for rank in run) for m, v in runs.items()}
    growth = {m: peak[m] - base[m] for m in runs}
    checksums = {m: {rank["checksum"] for run in v for rank in run} for m, v in runs.items()}
    emit(
        "meta_init_rss",
        preset=args.preset,
        ranks=2,
        peak_rss_mib_per_rank=peak,
        rss_before_build_mib=base,
        ratio=round(peak["meta"] / peak["full"], 3),
        growth_ratio=round(growth["meta"] / growth["full"], 3),
        build_seconds={
            m: max(rank["seconds"] for run in v for rank in run) for m, v in runs.items()
        },
        rounds=args.rounds,
        identical_work=checksums["meta"] == checksums["full"] and len(checksums["meta"]) == 1,
    )


if __name__ == "__main__":
    main()
