"""Helpers for integration tests: free ports, bounded waits, process groups, server handles.

Servers are always stopped at the end of the session. Waits are bounded but generous:
on a loaded 2-core machine the Prefect server takes 30-60 s to answer its health check.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SERVER_START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 1.0):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop a process group started by a test: SIGTERM, then SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def start(argv: list[str], env: dict[str, str], log: Path, cwd: Path = REPO) -> subprocess.Popen:
    """Start a long-running subprocess in its own process group, output to ``log``."""
    out = open(log, "wb")  # noqa: SIM115  (kept open for the process's life)
    return subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def flow_run_logs(flow_run_id, page: int = 200) -> list[str]:
    """Every log message the API holds for one flow run, oldest first (read page by page)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    flow_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    messages: list[str] = []
    with get_client(sync_client=True) as client:
        for offset in range(0, 1_000_000, page):  # bounded: a million lines is not a test's log
            logs = client.read_logs(flow_run, limit=page, offset=offset, sort=LogSort.TIMESTAMP_ASC)
            messages += [log.message for log in logs]
            if len(logs) < page:
                break
    return messages


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


# -- handles ------------------------------------------------------------------------------------
class S3:
    """A moto S3 server with one bucket, and the env a client needs to reach it."""

    def __init__(self, endpoint: str, bucket: str, env: dict[str, str]):
        self.endpoint, self.bucket, self.env = endpoint, bucket, env

    @property
    def credentials(self) -> list[str]:
        return [self.env["AWS_ACCESS_KEY_ID"], self.env["AWS_SECRET_ACCESS_KEY"]]

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, **_boto_kwargs(self.env))

    def keys(self, prefix: str) -> list[str]:
        pages = (
            self.client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=self.bucket, Prefix=prefix)
        )
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def read(self, key: str) -> bytes:
        return self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()


def _boto_kwargs(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


# -- Prefect server ------------------------------------------------------------------------
class PrefectServer:
    """A ``prefect server start`` subprocess and the env its clients use."""

    def __init__(self, url: str, env: dict[str, str], home: Path):
        self.url, self.env, self.home = url, env, home
        self.processes: list[subprocess.Popen] = []

    def cli(self, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
        """Run ``prefect ARGS`` against this server from the repository root."""
        return subprocess.run(
            [str(BIN / "prefect"), *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def start(self, argv: list[str], log_name: str, env: dict[str, str] | None = None):
        proc = start(argv, env or self.env, self.home / log_name)
        self.processes.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.home / name).read_text(errors="replace")


@contextlib.contextmanager
def moto_server(bucket: str, secret_prefix: str = "llmflow-secret-") -> Iterator[S3]:
    """moto's S3 server on 127.0.0.1 with ``bucket``, and made-up credentials (the secret starts
    with ``secret_prefix``, so a test can look for it in outputs and logs). Stopped on exit."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "AKIA" + secrets.token_hex(8).upper(),
        "AWS_SECRET_ACCESS_KEY": secret_prefix + secrets.token_hex(12),
        "AWS_DEFAULT_REGION": "us-east-1",
        # botocore (under s3fs) reads the endpoint from AWS_ENDPOINT_URL; fsspec's own
        # FSSPEC_S3_ENDPOINT_URL works too (see docs/CLUSTER.md).
        "AWS_ENDPOINT_URL": endpoint,
    }
    s3 = S3(endpoint, bucket, env)
    s3.client().create_bucket(Bucket=bucket)
    try:
        yield s3
    finally:
        server.stop()
