"""Atomic, resumable checkpoints through ``torch.distributed.checkpoint`` (DCP).

Layout of one checkpoint folder (``checkpoints/step-000100/`` or ``final/``)::

    dcp/                 model + optimizer state, sharded by DCP (reshardable on load)
    rank-00000.pt        each rank's own registered parts: RNG, data-loader position, ...
    trainer_state.json   rank 0's registered parts: run counters, guard, detectors, ...
    model_config.json    the architecture, checked on resume and init_from
    checksums.json       size and sha256 of every other file (rank 0, after every rank wrote)
    COMPLETE             written last; a folder without it is not a checkpoint

What the two small files hold is the trainer's registry of named parts (``state_registry.py``).

A resume checks the newest checkpoint against its ``checksums.json`` and falls back to the
previous good one when a file is missing, truncated or changed (:func:`latest_intact`).

Every rank writes into ``.tmp-<name>/``; after a barrier rank 0 renames it into place, so a crash
never leaves a folder that looks complete.

An asynchronous save (:func:`start_async_save`) copies the state in a background thread (the
optimizer's next step waits for that copy), writes it in another, and is committed (``COMPLETE``,
rename) by :meth:`PendingSave.commit` only once every rank's write has finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from llmflow.tasks.framework.disk import NoSpaceError, disk_error, no_space_message
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.lineage import file_digest
from llmflow.tasks.pretrain.checkpoint_files import (  # noqa: F401 (part of this module's API)
    CHECKSUMS,
    MARKER,
    STEP_DIR,
    checkpoint_problems,
    clean_tmp,
    is_complete,
    latest_checkpoint,
    latest_intact,
    list_checkpoints,
    prune_checkpoints,
    step_dir_name,
    write_checksums,
)
from llmflow.tasks.pretrain.parallel import tp

# NOTE: optimizer state keyed by parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"),
# as torchtitan saves under pipeline parallelism. The nested form keys param groups by position
# ("param_groups.0.lr"): every pipeline stage writes its own groups under the same keys, DCP
# keeps one rank's, and the other stages load groups without their hyperparameters.
FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
NESTED_GROUP = re.compile(r"^optim\.param_groups\.(\d+)\.([^.]+)$")


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


def _own_checksums(
    tmp: Path, rank: int, done: dict[str, dict[str, Any]] | None = None, dcp_only: bool = False
) -> dict[str, dict[str, Any]]:
    """Size and sha256 of the files this rank wrote (its DCP shards and its rank state), less
    those already in ``done``."""
    own = sorted((tmp / "dcp").glob(f"__{rank}_*.distcp"))
    if not dcp_only:
        own.append(tmp / f"rank-{rank:05d}.pt")
    done = done or {}
    sums = {
        p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": file_digest(p)}
        for p in own
        if p.is_file() and p.relative_to(tmp).as_posix() not in done
    }
    return {**done, **sums}


def _hash_when_written(written: Future, tmp: Path) -> Future:
    """This rank's DCP shards hashed in the background as soon as its write ends, so an async
    checkpoint's commit does not hold training up for the hashing."""
    hashed: Future = Future()
    rank = rank_and_world()[0]

    def run(_: Future) -> None:
        try:
            written.result()
            hashed.set_result(_own_checksums(tmp, rank, dcp_only=True))
        except BaseException as err:  # noqa: BLE001 - handed to the committing thread
            hashed.set_exception(err)

    written.add_done_callback(run)  # NOTE: runs on the writer's thread when the write ends
    return hashed


def resolve_init_from(path: Path) -> Path:
    """Accept a checkpoint folder or a run's out_dir (then its final or latest checkpoint)."""
    path = Path(path)
    if is_complete(path):
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise BadInputError(f"init_from={path}: no complete checkpoint there")
    return found


def save_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    main_state: dict[str, Any],
    rank_state: dict[str, Any],
    model_config: Any,
    write_extra: Callable[[Path], None] | None = None,
) -> None:
    """Write a checkpoint atomically to ``path`` (all ranks must call this): the tensors by DCP,
    ``main_state`` (rank 0's, JSON) and ``rank_state`` (this rank's) beside them.

    ``write_extra(tmp_dir)`` runs on rank 0 before the folder is marked complete.
    """
    tmp = _prepare(path)
    state = _saved_state(model, optimizers)
    with _no_space_named(tmp, path, state):
        with _quiet_single_process():
            dcp.save(state, checkpoint_id=str(tmp / "dcp"), planner=tp.CanonicalSavePlanner())
        _write_small(tmp, main_state, rank_state, model_config, write_extra)
        _commit(tmp, path)


