"""Start the trainer as its own process and watch it (Prefect-free).

``launch_training()`` is the plain entry point the pretrain step calls: it writes the config into
``out_dir``, builds the command (``accelerate launch``, ``torchrun`` or plain ``python``), streams
every output line to ``on_line``, calls ``on_checkpoint`` for each checkpoint the trainer announces
in ``checkpoints.jsonl`` (a file it polls, never the output), enforces a wall-clock deadline by
killing the process group, and returns the headline metrics the trainer wrote to ``summary.json``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmflow.tasks.pretrain.config import UNVERSIONED, TrainConfig
from llmflow.tasks.pretrain.notices import NOTICES, PREEMPTED_EVENT, PREEMPTED_EXIT_CODE
from llmflow.tasks.pretrain.ray_launch import (
    RayLines,
    RaySettings,
    build_ray_command,
    check_reachable,
)

TRAIN_MODULE = "llmflow.tasks.pretrain.train"


class LaunchSettings(BaseModel):
    """How a trainer run is started: on this machine or on Ray.

    The fields are execution-only: a run on 2 local processes and one on 2 Ray workers give the
    same weights. What they add up to is not: ``micro_batch_size`` is per rank, so the world size
    sets the global batch and the step count of a token budget, and it enters the hash
    (``versioned_extras``; a single-rank run keeps the address it always had).
    """

    model_config = ConfigDict(extra="forbid")

    num_processes: int = Field(
        1, ge=1, description="Processes on this machine.", json_schema_extra=UNVERSIONED
    )
    accelerate_config: str | None = Field(
        None,
        description="accelerate YAML, e.g. deployments/accelerate/multi_gpu_fsdp2.yaml.",
        json_schema_extra=UNVERSIONED,
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="Deadline of each trainer run (the process group is killed).",
        json_schema_extra=UNVERSIONED,
    )
    launcher: Literal["local", "ray"] = Field(
        "local",
        description="local: this machine (torchrun/accelerate); ray: Ray Train workers.",
        json_schema_extra=UNVERSIONED,
    )
    ray: RaySettings = Field(default_factory=RaySettings, json_schema_extra=UNVERSIONED)

    @model_validator(mode="after")
    def _one_world_size(self) -> LaunchSettings:
        """Refuse an accelerate config that would start more ranks than the run counts.

        ``num_processes`` is passed to accelerate, which starts that many: a count other than
        the YAML's is accelerate's documented override (a machine with fewer GPUs, or the ranks
        of every node in all). Left at 1 beside a YAML of several, the user meant the YAML's
        count, and the run would budget its steps and take its address for 1 rank (the YAML's 8
        ranks trained 8x the tokens before the launcher passed the count), so it is refused.
        """
        if self.accelerate_config is None or self.launcher == "ray":
            return self
        launched = accelerate_processes(self.accelerate_config)
        if self.num_processes == 1 and launched is not None and launched > 1:
            raise ValueError(
                f"num_processes is 1 but accelerate_config {self.accelerate_config} launches "
                f"{launched} processes (num_processes: {launched}); set "
                f"pretrain.num_processes={launched} (the world size sets the step count and the "
                "run's address), or use a one-process config such as "
                "deployments/accelerate/single_gpu.yaml"
            )
        return self

    @property
    def world_size(self) -> int:
        """Data-parallel ranks the run trains on, whatever launches them."""
        return self.ray.workers if self.launcher == "ray" else self.num_processes

    def versioned_extras(self) -> dict[str, int]:
        """The world size, for the hash (left out at 1, so single-rank addresses are unchanged)."""
        return {"world_size": self.world_size} if self.world_size != 1 else {}

    def launch_settings(self) -> dict[str, Any]:
        """These settings alone, to start a run with the same launch (``StageRun(**...)``)."""
        return {name: getattr(self, name) for name in LaunchSettings.model_fields}


def accelerate_processes(path: str) -> int | None:
    """The processes an accelerate YAML launches on its own (its ``num_processes``; 1 for a
    ``distributed_type: NO`` without it), or None where it leaves the count to the command line.

    Raises:
        ValueError: no such file (here or shipped with llmflow), or not an accelerate YAML.
    """
    import yaml

    from llmflow.tasks.framework.resources import preset_path

    try:
        data = yaml.safe_load(preset_path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"accelerate_config {path!r} cannot be read: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"accelerate_config {path!r} is not a mapping of accelerate settings")
    count = data.get("num_processes", 1 if data.get("distributed_type") == "NO" else None)
    if count is not None and (not isinstance(count, int) or isinstance(count, bool)):
        raise ValueError(f"accelerate_config {path!r}: num_processes={count!r} is not a count")
    return count if count is None or count > 0 else None  # -1: "pass --num_processes"


class TrainingFailed(RuntimeError):
    """The trainer exited non-zero or ran past its deadline; the message ends with its output."""

    def __init__(self, message: str, returncode: int | None, tail: list[str]) -> None:
        super().__init__(message + "\n--- last lines of output ---\n" + "\n".join(tail))
        self.returncode = returncode
        self.tail = tail


class TrainingPreempted(TrainingFailed):
    """The trainer got SIGTERM, saved a checkpoint and exited: retryable, a retry resumes it.

    Recognised by the trainer's exit code (``PREEMPTED_EXIT_CODE``, 75) or, when a launcher in
    between (torchrun) replaces that code, by the ``preempted`` event in ``checkpoints.jsonl``.
    """


def build_command(
    train_args: list[str],
    *,
    num_processes: int = 1,
    accelerate_config: Path | None = None,
) -> list[str]:
    """Return the argv that runs the trainer.

    Args:
        train_args: Arguments of ``python -m llmflow.tasks.pretrain.train``.
        num_processes: Processes on this machine (torchrun on CPU when > 1 and no config), or
            in all with an accelerate config: always passed to it, so the ranks that start are
            the ones the run's step count and address count, whatever the YAML says.
        accelerate_config: An accelerate YAML (``deployments/accelerate/*.yaml``); wins if set.
    """
    if accelerate_config is not None:
        launcher = [sys.executable, "-m", "accelerate.commands.launch"]
        launcher += ["--config_file", str(accelerate_config)]
        launcher += ["--num_processes", str(num_processes)]
        return launcher + ["-m", TRAIN_MODULE, *train_args]
    if num_processes > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc_per_node", str(num_processes)]
        return launcher + ["-m", TRAIN_MODULE, *train_args]
    return [sys.executable, "-m", TRAIN_MODULE, *train_args]


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


LAUNCHER_PID_ENV = "LLMFLOW_LAUNCHER_PID"
LAUNCHER_HOST_ENV = "LLMFLOW_LAUNCHER_HOST"  # where that PID means something (launcher_host)
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
    num_processes: int = 1,
    accelerate_config: Path | None = None,
    ray: RaySettings | None = None,
    on_line: Callable[[str], Any] = print,
    on_checkpoint: Callable[[dict[str, Any]], Any] = lambda _: None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Train (or resume training) into ``out_dir``; return headline metrics.

    Fails before starting the process when the config does not fit the data or the run
    (vocab size, sequence length, init_from architecture).

    Args:
        ray: Run the trainer on a Ray cluster with these settings instead of on this machine.
        on_checkpoint: Called once per checkpoint the trainer completes, with its notice
            (``{"path", "step", "final"}``), while the trainer runs.

    Returns:
        The trainer's ``summary.json``: final_loss, val_loss, tokens_seen, total_tokens_seen,
        tokens_per_s, steps, ...
    """
    from llmflow.tasks.pretrain.validate import validate_run

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workers = ray.workers if ray is not None else num_processes
    if ray is not None:
        check_reachable(ray.address)
    validate_run(cfg, Path(data_dir), val_dir, init_from, world_size=workers)
    config_path = out_dir / "train_config.json"
    cfg.save(config_path)
    args = train_arguments(config_path, data_dir, out_dir, val_dir, init_from)
    command = (
        build_ray_command(args, ray)
        if ray is not None
        else build_command(args, num_processes=num_processes, accelerate_config=accelerate_config)
    )
    if ray is not None:
        on_line = RayLines(on_line)
    on_line("launching: " + " ".join(command))
    preempted: list[dict[str, Any]] = []

    def on_notice(notice: dict[str, Any]) -> None:
        if notice.get("event") == PREEMPTED_EVENT:
            preempted.append(notice)
        else:
            on_checkpoint(notice)

    try:
        run_streaming(
            command,
            on_line=on_line,
            timeout_s=timeout_s,
            watch=out_dir / NOTICES,
            on_notice=on_notice,
        )
    except TrainingFailed as err:
        if err.returncode != PREEMPTED_EXIT_CODE and not preempted:
            raise
        where = (
            f" at step {preempted[-1]['step']}, checkpoint {preempted[-1]['path']}"
            if preempted
            else ""
        )
        message = (
            f"trainer preempted (SIGTERM){where}; exit code {err.returncode}; "
            "a retry resumes from its latest checkpoint"
        )
        raise TrainingPreempted(message, err.returncode, err.tail) from None
    summary = json.loads((out_dir / "summary.json").read_text())
    if workers > 1 and summary.get("world_size") != workers:
        # NOTE: accelerate's MULTI_CPU launch needs mpirun; on CPU use torchrun (no config).
        on_line(f"warning: asked for {workers} processes, the run used {summary.get('world_size')}")
    return summary
