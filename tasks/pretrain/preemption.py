"""Preemption: on SIGTERM the trainer saves a checkpoint and exits with ``PREEMPTED_EXIT_CODE``.

Kubernetes sends SIGTERM to a pod it evicts and SIGKILL ``terminationGracePeriodSeconds`` later;
Slurm does the same to a job it preempts or cancels (``GraceTime``, ``KillWait``). The handler only
sets a flag. At the end of the current step the ranks agree (one small all-reduce) that one of them
was signalled, a checkpoint of that step is written (unless the cadence just wrote it), rank 0
appends a ``{"event": "preempted"}`` line to ``checkpoints.jsonl`` and every rank exits with code
75 (``EX_TEMPFAIL`` of sysexits.h: a temporary failure, retry). The launcher turns that into
:class:`~llmflow.tasks.pretrain.launch.TrainingPreempted`, which the step's retries resume from the
checkpoint exactly.

``checkpoint.preempt_grace_s`` bounds it: a watchdog started by the signal exits the process at
the deadline even when the step or the save has not finished (the half-written checkpoint is never
taken for one; the retry resumes from the previous checkpoint).

Only a process's main thread may install a signal handler, and Python runs handlers there. A
trainer run off the main thread (Ray Train runs it in a thread of its worker actor) relies on a
:class:`SigtermRelay` that the main thread installed first (``install_sigterm_relay``; the Ray
launcher does it on every worker): while a trainer listens, SIGTERM goes to its ``Preemption``;
otherwise to the handler the relay replaced (Ray's, which ends the actor).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from llmflow.tasks.pretrain import checkpoint as ckpt
from llmflow.tasks.pretrain.callbacks import Callback, append_jsonl
from llmflow.tasks.pretrain.distributed import all_reduce_sum
from llmflow.tasks.pretrain.notices import NOTICES, PREEMPTED_EVENT, PREEMPTED_EXIT_CODE
from llmflow.tasks.pretrain.state import StepOutput

if TYPE_CHECKING:
    from llmflow.tasks.pretrain.train import Trainer


class SigtermRelay:
    """The SIGTERM handler of a process whose trainer runs off the main thread.

    Installed by the main thread (``install_sigterm_relay``) before the trainer starts; a
    trainer's ``Preemption`` sets itself as the ``listener`` from any thread while it trains.
    Without a listener the signal goes to the handler the relay replaced.
    """

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.listener: Callable[[int, Any], None] | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        listener = self.listener
        if listener is not None:
            listener(signum, frame)
        elif callable(self.previous):
            self.previous(signum, frame)
        elif self.previous != signal.SIG_IGN:  # the default action: end the process
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def install_sigterm_relay() -> SigtermRelay:
    """Install (once) this process's `SigtermRelay`; call it from the main thread."""
    current = signal.getsignal(signal.SIGTERM)
    if isinstance(current, SigtermRelay):
        return current
    relay = SigtermRelay(current)
    signal.signal(signal.SIGTERM, relay)  # ValueError off the main thread
    return relay


class Preemption(Callback):
    """Turns SIGTERM into a checkpoint at the next step end and a distinct exit code."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signalled_at: float | None = None
        self.previous: Any = None
        self.relay: SigtermRelay | None = None

    def on_train_start(self, trainer: Trainer) -> None:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            return
        # NOTE: only the main thread may install handlers: off it, listen to its relay
        handler = signal.getsignal(signal.SIGTERM)
        if isinstance(handler, SigtermRelay):
            handler.listener, self.relay = self._on_sigterm, handler
        elif trainer.runtime.is_main:
            print(
                "warning: the trainer runs off the main thread and no SigtermRelay is installed "
                "there: SIGTERM will end the process without a checkpoint",
                flush=True,
            )

    def on_train_end(self, trainer: Trainer) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None
        if self.relay is not None:
            self.relay.listener, self.relay = None, None

    def wait_for_signal(self, timeout_s: float) -> bool:
        """Wait until the handler has run (at most ``timeout_s``); whether it has.

        On the main thread the handler runs as soon as the signal arrives; off it (a relay), when
        the main thread next checks for signals, which a Ray actor does every few milliseconds.
        """
        deadline = time.monotonic() + timeout_s
        while self.signalled_at is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.signalled_at is not None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.signalled_at is not None:
            return  # a second SIGTERM (torchrun forwards one too): the first one's deadline holds
        self.signalled_at = time.monotonic()
        print(
            f"SIGTERM received: saving a checkpoint after this step, then exiting with code "
            f"{PREEMPTED_EXIT_CODE} (grace {self.grace_s:g} s)",
            flush=True,
        )
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self) -> None:
        time.sleep(max(self.grace_s - (time.monotonic() - self.signalled_at), 0.0))
        print(
            f"preemption grace of {self.grace_s:g} s ran out before a checkpoint was saved; "
            f"exiting with code {PREEMPTED_EXIT_CODE} (the retry resumes from the previous one)",
            flush=True,
        )
        os._exit(PREEMPTED_EXIT_CODE)

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        if out.step >= trainer.state.end_step or not self._signalled_anywhere(trainer):
            return  # the last step: final/ is written and the run ends normally anyway
        checkpointer = trainer.checkpointer
        checkpointer.finish_pending()
        path = trainer.out_dir / "checkpoints" / ckpt.step_dir_name(trainer.state.step)
        if not ckpt.is_complete(path):
            checkpointer.save(trainer, path)
        if trainer.runtime.is_main:
            waited = time.monotonic() - self.signalled_at if self.signalled_at else 0.0
            notice = {"event": PREEMPTED_EVENT, "path": str(path), "step": trainer.state.step}
            append_jsonl(trainer.out_dir / NOTICES, {**notice, "seconds": round(waited, 3)})
            print(
                f"preempted at step {trainer.state.step}: checkpoint {path.name} saved "
                f"{waited:.1f} s after SIGTERM; exiting with code {PREEMPTED_EXIT_CODE}",
                flush=True,
            )
        ckpt.barrier()
        os._exit(PREEMPTED_EXIT_CODE)  # NOTE: no teardown: the process group may be half gone

    def _signalled_anywhere(self, trainer: Trainer) -> bool:
        """Whether any rank got SIGTERM (ranks stop at the same step or a collective hangs)."""
        if not trainer.runtime.distributed:
            return self.signalled_at is not None
        flag = torch.tensor(
            [0.0 if self.signalled_at is None else 1.0], device=trainer.runtime.device
        )
        return float(all_reduce_sum(flag, trainer.runtime)) > 0
