"""Preflight as a package: ``tasks/preflight/`` holds the checks, the
rehearsal and the memory sampling; ``flows/preflight.py`` is a short flow over it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MB = 10**6


def test_preflight_is_a_package_behind_a_short_flow():
    import llmflow.flows.preflight as flow
    import llmflow.tasks.preflight as package

    lines = {
        p.name: len(p.read_text().splitlines()) for p in (ROOT / "tasks/preflight").glob("*.py")
    }
    assert {"checks.py", "rehearsal.py", "memory.py"} <= set(lines), lines
    assert max(lines.values()) <= 500, lines
    flow_lines = len((ROOT / "flows/preflight.py").read_text().splitlines())
    assert flow_lines <= 100, flow_lines
    # the flow runs the package's checklist: one implementation, importable from both
    assert flow.preflight is package.preflight and flow.PreflightOptions is package.PreflightOptions


def _child(code: str, *argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *argv])


def test_rank_memory_samples_the_peak_rss_of_the_trainer_processes_only():
    """Three children of this process: two whose command line names the module every launcher
    starts (one touches 200 MB, then frees it; one allocates nothing), and one that does not name
    it and touches 400 MB. The sampler keeps the high-water mark of the first two only, and
    their difference is the 200 MB (within 10%: the interpreter's own pages differ a little)."""
    from llmflow.tasks.preflight.memory import RankMemory
    from llmflow.tasks.pretrain.notices import TRAIN_MODULE

    allocate = "import sys, time; b = b'x' * int(sys.argv[1]); del b; time.sleep(2)"
    with RankMemory(interval_s=0.05) as memory:
        trainer = _child(allocate, str(200 * MB), TRAIN_MODULE)
        idle = _child(allocate, "0", TRAIN_MODULE)
        other = _child(allocate, str(400 * MB), "something.else")
        for proc in (trainer, idle, other):
            assert proc.wait(timeout=60) == 0
        time.sleep(0.2)
    assert set(memory.peaks) <= {trainer.pid, idle.pid}
    assert {trainer.pid, idle.pid} <= set(memory.peaks), memory.peaks
    grown = memory.peaks[trainer.pid] - memory.peaks[idle.pid]
    assert grown == pytest.approx(200 * MB, rel=0.10), grown
    assert memory.peak_gb() == pytest.approx(memory.peaks[trainer.pid] / 1e9)
    assert 0.2 < memory.peak_gb() < 0.4  # the other child's 400 MB is not a trainer's


def test_descendants_are_read_from_proc():
    import os

    from llmflow.tasks.preflight.memory import descendants

    child = _child("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                   "'import time; time.sleep(3)']); time.sleep(3)")  # fmt: skip
    time.sleep(1.0)  # the grandchild has started
    found = descendants(os.getpid())
    below = descendants(child.pid)
    child.wait(timeout=30)
    assert child.pid in found and len(below) == 1 and below[0] in found
