"""Fixtures: a moto S3 server and a real Prefect server, each started once per session."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

import pytest

from .servers import (
    BIN,
    S3,
    SERVER_START_TIMEOUT_S,
    PrefectServer,
    free_port,
    http_ok,
    moto_server,
    start,
    stop,
    wait_until,
)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3]:
    """moto's S3 server on 127.0.0.1, credentials that must never show up in outputs or logs."""
    with moto_server("llmflow-test") as s3:
        yield s3


@pytest.fixture()
def s3_env(s3_server: S3, monkeypatch: pytest.MonkeyPatch) -> S3:
    """The S3 credentials and endpoint in this process's environment, for this test only."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return s3_server


@contextlib.contextmanager
def _fresh_events_worker() -> Iterator[None]:
    """Drain Prefect's events and log workers on entry and exit: a worker is cached per client
    type, not per API URL, so one started before the URL changed keeps sending to the previous
    API (a later test's task runs then never reach the API it reads)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (EventsWorker, APILogWorker):
        worker.drain_all()
    try:
        yield
    finally:
        for worker in (EventsWorker, APILogWorker):
            worker.drain_all()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A real Prefect server (SQLite, own PREFECT_HOME); this process's client points at it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update(
        PREFECT_HOME=str(home / "home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_LOGGING_LEVEL="INFO",
        LLMFLOW_CACHE=str(home / "cache"),
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    server = PrefectServer(url, {**env, "PREFECT_API_URL": url}, home)
    proc = start(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env,
        home / "server.log",
    )
    try:
        wait_until(
            lambda: proc.poll() is not None or http_ok(f"{url}/health"),
            SERVER_START_TIMEOUT_S,
            "the Prefect server's /api/health",
        )
        assert proc.poll() is None, (home / "server.log").read_text()[-3000:]
        with temporary_settings(updates={PREFECT_API_URL: url}), _fresh_events_worker():
            yield server
    finally:
        for worker in reversed(server.processes):
            stop(worker)
        stop(proc)
        shutil.rmtree(home / "cache", ignore_errors=True)