def _saved_state(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict:
    """What DCP writes: the model and the flattened optimizer state, tensor-parallel tensors in
    canonical row order (readable by any layout; see ``tp.canonical_state``)."""
    model_sd, optim_sd = get_state_dict(model, optimizers, options=FLAT_OPTIM)
    model_sd, optim_sd, _ = tp.canonical_state(model, model_sd, optim_sd)
    return {"model": model_sd, "optim": optim_sd}


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict, this rank's shards only."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    if isinstance(state, tp.CanonicalRows):
        state = state.local
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


@contextlib.contextmanager
def _no_space_named(tmp: Path, path: Path, state: dict[str, Any]) -> Iterator[None]:
    """Turn a full disk or a file size limit hit while writing a checkpoint into a clear error."""
    try:
        yield
    except BaseException as exc:  # NOTE: DCP wraps a rank's failure in a BaseException
        full = disk_error(exc)
        if full is None or isinstance(exc, NoSpaceError):
            raise
        what = f"checkpoint {path} (model and optimizer state of this rank)"
        message = no_space_message(full, tmp, what, state_bytes(state) or None)
        raise NoSpaceError(full.errno, message) from exc


def _prepare(path: Path) -> Path:
    """An empty ``.tmp-<name>/`` beside ``path`` (rank 0 makes it; all ranks wait)."""
    rank, _ = rank_and_world()
    tmp = Path(path).parent / f".tmp-{Path(path).name}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    return tmp


def _write_small(
    tmp: Path,
    main_state: dict[str, Any],
    rank_state: dict[str, Any],
    model_config: Any,
    write_extra: Callable[[Path], None] | None,
) -> None:
    """This rank's own state; rank 0 adds its JSON state, the architecture, extras."""
    rank, _ = rank_and_world()
    torch.save(rank_state, tmp / f"rank-{rank:05d}.pt")
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(main_state, indent=1))
        (tmp / "model_config.json").write_text(json.dumps(dataclasses.asdict(model_config)))
        if write_extra is not None:
            write_extra(tmp)


def _commit(tmp: Path, path: Path, hashed: dict[str, dict[str, Any]] | None = None) -> None:
    """After every rank wrote its part: the marker, then the rename into place (rank 0).
    ``hashed``: this rank's files already hashed (an async save's background hashing)."""
    rank, world = rank_and_world()
    barrier()
    # NOTE: each rank hashes the files it wrote, so the cost is spread over the ranks.
    known = [_own_checksums(tmp, rank, hashed)]
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, known[0])
        known = gathered
    if rank == 0:
        write_checksums(tmp, {k: v for part in known for k, v in part.items()})
        (tmp / MARKER).write_text("ok\n")
        if path.exists():  # NOTE: a rewind may re-save a step; replace the older copy.
            shutil.rmtree(path)
        tmp.rename(path)
    barrier()


@dataclasses.dataclass
class PendingSave:
    """A checkpoint whose tensors are still being copied and written in the background."""

    path: Path
    tmp: Path
    staged: Future
    written: Future
    hashed: Future | None = None  # this rank's DCP shards' checksums, once written
    blocked_s: float = 0.0  # training time this checkpoint has held up so far

    def wait_staged(self) -> None:
        """Block until the state is copied (the next optimizer step may then change it)."""
        if not self.staged.done():
            started = time.perf_counter()
            self.staged.result()
            self.blocked_s += time.perf_counter() - started

    def written_here(self) -> bool:
        """Whether this rank's write has finished (raises the write's error, if any)."""
        if self.written.done():
            self.written.result()
            return True
        return False

    def commit(self) -> None:
        """Wait for the write on this rank, then mark complete and rename (all ranks)."""
        started = time.perf_counter()
        with _no_space_named(self.tmp, self.path, {}):
            self.written.result()
            _commit(self.tmp, self.path, self.hashed.result() if self.hashed else None)
        self.blocked_s += time.perf_counter() - started


_ASYNC_GROUP: list[dist.ProcessGroup] = []


