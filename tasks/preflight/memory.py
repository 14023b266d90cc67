"""Memory as preflight measures it: the peak RSS of the trainer's ranks sampled from /proc, the
memory one rank may use on this host, and the output that says a rank ran out of it."""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.pretrain.notices import TRAIN_MODULE

MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2"}
"""glibc malloc settings of the test steps: every tensor over 64 KiB is its own mapping, returned
to the system when freed, so peak RSS measures the live tensors rather than freed memory the
allocator kept (without it, two identical CPU runs differ by 25% in peak RSS)."""

OUT_OF_MEMORY = [
    (re.compile(r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)"), "a rank was killed by signal 9 (the OOM killer)"),
    (re.compile(r"CUDA out of memory|OutOfMemoryError"), "CUDA out of memory"),
    (re.compile(r"can't allocate memory|Cannot allocate memory|std::bad_alloc|MemoryError"),
     "an allocation was refused (out of memory)"),
]  # fmt: skip
"""Output that means a rank ran out of memory, and how to say it."""


class RankMemory:
    """Samples the peak RSS (``VmHWM``) of the trainer processes this process started: those
    whose command line names the module every launcher starts (``TRAIN_MODULE``)."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s, self.peaks = interval_s, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RankMemory:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def peak_gb(self) -> float:
        """The largest peak RSS of one trainer process so far, GB."""
        return max(self.peaks.values(), default=0) / 1e9

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        for pid in descendants(os.getpid()):
            try:
                if TRAIN_MODULE not in Path(f"/proc/{pid}/cmdline").read_text():
                    continue
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:  # it exited meanwhile
                continue
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    self.peaks[pid] = max(self.peaks.get(pid, 0), int(line.split()[1]) * 1024)


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@contextlib.contextmanager
def environment(values: dict[str, str | None]) -> Iterator[None]:
    """Set (or, for None, unset) environment variables for the duration of the block."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def host_memory_per_rank_gb(ranks: int) -> tuple[float, str]:
    """Memory one rank may use here, GB, and where it comes from: a GPU's free memory, or the
    host's available memory (within its cgroup's limit) shared by the ranks."""
    import torch

    if torch.cuda.is_available():
        count = min(ranks, torch.cuda.device_count())
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(count)) / 1e9
        return free, f"{free:.1f} GB free per GPU"
    available = meminfo_bytes("MemAvailable")
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):  # fmt: skip
        with contextlib.suppress(OSError, ValueError):
            room = int(Path(limit).read_text()) - int(Path(usage).read_text())
            available = min(available, max(room, 0))
    per_rank = available / ranks / 1e9
    return per_rank, f"{available / 1e9:.1f} GB available / {ranks} ranks = {per_rank:.1f} GB"


def meminfo_bytes(key: str) -> int:
    """A field of /proc/meminfo, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise BadInputError(f"/proc/meminfo has no {key}")


def out_of_memory(returncode: int | None, tail: list[str]) -> str | None:
    """Why the trainer ran out of memory, from its exit code and last lines; None if it did not."""
    if returncode == -9:
        return "the trainer was killed by signal 9 (the OOM killer)"
    text = "\n".join(tail)
    return next((reason for pattern, reason in OUT_OF_MEMORY if pattern.search(text)), None)
