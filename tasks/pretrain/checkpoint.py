"""Atomic, resumable checkpoints through ``torch.distributed.checkpoint`` (DCP).

Layout of one checkpoint folder (``checkpoints/step-000100/`` or ``final/``)::

    dcp/                 model + optimizer state, sharded by DCP (reshardable on load)
    rank-00000.pt        per-rank RNG states and data-loader state
    trainer_state.json   step, start step, tokens seen, guard state, ... (rank 0)
    model_config.json    the architecture, checked on resume and init_from
    COMPLETE             written last; a folder without it is not a checkpoint

Every rank writes into ``.tmp-<name>/``; after a barrier rank 0 renames it into place, so a crash
never leaves a folder that looks complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from llmflow.tasks.framework.errors import BadInputError

STEP_DIR = re.compile(r"^step-(\d{6,})$")
MARKER = "COMPLETE"


def barrier() -> None:
    """Synchronise ranks when running distributed; a no-op otherwise."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rank_and_world() -> tuple[int, int]:
    """Return ``(rank, world_size)``, ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def is_complete(path: Path) -> bool:
    return (Path(path) / MARKER).exists()


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Return complete step checkpoints under ``out_dir/checkpoints``, oldest first."""
    root = Path(out_dir) / "checkpoints"
    if not root.exists():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(out_dir: Path) -> Path | None:
    """Return the newest complete checkpoint (``final/`` wins), or None."""
    final = Path(out_dir) / "final"
    if is_complete(final):
        return final
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def resolve_init_from(path: Path) -> Path:
    """Accept a checkpoint folder or a run's out_dir (then its final or latest checkpoint)."""
    path = Path(path)
    if is_complete(path):
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise BadInputError(f"init_from={path}: no complete checkpoint there")
    return found


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    trainer_state: dict[str, Any],
    loader_state: dict[str, Any],
    model_config: Any,
    write_extra: Callable[[Path], None] | None = None,
) -> None:
    """Write a checkpoint atomically to ``path`` (all ranks must call this).

    ``write_extra(tmp_dir)`` runs on rank 0 before the folder is marked complete.
    """
    rank, _ = rank_and_world()
    path = Path(path)
    tmp = path.parent / f".tmp-{path.name}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizers)
    with _quiet_single_process():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    torch.save({"rng": rng_state(), "loader": loader_state}, tmp / f"rank-{rank:05d}.pt")
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        (tmp / "model_config.json").write_text(json.dumps(dataclasses.asdict(model_config)))
        if write_extra is not None:
            write_extra(tmp)
    barrier()
    if rank == 0:
        (tmp / MARKER).write_text("ok\n")
        if path.exists():  # NOTE: a rewind may re-save a step; replace the older copy.
            shutil.rmtree(path)
        tmp.rename(path)
    barrier()


def prune_checkpoints(out_dir: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` step checkpoints and stale tmp folders (rank 0)."""
    found = list_checkpoints(out_dir)
    for old in found[: max(len(found) - keep_last, 0)]:
        shutil.rmtree(old, ignore_errors=True)


def clean_tmp(out_dir: Path) -> None:
    """Remove partial checkpoints a crashed attempt left behind (rank 0, before training)."""
    for root in (Path(out_dir) / "checkpoints", Path(out_dir)):
        if root.exists():
            for tmp in root.glob(".tmp-*"):
                shutil.rmtree(tmp, ignore_errors=True)


CONTEXT_FIELDS = ("max_seq_len", "rope_theta", "rope_scaling")


def check_same_architecture(path: Path, model_config: Any) -> None:
    """Raise BadInputError naming the differing fields if ``path`` holds another architecture."""
    saved = json.loads((Path(path) / "model_config.json").read_text())
    current = json.loads(json.dumps(dataclasses.asdict(model_config)))
    diff = {k: (saved.get(k), current.get(k)) for k in saved.keys() | current.keys()}
    # NOTE: the weights do not depend on the context fields; changing them from one checkpoint
    # to the next is context extension (RoPE ABF / YaRN), not another architecture.
    diff = {k: v for k, v in diff.items() if v[0] != v[1] and k not in CONTEXT_FIELDS}
    if diff:
        detail = ", ".join(f"{k}: checkpoint={a!r} vs config={b!r}" for k, (a, b) in diff.items())
        raise BadInputError(f"checkpoint {path} has another architecture ({detail})")


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    load_optimizer: bool = True,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load model (and optimizer) state in place; return ``(trainer_state, rank_state)``.

    ``rank_state`` holds this rank's RNG and loader state, or None when the checkpoint was
    written by fewer ranks (a resharded load: the caller restarts the data loader).
    """
    path = Path(path)
    rank, _ = rank_and_world()
    if load_optimizer:
        model_sd, optim_sd = get_state_dict(model, optimizers)
        state = {"model": model_sd, "optim": optim_sd}
    else:  # NOTE: get_state_dict would give a fresh optimizer state (a fake step with lr=0).
        state = {"model": get_model_state_dict(model)}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path / "dcp"))
    if load_optimizer:
        set_state_dict(
            model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    else:
        set_model_state_dict(model, state["model"])
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    rank_file = path / f"rank-{rank:05d}.pt"
    rank_state = torch.load(rank_file, weights_only=False) if rank_file.exists() else None
    return trainer_state, rank_state
