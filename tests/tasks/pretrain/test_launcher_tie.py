"""A trainer rank's life is tied to its launcher only where the launcher's PID means something:
on the launcher's own host (and PID namespace). A Ray rank, which may run on any node, lives as
long as its Ray actor and is never handed the launcher's PID."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_trainer, tiny_config

from llmflow.tasks.pretrain.launch import LAUNCHER_PID_ENV, train_arguments
from llmflow.tasks.pretrain.ray_launch import RaySettings, build_ray_command

# A rank that checks its launcher, then lives 2 s more unless it was killed.
RANK = (
    "import time\n"
    "from llmflow.tasks.pretrain.launch import die_with_launcher\n"
    "die_with_launcher()\n"
    "time.sleep(2)\n"
    "print('alive', flush=True)\n"
)


def reaped_pid() -> int:
    """The PID of a process that has exited and been reaped: no such process on this host."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def run_rank(env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("LLMFLOW_LAUNCHER")}
    return subprocess.run(
        [sys.executable, "-c", RANK], env={**full, **env}, capture_output=True, text=True
    )


def test_a_launcher_pid_from_another_host_does_not_kill_the_rank():
    # The PID does not exist here: before, the rank SIGKILLed itself at once.
    foreign = {"LLMFLOW_LAUNCHER_PID": str(reaped_pid()), "LLMFLOW_LAUNCHER_HOST": "other-boot/1"}
    proc = run_rank(foreign)
    assert proc.returncode == 0, proc
    assert proc.stdout == "alive\n"
    # The PID exists here but is some unrelated process: its exit must not kill the rank either
    # (before, the rank watched it and died with it, 0.5 s in).
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        proc = run_rank({**foreign, "LLMFLOW_LAUNCHER_PID": str(unrelated.pid)})
    finally:
        unrelated.wait()
    assert proc.returncode == 0, proc
    assert proc.stdout == "alive\n"


def test_a_launcher_gone_on_this_host_still_kills_the_rank():
    from llmflow.tasks.pretrain.launch import LAUNCHER_HOST_ENV, launcher_host

    assert launcher_host()  # this host (Linux, /proc) has an identity to record
    proc = run_rank({LAUNCHER_PID_ENV: str(reaped_pid()), LAUNCHER_HOST_ENV: launcher_host()})
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout == ""


def test_run_streaming_records_the_launcher_host_beside_its_pid():
    from llmflow.tasks.pretrain.launch import LAUNCHER_HOST_ENV, launcher_host, run_streaming

    lines: list[str] = []
    code = f"import os; print(os.environ[{LAUNCHER_PID_ENV!r}], os.environ[{LAUNCHER_HOST_ENV!r}])"
    run_streaming([sys.executable, "-c", code], on_line=lines.append)
    assert lines == [f"{os.getpid()} {launcher_host()}"]


def test_ray_ranks_get_the_run_settings_but_no_launcher_pid():
    from llmflow.tasks.pretrain.ray_launch import worker_env

    environ = {
        "LLMFLOW_CACHE": "/c",
        "LLMFLOW_FAULTS": "{}",
        "LLMFLOW_LAUNCHER_PID": "4242",
        "LLMFLOW_LAUNCHER_HOST": "boot/1",
        "HOME": "/home/x",
    }
    assert worker_env(environ) == {"LLMFLOW_CACHE": "/c", "LLMFLOW_FAULTS": "{}"}


@pytest.fixture(scope="module")
def small_ray_head(tmp_path_factory):
    """A Ray head on 127.0.0.1 with 2 logical CPUs (one worker and Ray Train's controller)."""
    from test_ray_launch import RAY, RAY_ENV, free_port, stop_group, wait_for_port

    port = free_port()
    env = {**os.environ, **RAY_ENV, "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env = {k: v for k, v in env.items() if not k.startswith("LLMFLOW_LAUNCHER")}
    temp = tmp_path_factory.mktemp("ray")
    start = [str(RAY), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}"]
    start += ["--num-cpus=2", "--include-dashboard=false", f"--temp-dir={temp}", "--block"]
    log = open(temp / "head.log", "w")  # noqa: SIM115 (closed with the head)
    head = subprocess.Popen(
        start, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    try:
        wait_for_port(port, head, timeout_s=180)
        yield f"127.0.0.1:{port}", env
    finally:
        stop_group(head)
        log.close()


@pytest.mark.slow
@pytest.mark.integration
def test_a_ray_rank_lives_whatever_launcher_pid_its_driver_has(
    tmp_path, train_data, small_ray_head
):
    """The driver's LLMFLOW_LAUNCHER_PID names no process on the rank's node (as a launcher on
    another machine would): the rank trains to the end, the same weights as a plain process."""
    address, env = small_ray_head
    cfg = tiny_config(max_steps=4, eval_interval=100)
    out = tmp_path / "ray"
    out.mkdir()
    cfg.save(out / "train_config.json")
    args = train_arguments(out / "train_config.json", train_data, out)
    settings = RaySettings(address=address, workers=1, max_failures=0)
    driver_env = {**env, LAUNCHER_PID_ENV: str(reaped_pid()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        build_ray_command(args, settings),
        env=driver_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reference = tmp_path / "plain"
    run_trainer(cfg, train_data, reference)
    from safetensors.torch import load_file

    expected = load_file(reference / "final" / "model.safetensors")
    got = load_file(Path(out) / "final" / "model.safetensors")
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert (got[name] - tensor).abs().max().item() <= 1e-6, name
