"""Start the trainer as its own process and watch it (Prefect-free).

``launch_training()`` is the plain entry point the pretrain step calls: it writes the config into
``out_dir``, runs the command of its :class:`~.launchers.Launcher` (plain ``python``, ``torchrun``,
``accelerate launch``, Ray's driver), streams every output line to ``on_line``, calls
``on_checkpoint`` for each checkpoint the trainer announces in ``checkpoints.jsonl`` (a file it
polls, never the output), enforces a wall-clock deadline by killing the process group, and returns
the headline metrics the trainer wrote to ``summary.json``. Every launcher gets the same contract
(docs/ARCHITECTURE.md, "The launcher–trainer contract").

A failed run is retried only when a retry can pass: a rank killed by a signal (a lost node), a
preemption, an I/O error. A configuration error, bad input, a full disk or any exception before
the trainer's first step fails the same way again: each rank writes why it failed to
``failures/rank-NNNNN.json`` (:func:`failure_report`), and the launcher raises
:class:`TrainingRejected`, a ``BadInputError`` (never retried).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.launch_failures import (  # noqa: F401 (part of this module's API)
    DISK_FULL_LINE,
    FAILURES,
    TORCHRUN_RANK,
    TrainingFailed,
    TrainingPreempted,
    TrainingRejected,
    _killed,
    _lost_peer,
    _one_line,
    _signal_name,
    _stepped,
    classify_failure,
    failure_report,
    trainer_failure,
)
from llmflow.tasks.pretrain.launchers import (  # noqa: F401 (LaunchSettings: the steps' import)
    Launcher,
    LaunchSettings,
    keyword_launcher,
    local_launcher,
)
from llmflow.tasks.pretrain.notices import (
    CONFIG_FILE,
    LAUNCHER_HOST_ENV,
    LAUNCHER_PID_ENV,
    NOTICES,
    PREEMPTED_EVENT,
    PREEMPTED_EXIT_CODE,
    SUMMARY,
    TRAIN_MODULE,  # noqa: F401 (kept importable from here)
)
from llmflow.tasks.pretrain.ray_launch import RaySettings


class NoticeWatcher:
    """Reads the lines appended to a JSON-lines file since it was created (or since start)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def poll(self) -> list[dict[str, Any]]:
        """The complete lines appended since the last poll, parsed."""
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


def run_streaming(
    command: list[str],
    *,
    on_line: Callable[[str], Any] = print,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    tail_lines: int = 50,
    watch: Path | None = None,
    on_notice: Callable[[dict[str, Any]], Any] = lambda _: None,
) -> list[str]:
    """Run ``command``, stream lines, enforce the deadline; return the tail.

    Args:
        command: The argv to run (in its own process group).
        on_line: Called with each output line (stdout and stderr merged).
        timeout_s: Wall-clock deadline; past it the process group is killed.
        env: Variables added to this process's environment.
        tail_lines: How many last lines to keep for the error message and the return value.
        watch: A JSON-lines file the process appends to; polled about once a second.
        on_notice: Called with each line appended to ``watch`` while the process runs.

    Raises:
        TrainingFailed: on a non-zero exit or when ``timeout_s`` passes (process group killed).
    """
    full_env = {"PYTHONUNBUFFERED": "1", **os.environ, **(env or {})}
    # The trainer's ranks on this host die with this process (die_with_launcher).
    full_env[LAUNCHER_PID_ENV] = str(os.getpid())
    full_env[LAUNCHER_HOST_ENV] = launcher_host()
    watcher = NoticeWatcher(watch) if watch is not None else None
    proc = subprocess.Popen(
        command,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,  # NOTE: own process group, so a kill reaches torchrun's children
        preexec_fn=_die_with_parent(),
    )
    received: list[int] = []
    try:
        with _forward_sigterm(proc) as received:
            return _follow(proc, on_line, timeout_s, tail_lines, watcher, on_notice)
    finally:
        if received:  # the trainer has stopped: this process goes on terminating, as asked
            signal.raise_signal(signal.SIGTERM)


