"""bench_mfu: the peak read from a device's name, and ``--quick`` on a CPU (so CI keeps the
GPU benchmark's script alive): both sides start from the same loss, FLOPs per token by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.bench_mfu import QUICK, peak_for_name

REPO = Path(__file__).resolve().parents[2]


def test_the_peak_is_read_from_the_device_name():
    assert peak_for_name("NVIDIA H100 80GB HBM3") == 989e12  # SXM
    assert peak_for_name("NVIDIA H200") == 989e12
    assert peak_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_for_name("Tesla T4") is None


def test_quick_mode_runs_on_cpu_with_both_sides_from_the_same_weights():
    out = subprocess.run(
        [sys.executable, "bench_mfu.py", "--quick", "--rounds", "1", "--steps", "1",
         "--warmup", "0", "--no-compile"],
        cwd=REPO / "benchmarks", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert record["bench"] == "mfu_quick_cpu" and record["identical_work"] is True
    first = record["first_step_loss"]
    assert abs(first["ours_eager"] - first["smollm3_eager"]) < 2e-2
    c, layers, v, i, t = (QUICK[k] for k in ("hidden_size", "num_layers", "vocab_size",
                                             "intermediate_size", "max_seq_len"))  # fmt: skip
    kv = QUICK["num_kv_heads"] * c // QUICK["num_heads"]
    non_embedding = layers * (c * (c + 2 * kv) + c * c + 3 * c * i + 2 * c) + c
    assert record["flops_per_token"] == 6 * (non_embedding + v * c) + 12 * layers * c * t
    assert record["mfu"] == {"ours_eager": None, "smollm3_eager": None}  # no peak on a CPU
    assert set(record["tokens_per_s"]) == {"ours_eager", "smollm3_eager"}
