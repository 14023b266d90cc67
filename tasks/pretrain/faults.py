"""Fault injection for tests: a trainer component enabled by the ``LLMFLOW_FAULTS`` variable.

``LLMFLOW_FAULTS='{"scale_loss_at_steps": [8], "loss_scale": 100}'`` multiplies the loss of
step 8 (once per process: a rewound or retried step 8 trains normally), so tests can provoke a
spike or a NaN; ``{"crash_after_step": 6}`` kills the process abruptly (exit code 3) after step 6
and its checkpoint, as a lost machine would. ``{"slow_storage_after_step": 6}`` makes storage slow
from then on (each rank's background checkpoint write first sleeps ``checkpoint_write_delay_s``),
and ``{"sigkill_after_step": 8}`` sends the process SIGKILL after step 8 (with an asynchronous save
of step 8 in flight, if one was started); ``{"sigterm_after_step": 5}`` sends it SIGTERM, as a
preempting scheduler would. ``{"error_at_start": "config"}`` raises a ``ConfigError`` before the
first step (``"value"``: a ``ValueError``, ``"io"``: an ``OSError``), as a config the launcher's
checks let through would. Slow and stalled data storage: ``{"slow_reads_from_step": 10,
"read_delay_s": 0.2}`` makes every batch read from step 10 on take 0.2 s longer (or, with
``"read_slowdown": 10``, 10 times as long); ``{"stall_read_at_step": 12, "stall_s": 5}`` blocks
the first read of step 12 for 5 s (once per process). ``{"scale_weights_at_step": 8,
"scale_layer": 1, "weight_scale": 50}`` multiplies the weights of ``layers.1`` by 50 before step 8
(once per process), as a corrupted block would. ``{"tp_same_init": true}`` gives every
tensor-parallel rank the shards tp rank 0 drew at a fresh start, as ranks seeded alike would
(their heads and hidden rows are then copies). ``"ranks": [1]`` limits every fault to those
ranks. Unset, the trainer has no such component at all.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import FileSystemWriter

from llmflow.tasks.framework.errors import ConfigError
from llmflow.tasks.pretrain.callbacks import Callback
from llmflow.tasks.pretrain.preemption import Preemption
from llmflow.tasks.pretrain.state import StepOutput

if TYPE_CHECKING:
    from llmflow.tasks.pretrain.train import Trainer

ENV = "LLMFLOW_FAULTS"
CRASH_EXIT_CODE = 3
START_ERRORS: dict[str, type[Exception]] = {
    "config": ConfigError,
    "value": ValueError,
    "io": OSError,
}


@dataclass
class FaultInjector(Callback):
    """Scales chosen steps' losses and/or crashes after a chosen step."""

    scale_loss_at_steps: list[int] = field(default_factory=list)
    loss_scale: float = 100.0
    crash_after_step: int | None = None
    sigkill_after_step: int | None = None
    sigterm_after_step: int | None = None
    slow_storage_after_step: int | None = None
    checkpoint_write_delay_s: float = 60.0
    error_at_start: str | None = None
    slow_reads_from_step: int | None = None
    read_delay_s: float = 0.0
    read_slowdown: float = 1.0
    stall_read_at_step: int | None = None
    stall_s: float = 0.0
    scale_weights_at_step: int | None = None
    scale_layer: int = 0
    weight_scale: float = 10.0
    tp_same_init: bool = False
    fired: set[int | str] = field(default_factory=set)
    loss_fn: Callable[..., Any] | None = None

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        """The injector ``LLMFLOW_FAULTS`` (JSON) asks for, or None when it is unset (or names
        ``ranks`` without this one)."""
        spec = json.loads(os.environ.get(ENV) or "null")
        if spec is None:
            return None
        ranks = spec.pop("ranks", None)
        if ranks is not None and int(os.environ.get("RANK", "0")) not in ranks:
            return None
        return cls(**spec)

    def on_train_start(self, trainer: Trainer) -> None:
        self.loss_fn = trainer.loss_fn
        if self.error_at_start is not None:
            error = START_ERRORS[self.error_at_start]
            raise error(f"fault injection: {error.__name__} before the first step ({ENV})")
        if self.tp_same_init and trainer.state.step == 0:
            copied = trainer.parallel.copy_tp_rank0(trainer.model)  # None without TP
            if copied is not None:
                print(
                    f"fault injection: {copied} tensor-parallel weights copied from tp rank 0",
                    flush=True,
                )

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        fire = step in self.scale_loss_at_steps and step not in self.fired
        if fire:
            self.fired.add(step)
        trainer.loss_fn = self._scaled if fire else self.loss_fn
        # PP: the last stage's schedule computes the loss, not trainer.loss_fn
        trainer.parallel.set_loss_scale(self.loss_scale if fire else 1.0)
        slow = self.slow_reads_from_step is not None and step >= self.slow_reads_from_step
        stall = step == self.stall_read_at_step and "stall" not in self.fired
        if stall:
            self.fired.add("stall")
        _slow_loader(trainer.loader, self, slow, stall)
        if step == self.scale_weights_at_step and "weights" not in self.fired:
            self.fired.add("weights")
            self._scale_weights(trainer)

    def _scale_weights(self, trainer: Trainer) -> None:
        """Multiply every weight of block ``scale_layer`` by ``weight_scale`` (this rank's part)."""
        prefix = f"layers.{self.scale_layer}."
        with torch.no_grad():
            for name, param in trainer.model.named_parameters():
                if name.replace("_orig_mod.", "").startswith(prefix):
                    param.mul_(self.weight_scale)
        print(f"fault injection: {prefix[:-1]} weights x{self.weight_scale:g}", flush=True)

    def _scaled(self, *args: Any, **kwargs: Any) -> Any:
        loss, parts = self.loss_fn(*args, **kwargs)
        return loss * self.loss_scale, parts

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        if out.step == self.slow_storage_after_step:
            delay = self.checkpoint_write_delay_s
            trainer.checkpointer.storage_writer = lambda path: SlowWriter(path, delay)
        if out.step == self.crash_after_step:
            print(f"fault injection: crashing after step {out.step}", flush=True)
            os._exit(CRASH_EXIT_CODE)
        if out.step == self.sigkill_after_step:
            pending = trainer.checkpointer.pending
            busy = f"; {pending.tmp.name} in flight" if pending is not None else ""
            print(f"fault injection: SIGKILL after step {out.step}{busy}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if out.step == self.sigterm_after_step and out.step not in self.fired:
            self.fired.add(out.step)
            print(f"fault injection: SIGTERM after step {out.step}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            # NOTE: off the main thread (a Ray Train worker) the handler runs a moment later;
            # waiting for it makes the signal land after this step, as it does on the main thread
            for callback in trainer.callbacks:
                if isinstance(callback, Preemption):
                    callback.wait_for_signal(timeout_s=10.0)


def _slow_loader(loader: Any, fault: FaultInjector, slow: bool, stall: bool) -> None:
    """Set this step's reads (each step decides again): with ``slow`` every read waits
    ``read_delay_s`` more or takes ``read_slowdown`` times its own time; with ``stall`` the
    first read also blocks ``stall_s``; with neither, the loader's own ``next_batch``."""
    read = getattr(loader.next_batch, "__wrapped__", loader.next_batch)
    if not (slow or stall):
        loader.next_batch = read
        return
    pending_stall = [stall]

    def next_batch() -> Any:
        started = time.perf_counter()
        batch = read()
        if slow:
            took = time.perf_counter() - started
            time.sleep(fault.read_delay_s + (fault.read_slowdown - 1) * took)
        if pending_stall[0]:
            pending_stall[0] = False
            time.sleep(fault.stall_s)
        return batch

    next_batch.__wrapped__ = read  # type: ignore[attr-defined]
    loader.next_batch = next_batch


class SlowWriter(FileSystemWriter):
    """DCP's file-system writer on slow storage: every write starts after ``delay_s``."""

    def __init__(self, path: Path, delay_s: float) -> None:
        super().__init__(path)
        self.delay_s = delay_s

    def write_data(self, plan: Any, planner: Any) -> Any:
        time.sleep(self.delay_s)
        return super().write_data(plan, planner)