@contextlib.contextmanager
def _forward_sigterm(proc: subprocess.Popen) -> Iterator[list[int]]:
    """While ``proc`` runs, a SIGTERM to this process goes to the trainer's process group.

    Kubernetes sends SIGTERM to a container's first process only, and the trainer runs in a
    session of its own: without this, the trainer never heard of the eviction, and died by
    SIGKILL with its launcher (no checkpoint). Now it saves one within its grace period and exits
    with code 75; after that, the signal is delivered again to this process's previous handler
    (Prefect's: the run is marked crashed; the default: the process ends). Python handles
    signals in the main thread only: a trainer launched from another thread is not covered.
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def _follow(
    proc: subprocess.Popen,
    on_line: Callable[[str], Any],
    timeout_s: float | None,
    tail_lines: int,
    watcher: NoticeWatcher | None,
    on_notice: Callable[[dict[str, Any]], Any],
) -> list[str]:
    """Stream ``proc``'s lines and notices until it exits; its tail, or TrainingFailed."""
    lines: queue.Queue[str | object] = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    for line in _lines(lines, None if timeout_s is None else time.monotonic() + timeout_s):
        for notice in watcher.poll() if watcher is not None else []:
            on_notice(notice)
        if line is _DEADLINE:
            _kill_group(proc)
            message = f"trainer exceeded its deadline of {timeout_s}s; killed"
            raise TrainingFailed(message, None, list(tail))
        if line is not None:
            tail.append(line)
            on_line(line)
    returncode = proc.wait()
    for notice in watcher.poll() if watcher is not None else []:
        on_notice(notice)
    if returncode != 0:
        raise TrainingFailed(f"trainer exited with code {returncode}", returncode, list(tail))
    return list(tail)


PR_SET_PDEATHSIG = 1


