"""Faults of the orchestrator (issue 26): a real Prefect server killed and restarted mid-run.

The run either continues or fails with an error that says what failed; whatever it committed is
complete, and a re-run against the restarted server recomputes none of it. The run's root is on
S3 (moto) behind the fault proxy, which holds the ingest step's commit marker: the server is
killed while that step is provably in flight.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmflow.tasks.framework.store import COMMIT_MARKER
from tests.chaos.s3_proxy import Request, S3FaultProxy
from tests.chaos.test_object_store import BUCKET, moto_server
from tests.integration.servers import (
    BIN,
    REPO,
    S3,
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


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    with moto_server() as s3:
        yield s3


def _run(server: RestartableServer, env: dict[str, str], root: str, log: Path) -> subprocess.Popen:
    overrides = [arg for o in SMALL for arg in ("--set", o)]
    env = {**server.env, **env, "PREFECT_API_URL": server.url, "PYTHONPATH": str(REPO)}
    argv = [str(BIN / "llmflow"), "run", "--root", root, "--until", "ingest", *overrides]
    return start(argv, env, log)


def _committed(s3: S3, prefix: str) -> dict[str, dict[str, str]]:
    """Each committed output (``step/name-hash``) with its objects' ETags and LastModified."""
    objects = [
        o
        for page in s3.client()
        .get_paginator("list_objects_v2")
        .paginate(Bucket=BUCKET, Prefix=f"{prefix}/")
        for o in page.get("Contents", [])
    ]
    outputs = {o["Key"].rsplit("/", 1)[0] for o in objects if o["Key"].endswith(COMMIT_MARKER)}
    return {
        out.removeprefix(f"{prefix}/"): {
            o["Key"]: f"{o['ETag']} {o['LastModified'].isoformat()}"
            for o in objects
            if o["Key"].startswith(out + "/")
        }
        for out in outputs
    }


def _finish(proc: subprocess.Popen, log: Path) -> tuple[int, str]:
    try:
        proc.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop(proc)
        pytest.fail(f"the run did not end in {RUN_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
    return proc.returncode, log.read_text(errors="replace")


def _is_ingest_marker(request: Request) -> bool:
    parts = request.key.split("/")
    return request.method == "PUT" and parts[1] == "ingest" and parts[-1] == COMMIT_MARKER


def test_server_killed_and_restarted_mid_step_loses_nothing_committed(
    server: RestartableServer, s3: S3, tmp_path: Path
):
    prefix = "orchestrator"
    root = f"s3://{BUCKET}/{prefix}"
    with S3FaultProxy(s3.endpoint) as proxy:
        env = {**s3.env, "AWS_ENDPOINT_URL": proxy.endpoint, "LLMFLOW_CACHE": str(tmp_path / "c")}
        hold = proxy.hold(_is_ingest_marker)
        first_log = tmp_path / "first.log"
        first = _run(server, env, root, first_log)
        try:
            reached = hold.reached.wait(RUN_TIMEOUT_S)
            assert reached, first_log.read_text()[-3000:]
            assert {k.split("/")[0] for k in _committed(s3, prefix)} == {"sample"}
            server.kill()  # ingest's data is up, its marker held: the step is in flight
            killed_at = time.monotonic()
            time.sleep(5)
        finally:
            hold.release()  # the held PUT is reset; botocore sends it again
        server.start()
        down_s = time.monotonic() - killed_at
        code, output = _finish(first, first_log)
        print(f"API down {down_s:.0f} s, run rc {code}")
        committed = _committed(s3, prefix)
        assert "sample" in {key.split("/")[0] for key in committed}
        # every output folder holding data is committed, or the run said what failed
        folders = {k.split("/", 3)[1] + "/" + k.split("/", 3)[2] for k in s3.keys(f"{prefix}/")}
        folders = {f for f in folders if not f.split("/")[1].startswith(".")}
        if code == 0:
            assert folders == set(committed)
        else:  # failing is allowed, if it says what failed
            tail = output[-4000:].lower()
            assert "connect" in tail or "api" in tail, output[-4000:]

        rerun_log = tmp_path / "rerun.log"
        code, output = _finish(_run(server, env, root, rerun_log), rerun_log)
    assert code == 0, output[-4000:]
    after = _committed(s3, prefix)
    assert {key.split("/")[0] for key in after} == {"sample", "ingest"}
    for output_key, objects in committed.items():  # nothing committed was recomputed
        assert after[output_key] == objects, output_key
        step = output_key.split("/")[0]
        assert any(line.split()[:2] == [step, "cached"] for line in output.splitlines()), output
