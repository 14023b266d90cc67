"""bench_attention: ``--quick`` runs the three sides in fresh processes with the kernels they name
(packed: per-document, causal: one causal call, dense: the masked reference), the packed and dense
sides compute the same loss, and a worker's memory is its own peak, not its parent's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_mode_runs_each_side_with_its_kernel_and_packed_equals_dense():
    out = subprocess.run([sys.executable, "bench_attention.py", "--quick"], cwd=REPO / "benchmarks",
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert record["bench"] == "attention_packed" and record["kernel"] == "sdpa-buckets"
    assert record["kernels"] == {"packed": ["sdpa-buckets"], "causal": ["sdpa-causal"],
                                 "dense": ["dense"]}  # fmt: skip
    assert record["identical_work"] is True
    loss = record["loss"]
    assert abs(loss["packed"] - loss["dense"]) < 1e-4 and loss["packed"] != loss["causal"]
    seconds, mib = record["step_seconds"], record["step_mib"]
    assert all(v > 0 for v in (*seconds.values(), *mib.values()))
    assert record["time_ratio"] == round(seconds["packed"] / seconds["causal"], 3)
    assert abs(record["memory_ratio"] - mib["packed"] / mib["causal"]) < 1e-2
    assert record["dense"]["step_mib"] == mib["dense"]


def test_a_workers_peak_rss_is_its_own_not_its_parents():
    # a parent holding 400 MiB starts the worker: ru_maxrss inherits that peak at exec
    code = (
        "import resource, subprocess, sys\n"
        "held = bytearray(400 * 2**20)\n"
        "held[::4096] = b'1' * len(held[::4096])\n"
        "child = 'import resource; from bench_attention import _high_water; "
        "print(_high_water() // 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)'\n"
        "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True,"
        " check=True).stdout)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO / "benchmarks",
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    own_mib, ru_maxrss_mib = map(int, out.stdout.split())
    assert ru_maxrss_mib >= 400  # the trap
    assert own_mib < 100  # a Python that imported only bench_attention's header
