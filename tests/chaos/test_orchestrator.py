"""Faults of the orchestrator (issue 26): a real Prefect server killed and restarted mid-run.

The run either continues or fails with an error that says what failed; whatever it committed is
complete, and a re-run against the restarted server recomputes none of it.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmflow.tasks.framework.store import COMMIT_MARKER
from tests.integration.servers import (
    BIN,
    REPO,
    SERVER_START_TIMEOUT_S,
    free_port,
    http_ok,
    start,
    stop,
    wait_until,
)

pytestmark = pytest.mark.slow
SMALL = [
    "sample.num_code_files=4", "sample.num_math_docs=30", "sample.num_exact_duplicates=4",
    "sample.num_near_duplicates=4", "sample.num_junk=3",
]  # fmt: skip
RUN_TIMEOUT_S = 420


class RestartableServer:
    """``prefect server start`` on a fixed port and home (SQLite), so it can be killed and restarted."""

    def __init__(self, home: Path):
        self.home, self.port = home, free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        self.env = {
            **env,
            "PREFECT_HOME": str(home / "home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        argv = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1"]
        log = self.home / f"server-{self.starts}.log"
        self.proc = start([*argv, "--port", str(self.port)], self.env, log)
        wait_until(
            lambda: self.proc.poll() is not None or http_ok(f"{self.url}/health"),
            SERVER_START_TIMEOUT_S,
            "the Prefect server's /api/health",
        )
        assert self.proc.poll() is None, log.read_text()[-3000:]

    def kill(self) -> None:
        """SIGKILL the server's process group: no shutdown, as a crashed or evicted pod."""
        os.killpg(self.proc.pid, 9)
        self.proc.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestartableServer]:
    server = RestartableServer(tmp_path_factory.mktemp("prefect-chaos"))
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            stop(server.proc)


def _run(server: RestartableServer, root: Path, cache: Path, log: Path) -> subprocess.Popen:
    overrides = [arg for o in SMALL for arg in ("--set", o)]
    env = {
        **server.env,
        "PREFECT_API_URL": server.url,
        "LLMFLOW_CACHE": str(cache),
        "PYTHONPATH": str(REPO),
    }
    argv = [str(BIN / "llmflow"), "run", "--root", str(root), "--until", "ingest", *overrides]
    return start(argv, env, log)


def _committed(root: Path) -> dict[str, dict[str, int]]:
    """Each committed output (``step/name-hash``) with its files' mtimes (ns)."""
    return {
        marker.parent.relative_to(root).as_posix(): {
            p.relative_to(marker.parent).as_posix(): p.stat().st_mtime_ns
            for p in marker.parent.rglob("*")
            if p.is_file()
        }
        for marker in root.glob(f"*/*/{COMMIT_MARKER}")
    }


def _finish(proc: subprocess.Popen, log: Path) -> tuple[int, str]:
    try:
        proc.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop(proc)
        pytest.fail(f"the run did not end in {RUN_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
    return proc.returncode, log.read_text(errors="replace")


def test_server_killed_and_restarted_mid_run_loses_nothing_committed(
    server: RestartableServer, tmp_path: Path
):
    root, cache = tmp_path / "runs", tmp_path / "cache"
    first_log = tmp_path / "first.log"
    first = _run(server, root, cache, first_log)
    sample_done = lambda: list(root.glob(f"sample/*/{COMMIT_MARKER}"))  # noqa: E731
    wait_until(lambda: first.poll() is not None or sample_done(), RUN_TIMEOUT_S, "sample's commit")
    assert first.poll() is None, first_log.read_text()[-3000:]  # killed while the run goes on
    server.kill()
    killed_at = time.monotonic()
    in_flight = not list(root.glob(f"ingest/*/{COMMIT_MARKER}"))
    time.sleep(5)  # the run meets a dead API for a while
    server.start()
    down_s = time.monotonic() - killed_at
    code, output = _finish(first, first_log)
    print(f"API down {down_s:.0f} s, ingest committed before: {not in_flight}, run rc {code}")
    committed = _committed(root)
    assert "sample" in {key.split("/")[0] for key in committed}
    # every output folder is committed: a failed step never leaves one that looks complete
    outputs = {p.relative_to(root).as_posix() for p in root.glob("*/*") if p.name[0] != "."}
    assert outputs == set(committed)
    if code != 0:  # failing is allowed, if it says what failed
        tail = output[-4000:].lower()
        assert "connect" in tail or "api" in tail, output[-4000:]

    rerun_log = tmp_path / "rerun.log"
    code, output = _finish(_run(server, root, cache, rerun_log), rerun_log)
    assert code == 0, output[-4000:]
    after = _committed(root)
    assert {key.split("/")[0] for key in after} == {"sample", "ingest"}
    for output_key, files in committed.items():  # nothing committed was recomputed
        assert after[output_key] == files, output_key
        step = output_key.split("/")[0]
        assert any(line.split()[:2] == [step, "cached"] for line in output.splitlines()), output
