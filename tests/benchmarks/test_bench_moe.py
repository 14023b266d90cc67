"""bench_moe: ``--quick`` times both blocks on the same weights (outputs agree), names the experts
implementation transformers ran, and records the loop-vs-grouped_mm and train-step parts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_run_records_the_three_parts(tmp_path):
    results = tmp_path / "moe.jsonl"
    out = subprocess.run(
        [sys.executable, "bench_moe.py", "--quick", "--rounds", "1", "--results", str(results)],
        cwd=REPO / "benchmarks", capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["bench"] for r in records] == [
        "moe_block",
        "moe_loop_vs_grouped_mm",
        "moe_train_step",
    ]
    assert [json.loads(line) for line in results.read_text().splitlines()] == records
    block, loop, step = records
    assert block["identical_work"] is True
    for key, figures in block["blocks"].items():
        assert figures["transformers"]["experts_implementation"] == "grouped_mm", key
        assert figures["floor_ms"] > 0 and figures["ms"]["ours"] > 0
    fp32 = block["blocks"]["64,4,32,2,256/float32"]
    assert fp32["max_abs_diff"] < 1e-4 and block["ratio"] == fp32["ratio"]
    assert all(v["max_abs_diff"] < 1e-5 for k, v in loop["blocks"].items() if "float32" in k)
    active = step["active_parameters"]  # equal up to the routers (8 x 128 per layer)
    assert abs(active["moe-debug"] - active["debug"]) <= 8 * 128 * 4
    assert step["ratio"] > 0 and set(step["tokens_per_s"]) == {"moe-debug", "debug"}
