"""Running a test's ranks with a deadline: spawned processes, or a torchrun command."""

from __future__ import annotations

import os
import signal
import subprocess
import time

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
