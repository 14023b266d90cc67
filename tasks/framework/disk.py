"""A full disk, said plainly: the ENOSPC/EFBIG/EDQUOT error in an exception's chain
(``disk_error``), and a message naming the file, how far it got and the limit it hit
(``no_space_message``)."""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
from pathlib import Path


class NoSpaceError(OSError):
    """A write failed for lack of space (ENOSPC) or over the file size limit (EFBIG).

    Its message names the file being written, how far it got and the limit it hit; nothing that
    looks complete is left, and a re-run once space is freed starts again in the same place.
    """

    def __str__(self) -> str:
        return str(self.strerror)


DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def disk_error(exc: BaseException | None) -> OSError | None:
    """The ENOSPC/EFBIG/EDQUOT error in an exception's chain (also inside DCP's wrappers)."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL:
            return current
        short = SHORT_WRITE.search(str(current)) if isinstance(current, OSError) else None
        if short and current.errno is None:  # numpy's tofile: the C errno is lost
            return _short_write_error(current, int(short.group(1)))
        failures = getattr(current, "failures", None)  # DCP's CheckpointException
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        stack += [current.__cause__, current.__context__]
    return None


SHORT_WRITE = re.compile(r"(\d+) requested and (\d+) written")


def _short_write_error(err: OSError, requested: int) -> OSError:
    """A short write's likely cause: over the file size limit if one is set, else no space."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    code = errno.EFBIG if limit != resource.RLIM_INFINITY else errno.ENOSPC
    inferred = OSError(code, f"{os.strerror(code)} (a short write: {err})")
    inferred.requested = requested  # type: ignore[attr-defined]
    return inferred


def no_space_message(err: OSError, folder: Path, what: str, needed: int | None = None) -> str:
    """Say which file under ``folder`` was being written, how far it got, and what limit hit."""
    folder = Path(folder)
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    target = Path(err.filename) if err.filename else None
    if target is None and files:  # NOTE: a failed write() names no file: take the newest one
        target = max(files, key=lambda p: p.stat().st_mtime_ns)
    written = sum(p.stat().st_size for p in files)
    parts = [f"no space to write {what}: [Errno {err.errno}] {err.strerror}"]
    if target is not None:
        size = target.stat().st_size if target.exists() else 0
        parts.append(f"writing {target} failed at {size:,} bytes")
    needed = needed if needed is not None else getattr(err, "requested", None)
    if needed is not None:
        parts.append(f"it needs {needed:,} bytes")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if err.errno == errno.EFBIG and limit != resource.RLIM_INFINITY:
        parts.append(f"the file size limit (RLIMIT_FSIZE) is {limit:,} bytes per file")
    probe = folder if folder.exists() else folder.parent
    if probe.exists():
        parts.append(f"{shutil.disk_usage(probe).free:,} bytes free on {probe}")
    parts.append(f"{written:,} bytes written to {folder}")
    return "; ".join(parts) + ". Free space (or lift the limit) and re-run: nothing was committed"
