"""Local-disk faults: a per-process file size limit (EFBIG) and a small loop-mounted file system
(ENOSPC).

``RLIMIT_FSIZE`` is what ``prlimit --fsize`` sets: a write past it fails with EFBIG (Python
ignores SIGXFSZ, so the write raises instead of the process dying). A loop-mounted ext4 image
needs root and a free loop device; where the machine does not allow it, the test that needs it
skips and says why.
"""

from __future__ import annotations

import contextlib
import resource
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def file_size_limit(num_bytes: int) -> Callable[[], None]:
    """A ``preexec_fn`` capping every file the child process writes at ``num_bytes``."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, num_bytes))

    return limit


@contextlib.contextmanager
def small_filesystem(where: Path, size_mb: int = 8) -> Iterator[Path]:
    """A fresh ext4 file system of ``size_mb`` MiB mounted at ``where`` (skips when impossible)."""
    image, mount = Path(where) / "disk.img", Path(where) / "mnt"
    mount.mkdir(parents=True)
    mkfs, mounter = shutil.which("mkfs.ext4"), shutil.which("mount")
    if mkfs is None or mounter is None:
        pytest.skip("no mkfs.ext4 or mount on this machine: ENOSPC not injected")
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    made = subprocess.run([mkfs, "-q", "-F", "-m", "0", str(image)], capture_output=True, text=True)
    mounted = subprocess.run(
        [mounter, "-o", "loop", str(image), str(mount)], capture_output=True, text=True
    )
    if made.returncode != 0 or mounted.returncode != 0:
        reason = (made.stderr or mounted.stderr).strip().splitlines()[-1:]
        pytest.skip(f"cannot loop-mount a small file system here (needs root): {reason}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=60)


def fill(folder: Path, leave_free: int) -> Path:
    """Write a filler file so that about ``leave_free`` bytes stay free on ``folder``'s disk."""
    filler = Path(folder) / "filler.bin"
    free = shutil.disk_usage(folder).free
    with open(filler, "wb") as f:
        f.truncate(0)
        block = b"\0" * (1 << 20)
        remaining = max(free - leave_free, 0)
        while remaining > 0:
            remaining -= f.write(block[: min(remaining, len(block))])
    return filler
