"""The checkpointing component: save on its cadence, prune, resume, and announce each checkpoint.

Step checkpoints go to ``checkpoints/step-NNNNNN/`` every ``checkpoint.interval`` steps (the
newest ``keep_last`` survive); ``final/`` is written at the stage's end and also holds
``model.safetensors``. After each complete checkpoint, rank 0 appends one JSON line to
``checkpoints.jsonl`` in the run folder: the launcher watches that file (not the trainer's
output) to mirror the partial run, so a killed run resumes elsewhere.

With ``checkpoint.async_save`` a step checkpoint is written in the background while training goes
on: the optimizer's next step waits only for the state to be copied, the checkpoint is committed
(marked complete, announced) at the first step end after every rank's write has finished, and the
next save, a rewind or the end of training waits for it. Each notice carries ``blocked_s``, the
training time that checkpoint held up. ``final/`` is always written synchronously.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llmflow.model.hf import save_model
from llmflow.tasks.pretrain import checkpoint as ckpt
from llmflow.tasks.pretrain.callbacks import Callback, append_jsonl
from llmflow.tasks.pretrain.config import CheckpointConfig
from llmflow.tasks.pretrain.distributed import all_reduce_sum
from llmflow.tasks.pretrain.notices import NOTICES
from llmflow.tasks.pretrain.state import StepOutput
from llmflow.tasks.pretrain.validate import check_source

if TYPE_CHECKING:
    from llmflow.tasks.pretrain.train import Trainer

HOLDS = ".holds"  # checkpoints/.holds/<step-dir>.<host>.<pid>: a reader's hold on a checkpoint
HOLD_TTL_S = 600.0  # a hold not refreshed for this long is stale (its holder hung or vanished)


@contextlib.contextmanager
def holds_locked(out_dir: Path) -> Iterator[Path]:
    """A run's ``checkpoints/`` locked (``flock`` on the folder itself); yields its holds folder
    (not created here). A reader places a hold and a pruner checks the holds under this one lock,
    so a checkpoint is never deleted between the two."""
    root = Path(out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield root / HOLDS
    finally:
        os.close(fd)  # releases the lock


def is_held(checkpoint: Path) -> bool:
    """Whether a live reader holds ``checkpoint``. A hold expires when its holder's process is
    gone (same host) or it was not refreshed for its ``ttl_s``."""
    checkpoint = Path(checkpoint)
    return any(_live_hold(p) for p in (checkpoint.parent / HOLDS).glob(f"{checkpoint.name}.*"))


def _live_hold(path: Path) -> bool:
    try:
        hold = json.loads(path.read_text())
        age = time.time() - path.stat().st_mtime
    except (OSError, ValueError):
        return False
    if age > float(hold.get("ttl_s", HOLD_TTL_S)):
        return False
    if hold.get("host") == socket.gethostname():
        try:
            os.kill(int(hold["pid"]), 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, another user's
            return True
    return True


def prune(out_dir: Path, keep_last: int) -> None:
    """``checkpoint.prune_checkpoints`` less the checkpoints a reader holds (rank 0); a held one
    goes at the first save after its hold is released."""
    with holds_locked(out_dir):
        found = ckpt.list_checkpoints(out_dir)
        for old in found[: max(len(found) - keep_last, 0)]:
            if not is_held(old):
                shutil.rmtree(old, ignore_errors=True)


class Checkpointer(Callback):
    """Saves, prunes and restores the checkpoints of one run folder."""

    def __init__(self, cfg: CheckpointConfig, out_dir: Path):
        self.cfg, self.out_dir = cfg, Path(out_dir)
        self.resumed_from: Path | None = None
        self.pending: ckpt.PendingSave | None = None
        self.pending_step = 0
        self.hooked = False
        self.storage_writer: Callable[[Path], Any] | None = None  # tests: slow storage

    def latest(self) -> Path | None:
        """The newest complete checkpoint of this run (``final/`` wins), or None (all ranks).

        A checkpoint still being written is waited for and committed first.
        """
        self.finish_pending()
        return ckpt.latest_checkpoint(self.out_dir)

    def latest_intact(self) -> Path | None:
        """The newest checkpoint whose files match their checksums, chosen by rank 0 (all ranks).

        Corrupt newer ones are passed over, and rank 0 says so in the log.
        """
        self.finish_pending()
        rank, world = ckpt.rank_and_world()
        chosen = [ckpt.latest_intact(self.out_dir) if rank == 0 else None]
        if world > 1:  # NOTE: one rank reads the files; every rank must load the same one.
            torch.distributed.broadcast_object_list(chosen, src=0)
        return chosen[0]

    # ------------------------------------------------------------------------- the cadence
    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        if self.pending is not None and self._written_everywhere(trainer):
            self.finish_pending()
        if out.step % self.cfg.interval == 0 and out.step < trainer.state.end_step:
            self.save_step(trainer)

    def on_train_end(self, trainer: Trainer) -> None:
        self.finish_pending()
        if self.resumed_from is None or self.resumed_from.name != "final":
            self.save(trainer, self.out_dir / "final", final=True)

    # ------------------------------------------------------------------------- saving
    def save_step(self, trainer: Trainer) -> None:
        """Checkpoint the current step under ``checkpoints/`` (all ranks)."""
        path = self.out_dir / "checkpoints" / ckpt.step_dir_name(trainer.state.step)
        if not self.cfg.async_save:
            self.save(trainer, path)
            return
        self.finish_pending()
        self._hook_optimizers(trainer)
        self.pending = ckpt.start_async_save(
            path,
            trainer.model,
            trainer.optimizers,
            trainer.registry.main_state(),
            trainer.registry.rank_state(),
            trainer.model_config,
            self.storage_writer,
        )
        self.pending_step = trainer.state.step

    def finish_pending(self) -> None:
        """Wait for the checkpoint being written, commit it, prune, announce (all ranks)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending.commit()
        if ckpt.rank_and_world()[0] == 0:
            prune(self.out_dir, self.cfg.keep_last)
            self.announce(pending.path, self.pending_step, False, pending.blocked_s)

    def _written_everywhere(self, trainer: Trainer) -> bool:
        """Whether every rank's background write has finished (one small all-reduce)."""
        done = torch.tensor(
            [0.0 if self.pending.written_here() else 1.0], device=trainer.runtime.device
        )
        return float(all_reduce_sum(done, trainer.runtime)) == 0.0

    def _hook_optimizers(self, trainer: Trainer) -> None:
        """Make every optimizer step wait until a pending checkpoint's state is copied."""
        if self.hooked:
            return
        for optimizer in trainer.optimizers:
            optimizer.register_step_pre_hook(lambda *_: self._staged())
        self.hooked = True

    def _staged(self) -> None:
        if self.pending is not None:
            self.pending.wait_staged()

    def save(self, trainer: Trainer, path: Path, final: bool = False) -> None:
        """Write a checkpoint synchronously (all ranks); final ones also hold model.safetensors."""
        self.finish_pending()
        started = time.perf_counter()
        main_state, rank_state = trainer.registry.main_state(), trainer.registry.rank_state()
        full = None
        if final:  # NOTE: collective: every rank takes part, rank 0 receives the tensors.
            full = trainer.parallel.full_state_dict(trainer.model)
        ckpt.save_checkpoint(
            path,
            trainer.model,
            trainer.optimizers,
            main_state,
            rank_state,
            trainer.model_config,
            write_extra=(lambda tmp: save_model(full, trainer.model_config, tmp))
            if final
            else None,
        )
        if trainer.runtime.is_main:
            if not final:
                prune(self.out_dir, self.cfg.keep_last)
            self.announce(path, trainer.state.step, final, time.perf_counter() - started)

    def announce(self, path: Path, step: int, final: bool, blocked_s: float) -> None:
        """Append the notice the launcher watches for; echo it for people reading the log."""
        notice = {"path": str(path), "step": step, "final": final, "blocked_s": blocked_s}
        append_jsonl(self.out_dir / NOTICES, notice)
        print(
            f"checkpoint {path.name} complete at step {step} (training blocked {blocked_s:.3f}s)",
            flush=True,
        )

    # ------------------------------------------------------------------------- loading
    def load(
        self, trainer: Trainer, path: Path, parts: tuple[str, ...] | None = ("train",)
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Load weights, optimizer state and the registered ``parts`` (all when None; by
        default the run counters, ``TrainState``) from ``path`` (all ranks).

        Returns the checkpoint's ``trainer_state.json`` and this rank's own state (None when
        fewer ranks wrote it).
        """
        self.finish_pending()
        main_state, rank_state = ckpt.load_checkpoint(path, trainer.model, trainer.optimizers)
        trainer.reset_base_lrs()
        trainer.registry.load(main_state, rank_state, parts)
        return main_state, rank_state

    def resume(self, trainer: Trainer) -> Path | None:
        """Continue exactly from this run's latest checkpoint, if any; return it."""
        if trainer.runtime.is_main:
            ckpt.clean_tmp(self.out_dir)
        ckpt.barrier()
        latest = self.latest_intact()
        if latest is None:
            return None
        check_source(trainer.cfg, latest)
        _, rank_state = self.load(trainer, latest, parts=None)  # every registered part
        if rank_state is None:  # NOTE: written by fewer ranks: the data restarts.
            print("checkpoint from another world size: data loader restarts", flush=True)
            trainer.seed_rng()
        self.resumed_from = latest
        print(f"resumed from {latest} at step {trainer.state.step}", flush=True)
        return latest

    def initialise(self, trainer: Trainer, init_from: Path) -> None:
        """Start a new stage from a previous stage's checkpoint: weights, optimizer, step."""
        source = ckpt.resolve_init_from(init_from)
        check_source(trainer.cfg, source)
        _, rank_state = self.load(trainer, source)
        trainer.state.start_stage()
        print(f"initialised from {source} at step {trainer.state.step}", flush=True)
        if trainer.cfg.continue_data:
            if rank_state is None:
                raise ValueError(
                    f"continue_data: {source} was written by another world size; its data "
                    "position cannot be continued"
                )
            trainer.registry.load({}, rank_state, ["loader"])  # refuses other data
            print(f"data continues at sequence {trainer.loader.position}", flush=True)
