"""Running a test's ranks with a deadline: spawned processes, or a torchrun command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def join_ranks(procs: list, timeout_s: float) -> None:
    """Start spawned rank processes, wait for all within ``timeout_s``, kill the rest, and
    assert every rank exited 0."""
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 1))
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def run_group(command: list[str], env: dict[str, str], deadline_s: float, what: str) -> str:
    """Run ``command`` (torchrun and its ranks) in its own session; its output. Past
    ``deadline_s`` the whole group is killed and the test fails naming ``what``."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{what} hung past {deadline_s} s:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-5000:]
    return output


def run_record_worker(
    script: str, cfg, data_dir: Path, out_dir: Path, processes: int, timeout: float = 240
) -> dict:
    """Run ``script`` (a test module whose ``__main__`` trains ``cfg`` and rank 0 writes
    ``record.pt``) in ``processes`` torchrun ranks, one thread each; rank 0's record."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(out_dir / "train_config.json")
    command = [sys.executable, script, str(out_dir / "train_config.json"), str(data_dir)]
    if processes > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone"]
        command[1:1] = [*launcher, "--nproc_per_node", str(processes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        command, cwd=out_dir, env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return torch.load(out_dir / "record.pt")


def max_rel(a, b) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