def launcher_host() -> str:
    """This process's host and PID namespace (``BOOT_ID/pid:[INODE]``); "" where unknown.

    A PID names a process only inside one PID namespace of one boot of one machine: the launcher
    records this beside its PID, and a rank elsewhere (another node, another container) leaves
    that PID alone.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGKILL the child when its launcher dies.

    A killed worker (SIGKILL, nothing runs) would otherwise leave the trainer writing into the
    work dir while a re-run starts there. The kernel sends the signal when the *thread* that
    started the child ends; ``run_streaming`` waits for the child in that thread. libc's prctl is
    looked up here, before the fork, so the child only calls it.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before the request took effect
            os._exit(1)

    return preexec


def die_with_launcher() -> None:
    """Trainer side: SIGKILL this process as soon as its launcher (``run_streaming``) is gone.

    torchrun starts each rank in a session of its own, so a SIGKILLed torchrun (killed with its
    launcher, above) leaves its ranks running; each rank waits on a pidfd of the launcher (Linux
    5.3+) in a daemon thread instead. No-op when not started by ``run_streaming``, and when the
    launcher's PID comes from another host or PID namespace (``LAUNCHER_HOST_ENV`` differs): there
    it names no process, or an unrelated one. A Ray rank is never given it: its life is its
    actor's (``ray_launch``).
    """
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if not pid or not hasattr(os, "pidfd_open"):
        return
    here = launcher_host()
    if not here or os.environ.get(LAUNCHER_HOST_ENV) != here:
        return
    try:
        fd = os.pidfd_open(int(pid))
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    except OSError:  # an old kernel: nothing to wait on
        return

    def wait() -> None:
        select.select([fd], [], [])  # readable once the launcher has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="die-with-launcher", daemon=True).start()


def _lines(lines: queue.Queue, deadline: float | None) -> Iterator[str | object | None]:
    """Output lines until the end; None about once a second of silence; _DEADLINE, then stop."""
    while True:
        wait = 1.0 if deadline is None else min(deadline - time.monotonic(), 1.0)
        if wait <= 0:
            yield _DEADLINE
            return
        try:
            line = lines.get(timeout=wait)
        except queue.Empty:
            yield None
            continue
        if line is _END:
            return
        yield line


_END, _DEADLINE = object(), object()


def _pump(stream: Any, lines: queue.Queue) -> None:
    for raw in stream:
        lines.put(raw.rstrip("\r\n"))
    lines.put(_END)


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def train_arguments(
    config_path: Path,
    data_dir: Path,
    out_dir: Path,
    val_dir: Path | None = None,
    init_from: Path | None = None,
) -> list[str]:
    """Return the CLI arguments of ``tasks.pretrain.train``."""
    args = ["--config", str(config_path), "--data-dir", str(data_dir), "--out-dir", str(out_dir)]
    if val_dir is not None:
        args += ["--val-dir", str(val_dir)]
    if init_from is not None:
        args += ["--init-from", str(init_from)]
    return args


def launch_training(
    cfg: TrainConfig,
    data_dir: Path,
    out_dir: Path,
    *,
    val_dir: Path | None = None,
    init_from: Path | None = None,
    launcher: Launcher | None = None,
    num_processes: int = 1,
    accelerate_config: Path | None = None,
    ray: RaySettings | None = None,
    on_line: Callable[[str], Any] = print,
    on_checkpoint: Callable[[dict[str, Any]], Any] = lambda _: None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Train (or resume training) into ``out_dir``; return headline metrics.

    Fails before starting the process when the launcher cannot start (an unreachable Ray head)
    or the config does not fit the data or the run (vocab size, sequence length, init_from
    architecture). The launcher's side of the contract is docs/ARCHITECTURE.md's.

    Args:
        launcher: What starts the ranks (``LaunchSettings.build_launcher()``). Without it, the
            keyword form: ``ray`` (Ray Train workers), else ``num_processes`` and
            ``accelerate_config`` on this machine.
        on_checkpoint: Called once per checkpoint the trainer completes, with its notice
            (``{"path", "step", "final"}``), while the trainer runs.

    Returns:
        The trainer's ``summary.json``: final_loss, val_loss, tokens_seen, total_tokens_seen,
        tokens_per_s, steps, ...

    Raises:
        TrainingPreempted: the trainer checkpointed on SIGTERM and exited (75): retry.
        TrainingRejected: a failure a retry repeats (a config error, bad input, a full disk, an
            exception before the first step): a ``BadInputError``, never retried.
        TrainingFailed: any other non-zero exit (a rank killed by a signal), or the deadline.
    """
    from llmflow.tasks.pretrain.validate import validate_run

    if launcher is None:
        launcher = keyword_launcher(num_processes, accelerate_config, ray)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    launcher.check()
    validate_run(cfg, Path(data_dir), val_dir, init_from, world_size=launcher.workers)
    config_path = out_dir / CONFIG_FILE
    cfg.save(config_path)
    shutil.rmtree(out_dir / FAILURES, ignore_errors=True)  # a previous attempt's
    command = launcher.command(train_arguments(config_path, data_dir, out_dir, val_dir, init_from))
    on_line = launcher.printer(on_line)
    on_line("launching: " + " ".join(command))
    _watch(command, out_dir, on_line, on_checkpoint, timeout_s)
    summary = json.loads((out_dir / SUMMARY).read_text())
    if launcher.workers > 1 and summary.get("world_size") != launcher.workers:
        # NOTE: accelerate's MULTI_CPU launch needs mpirun; on CPU use torchrun (no config).
        used = summary.get("world_size")
        on_line(f"warning: asked for {launcher.workers} processes, the run used {used}")
    return summary


def _watch(
    command: list[str],
    out_dir: Path,
    on_line: Callable[[str], Any],
    on_checkpoint: Callable[[dict[str, Any]], Any],
    timeout_s: float | None,
) -> None:
    """Run the launcher's command to its end; TrainingPreempted on code 75 or its event."""
    preempted: list[dict[str, Any]] = []

    def on_notice(notice: dict[str, Any]) -> None:
        if notice.get("event") == PREEMPTED_EVENT:
            preempted.append(notice)
        else:
            on_checkpoint(notice)

    try:
        run_streaming(
            command, on_line=on_line, timeout_s=timeout_s, watch=out_dir / NOTICES,
            on_notice=on_notice,
        )  # fmt: skip
    except TrainingFailed as err:
        # NOTE: torchrun (and Ray's driver) replace the ranks' code 75: the event tells instead.
        if err.returncode != PREEMPTED_EXIT_CODE and not preempted:
            raise classify_failure(err, out_dir) from None
        last = preempted[-1] if preempted else None
        where = f" at step {last['step']}, checkpoint {last['path']}" if last else ""
        message = (
            f"trainer preempted (SIGTERM){where}; exit code {err.returncode}; "
            "a retry resumes from its latest checkpoint"
        )
        raise TrainingPreempted(message, err.returncode, err.tail) from None