def _async_group() -> dist.ProcessGroup | None:
    """A gloo group of its own for the background writes, so they never interleave with the
    training collectives on the default group (created once, by every rank together)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if not _ASYNC_GROUP:
        _ASYNC_GROUP.append(dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[0]


def start_async_save(
    path: Path,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    main_state: dict[str, Any],
    rank_state: dict[str, Any],
    model_config: Any,
    storage_writer: Callable[[Path], dcp.StorageWriter] | None = None,
) -> PendingSave:
    """Begin writing a checkpoint to ``path`` in the background (all ranks); see PendingSave.

    ``storage_writer(dcp_dir)`` replaces DCP's file-system writer (tests: slow storage).

    Nothing at ``path`` exists until :meth:`PendingSave.commit`: a crash before then leaves only
    ``.tmp-<name>/``, which no reader takes for a checkpoint and the next attempt deletes.
    """
    started = time.perf_counter()
    tmp = _prepare(path)
    state = _saved_state(model, optimizers)
    group = _async_group()
    cuda = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(cuda, False, True, cuda))
    with _quiet_single_process():
        response = dcp.async_save(
            state,
            checkpoint_id=str(tmp / "dcp"),
            planner=tp.CanonicalSavePlanner(),
            storage_writer=storage_writer(tmp / "dcp") if storage_writer else None,
            process_group=group,
            async_stager=stager,
            no_dist=group is None,
        )
    response.upload_completion.add_done_callback(lambda _: stager.close())
    _write_small(tmp, main_state, rank_state, model_config, None)
    written = response.upload_completion
    pending = PendingSave(
        Path(path), tmp, response.staging_completion, written, _hash_when_written(written, tmp)
    )
    pending.blocked_s = time.perf_counter() - started
    return pending


CONTEXT_FIELDS = ("max_seq_len", "rope_theta", "rope_scaling")


def check_same_architecture(path: Path, model_config: Any) -> None:
    """Raise BadInputError naming the differing fields if ``path`` holds another architecture."""
    # NOTE: a field added to ModelConfig after the checkpoint was written holds its default.
    defaults = {f.name: f.default for f in dataclasses.fields(model_config)}
    saved = {**defaults, **json.loads((Path(path) / "model_config.json").read_text())}
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
    """Load model (and optimizer) state in place; return ``(main_state, rank_state)``: rank 0's
    ``trainer_state.json`` and this rank's own state (``state_registry.py``).

    ``rank_state`` is None on every rank when the checkpoint was written by fewer ranks (a
    resharded load: the caller restarts the data loader).
    """
    path = Path(path)
    rank, world = rank_and_world()
    optim_sd = None
    if load_optimizer:
        model_sd, optim_sd = get_state_dict(model, optimizers, options=FLAT_OPTIM)
    else:  # NOTE: get_state_dict would give a fresh optimizer state (a fake step with lr=0).
        model_sd = get_model_state_dict(model)
    model_sd, optim_sd, replaced = tp.canonical_state(model, model_sd, optim_sd)
    state = {"model": model_sd}
    nested = _nested_groups(path / "dcp") if optim_sd is not None else None
    if optim_sd is not None:
        state["optim"] = optim_sd
        if nested is not None:  # a checkpoint of the nested form: its groups by position
            kept = {k: v for k, v in optim_sd.items() if not k.startswith("param_groups.")}
            state["optim"] = {**kept, "param_groups": nested}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path / "dcp"), planner=tp.CanonicalLoadPlanner())
    tp.restore_order(model, state["model"], state.get("optim"), replaced)
    if optim_sd is None:
        set_model_state_dict(model, state["model"])
    else:
        if nested is not None:
            state["optim"] = _flat_groups(state["optim"], optim_sd)
        set_state_dict(
            model,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=FLAT_OPTIM,
        )
    main_state = json.loads((path / "trainer_state.json").read_text())
    rank_file = path / f"rank-{rank:05d}.pt"
    rank_state = torch.load(rank_file, weights_only=False) if rank_file.exists() else None
    if main_state.get("world_size", world) < world:
        rank_state = None  # NOTE: every rank alike, not only those without a file of their own
    return main_state, rank_state


def _nested_groups(dcp_dir: Path) -> list[dict[str, None]] | None:
    """For a checkpoint whose optimizer state is of the nested form (written before optimizer
    state was flattened), a template of its param groups as DCP stored them (by position);
    None for the flattened form."""
    keys = dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    groups: dict[int, dict[str, None]] = {}
    for key in keys:
        found = NESTED_GROUP.match(key)
        if found:
            groups.setdefault(int(found.group(1)), {})[found.group(2)] = None
    if not groups:
        return None
    return [groups.get(i, {}) for i in range(max(groups) + 1)]


def _flat_groups(loaded: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """A loaded nested-form optimizer state (``state.<fqn>.<key>`` entries and positional
    ``param_groups``) in the flattened form: each of this rank's parameters takes the saved
    hyperparameters of the group that lists it.

    NOTE: a nested checkpoint written under pipeline parallelism holds one stage's groups
    only; the other stages' parameters keep this run's (``current``) hyperparameters.
    """
    flat = {k: v for k, v in loaded.items() if k != "param_groups"}
    flat.update({k: v for k, v in current.items() if k.startswith("param_groups.")})
    for group in loaded["param_groups"]:
        for fqn in group.get("params") or []:
            for key, value in group.items():
                if key != "params" and f"param_groups.{fqn}.{key}" in flat:
                    flat[f"param_groups.{fqn}.{key}"] = value
    return flat
