"""Peak memory of near dedup: the single-process union-find against the partitioned stages,
each in its own process (``ru_maxrss``), on band-key files where documents >> duplicates.

    python -m tests.tasks.curation.test_distributed_dedup_memory   # prints the table

The union-find's peak grows with the documents; the partitioned driver's with the duplicates,
and a partition worker's with its partition (documents / partitions, kept constant here).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmflow.tasks.curation import distributed_dedup as dd
from llmflow.tasks.curation.config import MinhashConfig
from llmflow.tasks.curation.shards import write_drops
from llmflow.tasks.framework.backend import ProcessBackend

REPO = Path(__file__).resolve().parents[3]
NUM_BUCKETS = MinhashConfig().num_buckets
NUM_FILES = 8
DEADLINE_S = 600
MODULE = "tests.tasks.curation.test_distributed_dedup_memory"


def write_corpus(root: Path, num_docs: int, num_duplicates: int, seed: int = 0) -> None:
    """`NUM_FILES` band-key files of `num_docs` documents with random keys, `num_duplicates`
    of them near copies of another (sharing 1-3 bands with it), and alive shards holding every
    document but each 50th."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 2**63, (num_docs, NUM_BUCKETS), dtype=np.int64).astype(np.uint64)
    copies = rng.choice(num_docs, num_duplicates, replace=False)
    for copy in copies:
        original = int(rng.integers(num_docs))
        shared = rng.choice(NUM_BUCKETS, int(rng.integers(1, 4)), replace=False)
        keys[copy, shared] = keys[original, shared]
    ids = np.array([f"d{i:09d}" for i in range(num_docs)], dtype=object)
    lengths = rng.integers(100, 5000, num_docs)
    (root / "sigs").mkdir(parents=True)
    (root / "filtered").mkdir()
    for f, rows in enumerate(np.array_split(np.arange(num_docs), NUM_FILES)):
        columns = {"id": pa.array(ids[rows], pa.string()), "length": pa.array(lengths[rows])}
        for b in range(NUM_BUCKETS):
            columns[f"band_{b:02d}"] = pa.array(keys[rows, b], pa.uint64())
        pq.write_table(pa.table(columns), root / "sigs" / f"shard-{f:05d}.minhash.parquet")
        alive = rows[rows % 50 != 7]
        pq.write_table(
            pa.table({"id": pa.array(ids[alive], pa.string()), "text": ["t"] * len(alive)}),
            root / "filtered" / f"shard-{f:05d}.parquet",
        )


def peak_mib() -> float:
    """This process's peak resident memory since it started its program (VmHWM).

    NOTE: not ``ru_maxrss``: Linux carries the peak over ``exec``, so a child started by a
    large parent (pytest, the driver) reports at least the parent's size.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _with_peak(fn, item):
    return fn(item), peak_mib()


class PeakMap:
    """A map on spawned workers that also keeps the largest peak any worker reached."""

    def __init__(self, workers: int = 2):
        self.workers, self.peak = workers, 0.0

    def __call__(self, fn, items):
        with ProcessBackend(self.workers) as backend:  # fresh workers for each stage
            done = backend.map(partial(_with_peak, fn), items)
        self.peak = max([self.peak, *(peak for _, peak in done)])
        return [result for result, _ in done]


def measure(kind: str, root: Path, partitions: int) -> dict:
    """In this process: run one way, write its drops, return peak RSS (MiB) and seconds."""
    from llmflow.tasks.curation.minhash import near_dedup

    start = time.perf_counter()
    out = root / f"out-{kind}"
    out.mkdir()
    workers = PeakMap()
    if kind == "baseline":  # imports and Arrow's start (~60 MiB), here and in spawned workers
        tiny = root / "tiny" / "part-00000"
        tiny.mkdir(parents=True)
        pq.write_table(pa.table({"pos": [0]}), tiny / "unit-000000.parquet")
        dd._read_pieces(root / "tiny", 0)
        workers(partial(dd._read_pieces, root / "tiny"), [0, 0])
    elif kind == "union_find":
        near_dedup(MinhashConfig(), [root / "sigs"], out, filtered=[root / "filtered"])
    else:
        with dd.scratch_folder(out) as scratch:
            result = dd.partitioned_near(
                dd.source_files([root / "sigs"], "minhash"),
                dd.alive_shards_of([root / "filtered"], True),
                set(),
                NUM_BUCKETS,
                "first",
                partitions,
                scratch,
                map_fn=workers,
            )
        write_drops(out, [d[0] for d in result.drops], "near_duplicate")
    return {
        "kind": kind,
        "seconds": round(time.perf_counter() - start, 1),
        "driver_mib": round(peak_mib(), 1),
        "worker_mib": round(workers.peak, 1),
    }


def run_measure(kind: str, root: Path, partitions: int = 1) -> dict:
    """`measure` in a fresh process (its peaks are that way's alone)."""
    command = [sys.executable, "-m", MODULE, "measure", kind, str(root), str(partitions)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ids(out: Path) -> list[str]:
    return pq.read_table(out / "drops.parquet").column("id").to_pylist()


def compare(tmp: Path, sizes: list[tuple[int, int]], num_duplicates: int) -> list[dict]:
    """For each (documents, partitions): every way's peaks, and whether the drops agree."""
    rows = []
    for num_docs, partitions in sizes:
        root = tmp / f"n{num_docs}"
        write_corpus(root, num_docs, num_duplicates)
        found = {
            k: run_measure(k, root, partitions) for k in ("baseline", "union_find", "partitioned")
        }
        same = _ids(root / "out-union_find") == _ids(root / "out-partitioned")
        rows.append(
            {
                "documents": num_docs,
                "partitions": partitions,
                "same_drops": same,
                **{
                    f"{k}_{m}": v[m]
                    for k, v in found.items()
                    for m in ("driver_mib", "worker_mib", "seconds")
                },
                "drops": len(_ids(root / "out-union_find")),
            }
        )
    return rows


@pytest.mark.slow
def test_partitioned_near_dedup_memory_grows_with_duplicates_not_documents(tmp_path):
    small, large = compare(tmp_path, [(250_000, 8), (1_000_000, 32)], num_duplicates=2_000)
    print(json.dumps([small, large], indent=1))
    assert small["same_drops"] and large["same_drops"] and large["drops"] > 1_000

    def above(row: dict, kind: str, who: str) -> float:
        """A way's peak (MiB) above the baseline's (imports and Arrow's start) in that role."""
        return row[f"{kind}_{who}_mib"] - row[f"baseline_{who}_mib"]

    # the union-find holds every document: 4x the documents, over 2.5x the memory
    assert above(large, "union_find", "driver") > 2.5 * above(small, "union_find", "driver")
    for who in ("driver", "worker"):
        # 4x the documents in 4x the partitions: the partitioned peaks stay within 50 MiB
        assert above(large, "partitioned", who) < above(small, "partitioned", who) + 50
        assert above(large, "partitioned", who) < above(large, "union_find", "driver") / 3


if __name__ == "__main__":
    if sys.argv[1:2] == ["measure"]:
        print(json.dumps(measure(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))))
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            sizes = [(250_000, 8), (1_000_000, 32), (4_000_000, 128)]
            for row in compare(Path(tmp), sizes[: int(sys.argv[1]) if sys.argv[1:] else 2], 2_000):
                print(json.dumps(row))
