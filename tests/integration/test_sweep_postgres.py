"""An Optuna sweep whose study lives in a real PostgreSQL server (started here, on 127.0.0.1):
trials are written there, nothing goes to the root's SQLite file, and a repeated sweep of the
same study trains nothing."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from .servers import REPO, free_port, start, stop, wait_until

pytestmark = pytest.mark.integration

_spec = importlib.util.spec_from_file_location("sweep_helpers", REPO / "tests/flows/test_sweep.py")
sweep_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep_helpers)


def _postgres_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    return str(candidates[-1]) if candidates else None


def _as_server_user(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: drop to ``nobody`` there."""
    if os.geteuid() != 0:
        return argv
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv]


@pytest.fixture
def postgres_url(tmp_path):
    """A fresh PostgreSQL cluster and database; its SQLAlchemy URL."""
    psycopg2 = pytest.importorskip("psycopg2", reason="psycopg2 is not installed (llmflow[sweep])")
    initdb, postgres = _postgres_bin("initdb"), _postgres_bin("postgres")
    if not (initdb and postgres):
        pytest.skip("PostgreSQL's initdb/postgres binaries are not installed")
    # Outside pytest's tmp_path: the server user must be able to reach the folder.
    folder = Path(tempfile.mkdtemp(prefix="llmflow-pg-"))
    if os.geteuid() == 0:
        shutil.chown(folder, "nobody")
    init = subprocess.run(
        _as_server_user([initdb, "-D", str(folder / "data"), "-U", "llmflow", "--auth=trust"]),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert init.returncode == 0, init.stdout + init.stderr
    port = free_port()
    server = start(
        _as_server_user(
            [postgres, "-D", str(folder / "data"), "-p", str(port), "-k", str(folder)]
            + ["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]
        ),
        env=dict(os.environ),
        log=tmp_path / "postgres.log",
    )

    def ready():
        try:
            conn = psycopg2.connect(host="127.0.0.1", port=port, user="llmflow", dbname="postgres")
        except psycopg2.OperationalError:
            return None
        return conn

    try:
        conn = wait_until(ready, 60, "PostgreSQL to accept connections", interval_s=0.5)
        conn.autocommit = True
        with conn.cursor() as cursor:
            cursor.execute("CREATE DATABASE sweeps")
        conn.close()
        yield f"postgresql+psycopg2://llmflow@127.0.0.1:{port}/sweeps"
    finally:
        stop(server)
        shutil.rmtree(folder, ignore_errors=True)


def test_sweep_study_lives_in_postgres_and_a_repeat_trains_nothing(
    prefect_harness, tmp_path, postgres_url
):
    import optuna

    from llmflow.flows.sweep import run_sweep, sweep_folder

    data, val = sweep_helpers.packed_inputs(tmp_path)
    cfg = sweep_helpers.tiny_config(tmp_path)
    space = sweep_helpers.space(study="pg", storage=postgres_url)
    first = run_sweep(cfg, space, data, val)

    study = optuna.load_study(study_name="pg", storage=postgres_url)
    assert len(study.trials) == len(first.rows) == 2
    assert study.best_value == pytest.approx(first.best_value, abs=1e-6)
    assert [t.params for t in study.trials] == [
        {"pretrain.train.optimizer.lr": r["pretrain.train.optimizer.lr"]} for r in first.rows
    ]
    folder = sweep_folder(cfg, space)
    assert not (folder / "study.db").exists()  # nothing went to SQLite
    assert (folder / "best.yaml").exists() and (folder / "history.png").exists()

    again = run_sweep(cfg, space, data, val)  # the study is finished: no new trial trains
    assert len(optuna.load_study(study_name="pg", storage=postgres_url).trials) == 2
    assert again.best_value == first.best_value and again.tokens == first.tokens
