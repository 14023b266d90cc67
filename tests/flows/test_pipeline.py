"""The pipeline flow on the embedded Prefect API: runs, caches, re-runs only what changed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmflow.tasks.config import load_config

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "sample.num_code_files=4",
    "sample.num_math_docs=30",
    "sample.num_exact_duplicates=4",
    "sample.num_near_duplicates=4",
    "sample.num_junk=3",
]


@pytest.fixture()
def run_pipeline(prefect_harness, tmp_path):
    from llmflow.flows.pipeline import pipeline

    def run(*overrides: str):
        cfg = load_config(None, [f"root={tmp_path}", *SMALL, *overrides])
        return {r.step: r for r in pipeline(cfg)}

    return run


def test_second_run_is_all_cached_and_a_change_reruns_downstream_only(run_pipeline, tmp_path):
    first = run_pipeline("until=ingest")
    assert [r.cached for r in first.values()] == [False, False]
    second = run_pipeline("until=ingest")
    assert all(r.cached for r in second.values())
    assert {k: r.uri for k, r in second.items()} == {k: r.uri for k, r in first.items()}
    changed = run_pipeline("until=ingest", "ingest.max_chars=4000")
    assert changed["sample"].cached and not changed["ingest"].cached
    assert changed["ingest"].uri != first["ingest"].uri
    record = json.loads((Path(changed["ingest"].uri) / "lineage.json").read_text())
    assert record["run"]["flow_run_id"] and record["inputs"][0]["uri"] == first["sample"].uri


def test_user_data_lineage_reaches_raw_files(run_pipeline, tmp_path):
    raw = tmp_path / "mydata"
    raw.mkdir()
    (raw / "a.jsonl").write_text('{"text": "hello world"}\n{"text": "bye"}\n')
    from llmflow.flows.pipeline import pipeline

    cfg = load_config(None, [f"root={tmp_path}", "until=ingest"]).model_copy(
        update={"data": [str(raw)]}
    )
    results = pipeline(cfg)
    out = subprocess.run(
        [sys.executable, "-m", "llmflow.flows.cli", "lineage", results[-1].uri],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "raw: " + str(raw / "a.jsonl") in out.stdout
    assert "ingest" in out.stdout


def _cli_run(root: Path, env: dict) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "llmflow.flows.cli",
        "run",
        "--root",
        str(root),
        "--until",
        "ingest",
    ]
    cmd += [arg for o in SMALL for arg in ("--set", o)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)


def test_cli_rerun_of_a_cached_graph_starts_no_api_unless_a_server_is_set(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    first = _cli_run(tmp_path / "runs", env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "nothing to run" not in first.stdout
    env["PREFECT_HOME"] = str(tmp_path / "prefect-again")  # the re-run's own Prefect home
    again = _cli_run(tmp_path / "runs", env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "every step's output is already in the store: nothing to run" in again.stdout
    assert "sample" in again.stdout and "ingest" in again.stdout
    # no flow run was created: the temporary API never started, so Prefect's home holds no db
    assert not list((tmp_path / "prefect-again").rglob("*.db"))
    # a half-deleted store is not "all cached": the missing step runs again
    ingest_dirs = list((tmp_path / "runs" / "ingest").iterdir())
    for marker in (tmp_path / "runs" / "ingest").rglob("_COMMITTED"):
        marker.unlink()
    third = _cli_run(tmp_path / "runs", env)
    assert third.returncode == 0 and "nothing to run" not in third.stdout
    assert ingest_dirs
