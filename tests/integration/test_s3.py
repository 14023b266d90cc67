"""Artifacts on S3 (a real moto server): the pipeline, lineage, credentials, resume after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .servers import BIN, REPO, S3, wait_until

pytestmark = pytest.mark.integration
SMALL = [
    "sample.num_code_files=4",
    "sample.num_math_docs=30",
    "sample.num_exact_duplicates=4",
    "sample.num_near_duplicates=4",
    "sample.num_junk=3",
]
TOY = Path(__file__).with_name("toy_step.py")


def _env(s3: S3, cache: Path) -> dict[str, str]:
    return {
        **os.environ,
        **s3.env,
        "LLMFLOW_CACHE": str(cache),
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PYTHONPATH": str(REPO),
    }


def _outputs(s3: S3, prefix: str, step: str) -> list[str]:
    """Output folders (keys up to the output name) of one step that hold a commit marker."""
    keys = s3.keys(f"{prefix}/{step}/")
    return sorted({k.rsplit("/", 1)[0] for k in keys if k.endswith("/_COMMITTED")})


@pytest.fixture(scope="module")
def s3_pipeline(s3_server: S3, tmp_path_factory: pytest.TempPathFactory):
    """``llmflow run --root s3://... --until ingest`` once, as a user would start it."""
    root = f"s3://{s3_server.bucket}/runs"
    overrides = [arg for o in SMALL for arg in ("--set", o)]
    out = subprocess.run(
        [str(BIN / "llmflow"), "run", "--root", root, "--until", "ingest", *overrides],
        cwd=REPO,
        env=_env(s3_server, tmp_path_factory.mktemp("cache")),
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_pipeline_commits_outputs_and_lineage_on_s3(s3_pipeline, s3_server: S3):
    (sample,) = _outputs(s3_server, "runs", "sample")
    (ingest,) = _outputs(s3_server, "runs", "ingest")
    ingest_keys = s3_server.keys(ingest + "/")
    assert any(k.endswith(".parquet") for k in ingest_keys)
    assert f"{ingest}/lineage.json" in ingest_keys and f"{ingest}/report.json" in ingest_keys
    record = json.loads(s3_server.read(f"{ingest}/lineage.json"))
    assert record["uri"] == f"s3://{s3_server.bucket}/{ingest}"
    assert record["inputs"][0]["uri"] == f"s3://{s3_server.bucket}/{sample}"
    assert record["run"]["flow_run_id"]
    assert not [k for k in s3_server.keys("runs/") if "/.partial/" in k]
    assert f"s3://{s3_server.bucket}/{ingest}" in s3_pipeline.stdout  # the run's summary


def test_credentials_never_reach_outputs_or_logs(s3_pipeline, s3_server: S3):
    logs = s3_pipeline.stdout + s3_pipeline.stderr
    assert "Finished in state Completed" in logs  # the logs are really there to be checked
    texts = {key: s3_server.read(key).decode("utf-8", "replace") for key in s3_server.keys("runs/")}
    assert any(key.endswith("lineage.json") for key in texts)
    for secret in s3_server.credentials:
        assert secret not in logs
        assert not [key for key, text in texts.items() if secret in text]


def test_lineage_command_reads_from_s3(s3_pipeline, s3_server: S3, tmp_path: Path):
    (sample,) = _outputs(s3_server, "runs", "sample")
    (ingest,) = _outputs(s3_server, "runs", "ingest")
    out = subprocess.run(
        [str(BIN / "llmflow"), "lineage", f"s3://{s3_server.bucket}/{ingest}"],
        cwd=REPO,
        env=_env(s3_server, tmp_path / "cache"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(f"ingest s3://{s3_server.bucket}/{ingest}")
    assert f"sample: sample s3://{s3_server.bucket}/{sample}" in out.stdout
    for secret in s3_server.credentials:
        assert secret not in out.stdout + out.stderr


def test_killed_step_resumes_from_s3_state_on_another_machine(s3_server: S3, tmp_path: Path):
    root = f"s3://{s3_server.bucket}/resume"
    ready, found = tmp_path / "ready", tmp_path / "found.json"
    crashed = subprocess.Popen(
        [sys.executable, str(TOY), root, "crash", str(ready)],
        cwd=REPO,
        env=_env(s3_server, tmp_path / "cache-a"),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: ready.exists() or crashed.poll() is not None, 120, "the toy step's sync")
        assert ready.exists(), crashed.stdout.read().decode()[-3000:]
    finally:
        os.killpg(crashed.pid, signal.SIGKILL)
        crashed.wait(30)
    partial = [k for k in s3_server.keys("resume/toy/.partial/") if "/checkpoints/" in k]
    assert [k.split("/checkpoints/")[1] for k in partial] == [
        "step-000002/COMPLETE",
        "step-000002/weights.bin",  # the pruned step-000001 is gone
    ]
    assert not _outputs(s3_server, "resume", "toy")

    # A fresh cache: nothing local survives, as on another node.
    resumed = subprocess.run(
        [sys.executable, str(TOY), root, "resume", str(found)],
        cwd=REPO,
        env=_env(s3_server, tmp_path / "cache-b"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.loads(found.read_text()) == [
        "checkpoints/step-000002/COMPLETE",
        "checkpoints/step-000002/weights.bin",
    ]
    (output,) = _outputs(s3_server, "resume", "toy")
    assert f"{output}/final.txt" in s3_server.keys(output + "/")
    assert not s3_server.keys("resume/toy/.partial/")


def _commit_by_hand(s3: S3, key: str, ended_at: str) -> str:
    client = s3.client()
    client.put_object(
        Bucket=s3.bucket, Key=f"{key}/lineage.json", Body=f'{{"ended_at": "{ended_at}"}}'
    )
    client.put_object(Bucket=s3.bucket, Key=f"{key}/_COMMITTED", Body=b"now")
    return f"s3://{s3.bucket}/{key}"


def test_long_lived_process_sees_outputs_committed_by_others(s3_env: S3, tmp_path: Path):
    from llmflow.tasks.framework.store import Store

    store = Store(f"s3://{s3_env.bucket}/shared", cache_dir=tmp_path)
    first = _commit_by_hand(s3_env, "shared/toy/a-0123456789abcdef", "2026-01-01")
    assert store.list_outputs("toy") == [first]  # s3fs caches this listing
    second = _commit_by_hand(s3_env, "shared/toy/b-0123456789abcdef", "2026-01-02")
    assert store.list_outputs("toy") == [second, first]
    assert store.is_complete(second)


def test_sync_uploads_in_write_order_and_only_what_changed(s3_env: S3, tmp_path: Path):
    from llmflow.tasks.framework.store import Store

    store = Store(f"s3://{s3_env.bucket}/order", cache_dir=tmp_path / "cache")
    work = tmp_path / "work"
    (work / "ckpt").mkdir(parents=True)
    for i, name in enumerate(["ckpt/zz-data.bin", "ckpt/COMPLETE"]):  # write order != name order
        (work / name).write_text(name)
        os.utime(work / name, ns=(10**18 + i, 10**18 + i))
    uploaded: list[str] = []
    put_file = store.fs.put_file
    store.fs.put_file = lambda lpath, rpath, **kw: (uploaded.append(rpath), put_file(lpath, rpath))
    try:
        store.sync_partial("toy", "t", "abc", work)
        store.sync_partial("toy", "t", "abc", work)  # nothing changed: nothing uploaded
    finally:
        del store.fs.put_file
    assert [u.rsplit("/", 1)[1] for u in uploaded] == ["zz-data.bin", "COMPLETE"]
    assert s3_env.keys("order/toy/.partial/t-abc/") == [
        "order/toy/.partial/t-abc/ckpt/COMPLETE",
        "order/toy/.partial/t-abc/ckpt/zz-data.bin",
    ]


def test_listdir_lists_one_folder_of_a_remote_output(s3_env: S3, tmp_path: Path):
    from llmflow.tasks.framework.store import Store

    store = Store(f"s3://{s3_env.bucket}/listing", cache_dir=tmp_path)
    uri = _commit_by_hand(s3_env, "listing/ingest/q-0123456789abcdef", "2026-01-01")
    for name in ("shard-00001.parquet", "shard-00000.parquet"):
        s3_env.client().put_object(
            Bucket=s3_env.bucket, Key=f"listing/ingest/q-0123456789abcdef/shards/{name}", Body=b"x"
        )
    assert store.listdir(uri, "shards") == ["shard-00000.parquet", "shard-00001.parquet"]
    assert not (tmp_path / "inputs").exists()  # listed remotely, nothing downloaded


def test_a_stage_output_on_s3_is_one_folder_resumed_shard_by_shard(
    s3_env: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A mapped stage on S3: its shards under one output, each with its own marker; a failed
    stage has no marker of its own, and a re-run on another machine (an empty cache) computes
    only the shards without one, reading the committed ones through their markers' manifests."""
    from llmflow.tasks.framework.errors import BadInputError
    from llmflow.tasks.framework.executor import Executor
    from tests.tasks.framework.test_stage_output import FAILING, graph_of

    root = f"s3://{s3_env.bucket}/stages"
    graph, nodes = graph_of(6)
    monkeypatch.setenv("LLMFLOW_CACHE", str(tmp_path / "machine-a"))
    FAILING.add(4)
    try:
        with pytest.raises(BadInputError, match="shard 4 refused"):
            Executor(root).run(graph)
    finally:
        FAILING.clear()
    keys = s3_env.keys("stages/stage-square/")
    (folder,) = {k.split("/")[2] for k in keys if not k.split("/")[2].startswith(".")}
    markers = sorted(k for k in keys if k.endswith("/_COMMITTED"))
    assert markers == [
        f"stages/stage-square/{folder}/shards/part-{i:06d}/_COMMITTED" for i in range(4)
    ]
    assert not any(k.endswith("lineage.json") for k in keys)  # no stage record yet

    monkeypatch.setenv("LLMFLOW_CACHE", str(tmp_path / "machine-b"))
    outcome = Executor(root).run(graph)
    squared = outcome[nodes["squared"]]
    assert squared.uri == f"{root}/stage-square/{folder}"
    assert [r.cached for r in squared.results] == [True] * 4 + [False] * 2
    keys = s3_env.keys(f"stages/stage-square/{folder}/")
    assert [k for k in keys if k.endswith("lineage.json")] == [
        f"stages/stage-square/{folder}/lineage.json"
    ]
    assert f"stages/stage-square/{folder}/_COMMITTED" in keys
    assert sum(k.endswith("/_COMMITTED") for k in keys) == 7  # 6 shards and the stage
    record = json.loads(
        s3_env.client()
        .get_object(Bucket=s3_env.bucket, Key=f"stages/stage-square/{folder}/lineage.json")["Body"]
        .read()
    )
    assert [row["metrics"]["value"] for row in record["shards"]] == [i * i for i in range(6)]
    assert outcome[nodes["total"]].metrics == {"total": sum(i * i + 1 for i in range(6))}
