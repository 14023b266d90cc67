"""A killed worker: the process that launched the trainer is SIGKILLed mid-training.

Nothing runs in a SIGKILLed process, so the trainer must not depend on it to stop: the launcher
asks Linux to SIGKILL its direct child when it dies (``PR_SET_PDEATHSIG``), and each rank waits
on a pidfd of the launcher (torchrun puts its ranks in sessions of their own). Otherwise the
trainer keeps writing into the work dir while a re-run starts there.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.chaos.conftest import tiny_train_config
from tests.integration.servers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="Linux only")]

STEP_LINE = re.compile(r"\bstep \d+ loss ")
LAUNCHER = """
import sys
from pathlib import Path
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.launch import launch_training
cfg = TrainConfig.load(Path(sys.argv[1]))
launch_training(cfg, Path(sys.argv[2]), Path(sys.argv[3]), num_processes=int(sys.argv[4]))
"""


def _trainers(run: Path) -> list[int]:
    """Pids of the live processes (torchrun and ranks, or the trainer) training into ``run``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(run).encode() in argv and b"llmflow.tasks.pretrain.train" in argv and state != "Z":
            found.append(int(entry.name))
    return found


def _start_launcher(cfg, tmp_path: Path, data: Path, num_processes: int, **output):
    """The launcher of ``cfg`` as its own process (as a worker's flow run); (process, run dir)."""
    config_path, run = tmp_path / "train_config.json", tmp_path / "run"
    cfg.save(config_path)
    argv = [str(config_path), str(data), str(run), str(num_processes)]
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *argv],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        **output,
    )
    return launcher, run


@pytest.mark.parametrize("num_processes", [1, 2], ids=["one-process", "torchrun-2-ranks"])
def test_the_trainer_dies_with_its_sigkilled_launcher(
    num_processes: int, tmp_path: Path, chaos_train_data: Path
):
    # a quiet stretch (no line printed: a trainer writing to its dead launcher's pipe fails
    # anyway), as a long step or checkpoint write is in production
    quiet = {"log_interval": 100_000, "checkpoint": {"interval": 100_000}}
    cfg = tiny_train_config(max_steps=100_000, **quiet)
    launcher, run = _start_launcher(
        cfg, tmp_path, chaos_train_data, num_processes,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        expected = num_processes + (num_processes > 1)  # the ranks, and torchrun
        deadline = time.monotonic() + 120
        while len(_trainers(run)) < expected and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(5)  # past start-up: training
        trainers = _trainers(run)
        assert launcher.poll() is None and len(trainers) == expected, trainers
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        killed_at = time.monotonic()
        while _trainers(run) and time.monotonic() - killed_at < 10:
            time.sleep(0.1)
        gone_after = time.monotonic() - killed_at
        assert not _trainers(run), f"still training into {run}: {_trainers(run)}"
        assert gone_after < 5, gone_after
    finally:
        launcher.kill()
        for pid in _trainers(run):  # only when the test failed: the processes it started
            os.kill(pid, signal.SIGKILL)


def _collect(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


@pytest.mark.parametrize("num_processes", [1, 2], ids=["one-process", "torchrun-2-ranks"])
def test_a_sigterm_to_the_launcher_reaches_the_trainer_which_checkpoints_first(
    num_processes: int, tmp_path: Path, chaos_train_data: Path
):
    # Kubernetes sends SIGTERM to a container's first process only; the trainer runs in a
    # session of its own, so before the launcher forwarded it the trainer died by SIGKILL with
    # its launcher: no "SIGTERM received" line, no checkpoint
    from llmflow.tasks.pretrain.checkpoint import latest_checkpoint

    cfg = tiny_train_config(max_steps=100_000, checkpoint={"interval": 100_000}, log_interval=1)
    launcher, run = _start_launcher(
        cfg, tmp_path, chaos_train_data, num_processes,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=_collect, args=(launcher.stdout, lines), daemon=True)
    reader.start()
    try:
        expected = num_processes + (num_processes > 1)  # the ranks, and torchrun
        deadline = time.monotonic() + 180
        # training, not starting up (a rank without its SIGTERM handler yet would just die)
        while not any(STEP_LINE.search(line) for line in list(lines)):
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        assert len(_trainers(run)) == expected
        launcher.send_signal(signal.SIGTERM)  # the launcher only, as Kubernetes does
        launcher.wait(timeout=cfg.checkpoint.preempt_grace_s + 30)
        reader.join(10)
        output = "".join(lines)
        assert launcher.returncode == -signal.SIGTERM, output[-3000:]  # then it ended as asked
        assert "SIGTERM received" in output, output[-3000:]
        saved = latest_checkpoint(run)
        assert saved is not None and int(saved.name.split("-")[-1]) > 0, output[-3000:]
        assert not _trainers(run)
    finally:
        launcher.kill()
        for pid in _trainers(run):  # only when the test failed: the processes it started
            os.kill(pid, signal.SIGKILL)
