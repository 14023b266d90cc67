"""benchmarks/run_all.py: refuses on a loaded machine, and records goals from each record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.run_all import Goal, benchmarks, table

REPO = Path(__file__).resolve().parents[2]


def test_a_loaded_machine_gets_a_refusal_row_and_no_figure(tmp_path):
    # --max-load -1: no machine is that quiet, so the benchmark must not run
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run_all.py"), "--only", "loader",
         "--max-load", "-1", "--wait", "0", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (jsonl,) = tmp_path.glob("run-*.jsonl")
    (row,) = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert row["record"] is None and row["runner"]["refused"].startswith("load ")
    assert "refused: load" in next(tmp_path.glob("run-*.md")).read_text()


def test_goals_read_dotted_figures_and_compare_both_ways():
    record = {"ratio": {"filters": 9.6, "minhash": 0.8}, "memory_ratio": 0.25}
    assert Goal("ratio.filters", ">=", 1.0, "f").met(record) is True
    assert Goal("ratio.minhash", ">=", 1.0, "m").met(record) is False
    assert Goal("memory_ratio", "<=", 0.3, "m").met(record) is True
    assert Goal("missing.path", "<=", 0.3, "m").met(record) is None


def test_every_benchmark_runs_at_least_3_rounds_in_full_mode_and_its_script_exists(tmp_path):
    for bench in benchmarks(tmp_path):
        assert (REPO / "benchmarks" / bench.script).is_file(), bench.script
        if "--rounds" in bench.full:
            assert int(bench.full[bench.full.index("--rounds") + 1]) >= 3, bench.name
        if "--seeds" in bench.full:
            assert int(bench.full[bench.full.index("--seeds") + 1]) >= 3, bench.name


def test_the_table_marks_missed_goals():
    row = {"bench": "pack", "record": {"ratio": 1.1, "load_avg": [1.0]},
           "goals": [{"label": "pack", "goal": ">= 1.5", "value": 1.1, "met": False}],
           "runner": {"load_before": 1.2}}  # fmt: skip
    assert "| pack | pack | >= 1.5 | 1.1 | **no** | 1.2 | 1.0 |" in table([row], quick=False)
