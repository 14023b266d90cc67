"""Why a trainer run failed, and whether a retry can pass: each rank writes its own report
(``failure_report``), the launcher reads them with the run's exit code and output
(``classify_failure``) and raises ``TrainingRejected`` (never retried) or ``TrainingFailed``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.pretrain.notices import RANKS


class TrainingFailed(RuntimeError):
    """The trainer exited non-zero or ran past its deadline; the message ends with its output.

    ``cause`` says what failed in a few words (``rank 1 was killed by SIGKILL``); a retry may
    pass (see :class:`TrainingRejected` for the failures it cannot).
    """

    def __init__(
        self, message: str, returncode: int | None, tail: list[str], cause: str | None = None
    ) -> None:
        super().__init__(message + "\n--- last lines of output ---\n" + "\n".join(tail))
        self.returncode = returncode
        self.tail = tail
        self.cause = cause or message


class TrainingRejected(TrainingFailed, BadInputError):
    """The trainer failed as it would again: a configuration error, bad input, a full disk or an
    exception before its first step. A ``BadInputError``, so the step never retries it."""


class TrainingPreempted(TrainingFailed):
    """The trainer got SIGTERM, saved a checkpoint and exited: retryable, a retry resumes it.

    Recognised by the trainer's exit code (``PREEMPTED_EXIT_CODE``, 75) or, when a launcher in
    between (torchrun) replaces that code, by the ``preempted`` event in ``checkpoints.jsonl``.
    """


FAILURES = "failures"  # failures/rank-NNNNN.json: why a rank's trainer failed, for the launcher
DISK_FULL_LINE = re.compile(r"\[Errno (28|27|122)\]|no space to write")  # ENOSPC, EFBIG, EDQUOT
# torchrun's summary of a failed rank ("rank : 1 (local_rank: 1)" then "exitcode : -9 (pid...")
TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\b.*\n\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)


@contextlib.contextmanager
def failure_report(out_dir: Path) -> Iterator[None]:
    """Trainer side: an exception leaving the trainer is written to ``failures/rank-NNNNN.json``
    (what it was and whether a retry can pass, :func:`trainer_failure`), then goes on."""
    started = time.time()
    try:
        yield
    except Exception as exc:
        rank = int(os.environ.get("RANK", "0"))
        retry, cause = trainer_failure(exc, _stepped(Path(out_dir), rank, started))
        report = {"rank": rank, "retry": retry, "cause": cause, "error": _one_line(exc)}
        path = Path(out_dir) / FAILURES / f"rank-{rank:05d}.json"
        with contextlib.suppress(OSError):  # a full disk: the launcher reads the output instead
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report))
        raise


def trainer_failure(exc: BaseException, stepped: bool) -> tuple[bool, str]:
    """(whether a retry can pass, what failed) for an exception that ended a trainer process
    (``stepped``: after its first step)."""
    from llmflow.tasks.framework.disk import disk_error
    from llmflow.tasks.framework.errors import ConfigError

    if disk_error(exc) is not None:
        return False, "no space left on the disk (a full disk stays full)"
    if isinstance(exc, ConfigError):
        return False, "a configuration error in the trainer"
    if isinstance(exc, BadInputError):
        return False, "bad input to the trainer"
    if _lost_peer(exc):
        return True, "a lost rank or connection"
    if isinstance(exc, OSError):
        return True, "an I/O error in the trainer"
    if not stepped:
        return False, "an error in the trainer before its first step"
    return True, "an error in the trainer after its first step"


def _lost_peer(exc: BaseException) -> bool:
    """A collective or rendezvous that failed because another rank or the network went away."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(exc, getattr(dist, "DistError", ())):
        return True
    # NOTE: gloo raises a plain RuntimeError when its peer dies ("Connection closed by peer")
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        word in text for word in ("gloo", "nccl", "connection closed", "connection reset")
    )


def _stepped(out_dir: Path, rank: int, started: float) -> bool:
    """Whether this process finished a step: its ``ranks/`` file, written after its first step
    (``RankInfo``), is newer than the process."""
    path = out_dir / RANKS / f"rank-{rank:05d}.json"
    with contextlib.suppress(OSError):
        return path.stat().st_mtime >= started
    return False


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]


def classify_failure(err: TrainingFailed, out_dir: Path) -> TrainingFailed:
    """The error a failed run raises: :class:`TrainingRejected` when a retry fails the same way,
    else a ``TrainingFailed`` naming the cause (a rank killed by a signal wins over what the other
    ranks reported: theirs may follow from it)."""
    if err.returncode is None:  # past the deadline: a resume goes on from its last checkpoint
        return err
    killed = _killed(err.returncode, err.tail)
    if killed is not None:
        return TrainingFailed(
            f"trainer failed, retryable: {killed}", err.returncode, err.tail, killed
        )
    reports = [json.loads(p.read_text()) for p in sorted((Path(out_dir) / FAILURES).glob("*.json"))]
    final = [r for r in reports if not r["retry"]]
    if final or (not reports and DISK_FULL_LINE.search("\n".join(err.tail))):
        report = final[0] if final else {"cause": "no space left on the disk", "rank": None}
        rank = f" (rank {report['rank']})" if report["rank"] is not None else ""
        cause = f"{report['cause']}{rank}" + (f": {report['error']}" if "error" in report else "")
        return TrainingRejected(f"not retried: {cause}", err.returncode, err.tail, cause)
    cause = f"the trainer exited with code {err.returncode}"
    if reports:
        cause = f"{reports[0]['cause']} (rank {reports[0]['rank']}): {reports[0]['error']}"
    return TrainingFailed(f"trainer failed, retryable: {cause}", err.returncode, err.tail, cause)


def _killed(returncode: int, tail: list[str]) -> str | None:
    """Which process a signal killed: the trainer itself, or the rank torchrun names as the root
    cause of its failure; None when none was."""
    if returncode < 0:
        return f"the trainer was killed by {_signal_name(-returncode)}"
    found = TORCHRUN_RANK.findall("\n".join(tail))
    if found:
        rank, code = found[-1]  # NOTE: torchrun lists the root cause last
        if int(code) < 0:
            return f"rank {rank} was killed by {_signal_name(-int(code))}"
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
