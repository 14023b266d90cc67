"""MLflow against a real ``mlflow server`` on 127.0.0.1, and W&B offline run folders: metrics,
parameters, the config and the data's lineage land there, and a resumed run keeps its run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import read_jsonl, run_trainer, tiny_config

MLFLOW = Path(sys.executable).with_name("mlflow")
WANDB = Path(sys.executable).with_name("wandb")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    command = [str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--backend-store-uri", f"sqlite:///{root}/mlflow.db"]
    command += ["--artifacts-destination", str(root / "artifacts"), "--workers", "1"]
    log = open(root / "server.log", "w")  # noqa: SIM115 (closed with the server)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, (root / "server.log").read_text()[-2000:]
                time.sleep(0.5)
        else:
            raise TimeoutError(f"mlflow server did not answer at {url}")
        yield url
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=30)
                break
        log.close()


@pytest.fixture
def data_with_lineage(train_data, tmp_path) -> Path:
    """The packed data with a lineage record, as a store output has."""
    data = tmp_path / "data"
    shutil.copytree(train_data, data)
    record = {"step": "mixture", "hash": "abc123", "inputs": {"tokenized": "tokenize-def456"}}
    (data / "lineage.json").write_text(json.dumps(record))
    return data


@pytest.mark.slow
@pytest.mark.integration
def test_mlflow_server_receives_metrics_params_config_and_lineage(
    tmp_path, data_with_lineage, mlflow_server
):
    from mlflow.tracking import MlflowClient

    tracker = {"tensorboard": False, "others": ["mlflow"], "project": "llmflow-test"}
    cfg = tiny_config(tracker={**tracker, "mlflow_tracking_uri": mlflow_server})
    out = tmp_path / "run"
    crashed = run_trainer(
        cfg, data_with_lineage, out, check=False, faults={"crash_after_step": 6}, timeout=900
    )
    assert crashed.returncode != 0
    run_trainer(cfg, data_with_lineage, out, timeout=900)  # resumes from step 4's checkpoint

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("llmflow-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the resumed attempt logged into the same run
    run = runs[0]
    assert run.data.params["optimizer.lr"] == str(cfg.optimizer.lr)
    assert run.data.params["model.overrides.hidden_size"] == "32"
    assert run.data.tags["llmflow.output"] == "run"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    logged = {row["step"]: row["loss"] for row in read_jsonl(out / "metrics.jsonl")}
    assert set(history) == set(range(1, 13)) and history == pytest.approx(logged)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"train_config.json", "data_lineage.json", "summary.json"} <= artifacts
    lineage = json.loads(
        Path(
            client.download_artifacts(run.info.run_id, "data_lineage.json", str(tmp_path))
        ).read_text()
    )
    assert lineage == json.loads((data_with_lineage / "lineage.json").read_text())
    summary = json.loads(
        Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))).read_text()
    )
    assert summary["final_loss"] == json.loads((out / "summary.json").read_text())["final_loss"]


@pytest.mark.slow
def test_wandb_offline_run_folder_holds_the_metrics(tmp_path, data_with_lineage, monkeypatch):
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = {"tensorboard": False, "others": ["wandb"], "wandb_mode": "offline"}
    out = tmp_path / "run"
    run_trainer(tiny_config(tracker=tracker), data_with_lineage, out, timeout=900)
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    files = list(runs[0].glob("run-*.wandb"))
    assert len(files) == 1
    history = {}
    config = {}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            if "loss" in items:
                history[items["_step"]] = items["loss"]
        elif kind in ("config", "run"):  # wandb.init's config rides on the run record
            update = record.config.update if kind == "config" else record.run.config.update
            config.update({i.key: json.loads(i.value_json) for i in update})
    logged = {row["step"]: row["loss"] for row in read_jsonl(out / "metrics.jsonl")}
    assert history == pytest.approx(logged)
    assert config["data_lineage"] == json.loads((data_with_lineage / "lineage.json").read_text())
    assert config["optimizer"]["lr"] == 3e-3


def wandb_records(path: Path):
    """The records of a ``.wandb`` transaction log, parsed with W&B's own protobuf schema: a
    7-byte header (``:W&B``, magic, version), then LevelDB-log blocks of 32 KiB whose records
    are (crc32, length, type) + bytes; FULL or FIRST..LAST pieces make one ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    position, pieces = 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # the rest of a block is padding
            position += block - position % block
            continue
        length = int.from_bytes(data[position + 4 : position + 6], "little")
        kind = data[position + 6]
        pieces += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record
            pieces = b""
