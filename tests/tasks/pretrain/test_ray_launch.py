"""The trainer on a real local Ray cluster (``ray start --head`` on 127.0.0.1): the same weights
as torchrun's two processes, and a killed worker resumed from the last checkpoint."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import run_trainer, tiny_config

from llmflow.tasks.framework.ray_cluster import RayClusterUnreachable
from llmflow.tasks.pretrain.launch import launch_training
from llmflow.tasks.pretrain.ray_launch import RaySettings

RAY = Path(sys.executable).with_name("ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_cluster_fails_in_seconds_naming_it(tmp_path, train_data):
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(RayClusterUnreachable, match=address):
        launch_training(tiny_config(), train_data, tmp_path, ray=RaySettings(address=address))
    assert time.monotonic() - start < 10
    assert not (tmp_path / "train_config.json").exists()  # nothing launched


# NOTE: on Linux Ray binds the node's network address even when told 127.0.0.1, unless told it
# is a single-machine cluster; and a head on a network address requires token authentication.
# The test's cluster is loopback-only and uses a fresh token, as a user's would.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "token",
}


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head on 127.0.0.1 with 4 logical CPUs (2 workers + Ray Train's controller)."""
    port = free_port()
    env = {**RAY_ENV, "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the launcher's driver process inherits them
    temp = tmp_path_factory.mktemp("ray")
    start = [str(RAY), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}"]
    start += ["--num-cpus=4", "--include-dashboard=false", f"--temp-dir={temp}", "--block"]
    # --block keeps the head in the foreground: stopping its process group stops this cluster
    # only (`ray stop` would stop every Ray cluster on the machine).
    log = open(temp / "head.log", "w")  # noqa: SIM115 (closed with the head)
    head = subprocess.Popen(start, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port(port, head, timeout_s=180)
        yield f"127.0.0.1:{port}"
    finally:
        stop_group(head)
        log.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def wait_for_port(port: int, head: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}")
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            time.sleep(2)  # the GCS answers before the raylet has registered
            return
        time.sleep(0.5)
    raise TimeoutError(f"no Ray head on 127.0.0.1:{port} after {timeout_s}s")


def stop_group(head: subprocess.Popen) -> None:
    # NOTE: a `ray start --block` head ignored SIGTERM for the whole 30 s it was once given
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=wait)
            return


def final_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


def kill_one_worker_after_first_checkpoint(notices: list, killed: list) -> None:
    """SIGKILL one Ray Train worker once a checkpoint exists (a machine lost mid-run)."""
    deadline = time.monotonic() + 600
    while not notices and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "RayTrainWorker" in " ".join(p.info["cmdline"] or [])
    ]
    if workers and not notices[0].get("final"):
        os.kill(workers[-1].pid, signal.SIGKILL)
        killed.append(workers[-1].pid)


@pytest.mark.slow
@pytest.mark.integration
def test_ray_workers_match_torchrun_and_resume_after_a_killed_worker(
    tmp_path, train_data, ray_head
):
    cfg = tiny_config(
        batch={"micro_batch_size": 2}, max_steps=40, checkpoint={"interval": 4, "keep_last": 2}
    )
    lines, notices, killed = [], [], []
    killer = threading.Thread(
        target=kill_one_worker_after_first_checkpoint, args=(notices, killed), daemon=True
    )
    killer.start()
    summary = launch_training(
        cfg,
        train_data,
        tmp_path / "ray",
        ray=RaySettings(address=ray_head, workers=2, max_failures=1),
        on_line=lines.append,
        on_checkpoint=notices.append,
        timeout_s=900,
    )
    killer.join(timeout=5)
    reference = tmp_path / "torchrun"
    run_trainer(cfg, train_data, reference, num_processes=2)
    assert killed, "the run ended before a worker could be killed"
    assert summary["world_size"] == 2 and summary["steps"] == 40
    assert any("resumed from" in line for line in lines)
    expected, got = final_weights(reference), final_weights(tmp_path / "ray")
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert (got[name] - tensor).abs().max().item() <= 1e-5, name


def test_kuberay_manifest_is_a_raycluster_with_a_gpu_worker_group():
    import string

    import yaml

    from llmflow.tasks.framework.resources import data_dir

    text = (data_dir("deployments") / "kubernetes" / "kuberay-cluster.yaml").read_text()
    values = {"NUM_NODES": "4", "GPUS_PER_NODE": "8", "IMAGE": "llmflow:gpu", "PVC": "shared"}
    cluster = yaml.safe_load(string.Template(text).substitute(values))
    assert cluster["kind"] == "RayCluster"
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["replicas"] == 4
    (worker,) = group["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert worker["workingDir"] == "/opt/llmflow"
    mounts = {m["mountPath"] for m in worker["volumeMounts"]}
    assert "/shared" in mounts
