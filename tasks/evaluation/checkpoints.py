"""Scheduled evaluation, plain parts: find committed checkpoints, evaluate each exactly once.

A checkpoint is a directory (local or any fsspec URI) holding the store's commit marker
``_COMMITTED`` and a Hugging Face export (``config.json`` plus ``model.safetensors`` or its
sharded index), either in the directory itself or in its ``hf/`` subdirectory. Results go to
``{results_root}/{checkpoint_key}/{suite_key}/``; ``_COMMITTED`` there is written last, so a
crashed evaluation is redone and a finished one is never repeated.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.harness import RESULTS_FILE, ModelLoadError, evaluate
from llmflow.tasks.evaluation.suite import build_suite, read_manifest

COMMIT_MARKER = "_COMMITTED"  # the store's marker (tasks/store.py), written last
ERROR_FILE = "error.json"
HF_SUBDIR = "hf"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
STEP_IN_NAME = re.compile(r"(?:step|ckpt|checkpoint|iter)[-_]?(\d+)", re.IGNORECASE)
log = logging.getLogger("llmflow.evaluation")


class CheckpointEvalError(RuntimeError):
    """One or more checkpoints failed to evaluate; the message names each."""


@dataclass
class Checkpoint:
    """A committed checkpoint with a Hugging Face export."""

    uri: str
    hf_uri: str
    key: str
    step: int | None = None
    tokens_seen: int | None = None
    seed: int | None = None


def find_checkpoints(checkpoint_root: str) -> list[Checkpoint]:
    """Every committed checkpoint with an HF export under ``checkpoint_root``, sorted by key.

    Directories without ``_COMMITTED`` are still being written and are skipped; committed
    directories without an HF export (tokenizers, data) are not checkpoints.
    """
    fs, root = fsspec.core.url_to_fs(checkpoint_root)
    root = root.rstrip("/")
    if not fs.exists(root):
        raise FileNotFoundError(f"checkpoint_root={checkpoint_root} does not exist")
    marker_dirs = {p.rsplit("/", 1)[0] for p in fs.find(root) if p.endswith(f"/{COMMIT_MARKER}")}
    # URIs keep the root as the caller spelled it (protocol and all); local roots made absolute.
    base = root if isinstance(fs, LocalFileSystem) else checkpoint_root.rstrip("/")
    found = []
    for path in sorted(marker_dirs):
        hf_path = _hf_export_dir(fs, path)
        if hf_path is None:
            continue
        rel = path[len(root) :].strip("/")
        hf_rel = hf_path[len(root) :].strip("/")
        ckpt = Checkpoint(
            uri=f"{base}/{rel}".rstrip("/"),
            hf_uri=f"{base}/{hf_rel}".rstrip("/"),
            key=checkpoint_key(rel or root.rsplit("/", 1)[-1]),
        )
        _read_progress(fs, path, hf_path, rel or root, ckpt)
        found.append(ckpt)
    return found


def checkpoint_key(relative_path: str) -> str:
    """A results folder name for a checkpoint: its path under the root, '/' -> '__'."""
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", relative_path.replace("/", "__"))


def find_unevaluated(
    checkpoint_root: str, results_root: str, suite_key: str, retry_failed: bool = False
) -> list[str]:
    """URIs of committed checkpoints that have no committed results for ``suite_key``.

    A checkpoint whose model failed to load (``error.json`` recorded) is not offered again
    unless ``retry_failed``.
    """
    return [
        c.uri
        for c in find_checkpoints(checkpoint_root)
        if _needs_eval(results_root, c.key, suite_key, retry_failed)
    ]


def evaluate_checkpoints(
    cfg: EvalConfig,
    checkpoint_root: str,
    results_root: str,
    heldout_dir: Path | None = None,
    retry_failed: bool = False,
) -> list[dict[str, Any]]:
    """Evaluate every checkpoint not yet evaluated on this suite; one failure spares the rest.

    Returns:
        One status per checkpoint evaluated now: ``checkpoint``, ``key``, ``status`` ("ok" or
        "failed"), ``results`` (URI) or ``error`` (naming the checkpoint), headline metrics.
    """
    statuses = []
    with tempfile.TemporaryDirectory(prefix="llmflow-suite-") as tmp:
        suite_dir = build_suite(cfg, heldout_dir, Path(tmp))
        suite_key = read_manifest(suite_dir)["suite_key"]
        for ckpt in find_checkpoints(checkpoint_root):
            if _needs_eval(results_root, ckpt.key, suite_key, retry_failed):
                statuses.append(
                    evaluate_one(cfg, ckpt, results_root, suite_dir, suite_key, heldout_dir)
                )
    return statuses


def evaluate_one(
    cfg: EvalConfig,
    ckpt: Checkpoint,
    results_root: str,
    suite_dir: Path,
    suite_key: str,
    heldout_dir: Path | None,
) -> dict[str, Any]:
    """Evaluate one checkpoint and publish its results; never raises, returns a status."""
    target = result_uri(results_root, ckpt.key, suite_key)
    status: dict[str, Any] = {"checkpoint": ckpt.uri, "key": ckpt.key, "suite_key": suite_key}
    try:
        with tempfile.TemporaryDirectory(prefix="llmflow-eval-") as tmp:
            model_dir = _local_copy(ckpt.hf_uri, Path(tmp) / "model")
            out_dir = Path(tmp) / "out"
            out_dir.mkdir()
            metrics = evaluate(cfg, model_dir, out_dir, heldout_dir, suite_dir=suite_dir)
            _add_checkpoint_info(out_dir / RESULTS_FILE, ckpt)
            _publish(out_dir, target)
        status.update(status="ok", results=target, **metrics)
    except Exception as exc:  # isolate: the other checkpoints still get evaluated
        message = f"checkpoint {ckpt.uri}: {type(exc).__name__}: {exc}"
        log.error("evaluation failed: %s", message)
        status.update(status="failed", error=message)
        if isinstance(exc, ModelLoadError):  # the checkpoint itself is broken: don't retry
            _write_error(target, message, traceback.format_exc())
    return status


def raise_for_failures(statuses: list[dict[str, Any]]) -> None:
    """Raise ``CheckpointEvalError`` naming every failed checkpoint, if any failed."""
    failed = [s["error"] for s in statuses if s["status"] != "ok"]
    if failed:
        raise CheckpointEvalError(f"{len(failed)} checkpoint(s) failed:\n" + "\n".join(failed))


def result_uri(results_root: str, key: str, suite_key: str) -> str:
    """Where one checkpoint's results on one suite live."""
    return f"{results_root.rstrip('/')}/{key}/{suite_key}"


# -- helpers --------------------------------------------------------------------------------
def _hf_export_dir(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    for candidate in (path, f"{path}/{HF_SUBDIR}"):
        has_config = fs.exists(f"{candidate}/config.json")
        if has_config and any(fs.exists(f"{candidate}/{w}") for w in WEIGHT_FILES):
            return candidate
    return None


def _needs_eval(results_root: str, key: str, suite_key: str, retry_failed: bool) -> bool:
    fs, path = fsspec.core.url_to_fs(result_uri(results_root, key, suite_key))
    if fs.exists(f"{path}/{COMMIT_MARKER}"):
        return False
    return retry_failed or not fs.exists(f"{path}/{ERROR_FILE}")


def _read_json(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any] | None:
    try:
        with fs.open(path, "r") as f:
            value = json.load(f)
        return value if isinstance(value, dict) else None
    except (FileNotFoundError, json.JSONDecodeError, OSError):
        return None


def _read_progress(
    fs: fsspec.AbstractFileSystem, path: str, hf_path: str, rel: str, ckpt: Checkpoint
) -> None:
    """tokens_seen, step and seed: lineage.json, then trainer_state.json, then the name."""
    lineage = _read_json(fs, f"{path}/lineage.json") or _read_json(fs, f"{hf_path}/lineage.json")
    state = _read_json(fs, f"{path}/trainer_state.json") or _read_json(
        fs, f"{hf_path}/trainer_state.json"
    )
    lineage, state = lineage or {}, state or {}
    metrics = lineage.get("metrics") or {}
    ckpt.tokens_seen = _int(
        _first(
            metrics.get("tokens_seen"), state.get("tokens_seen"), state.get("num_input_tokens_seen")
        )
    )
    ckpt.step = _int(_first(metrics.get("step"), state.get("step"), state.get("global_step")))
    if ckpt.step is None:
        match = STEP_IN_NAME.search(rel) or re.search(r"(\d+)$", rel)
        ckpt.step = int(match.group(1)) if match else None
    seed = _find_key(lineage.get("config"), "seed")
    ckpt.seed = _int(seed if seed is not None else state.get("seed"))


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _find_key(value: Any, key: str) -> Any:
    """The first value stored under ``key`` anywhere in nested dicts (depth-first)."""
    if isinstance(value, dict):
        if key in value:
            return value[key]
        for child in value.values():
            found = _find_key(child, key)
            if found is not None:
                return found
    return None


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _local_copy(hf_uri: str, target: Path) -> Path:
    fs, path = fsspec.core.url_to_fs(hf_uri)
    if isinstance(fs, LocalFileSystem):
        return Path(path)
    target.mkdir(parents=True)
    fs.get(f"{path}/", f"{target}/", recursive=True)
    return target


def _add_checkpoint_info(results_file: Path, ckpt: Checkpoint) -> None:
    results = json.loads(results_file.read_text())
    results["checkpoint"] = asdict(ckpt)
    results_file.write_text(json.dumps(results, indent=1, sort_keys=True))


def _publish(out_dir: Path, target: str) -> None:
    """Copy the results up; the commit marker goes last."""
    fs, path = fsspec.core.url_to_fs(target)
    if fs.exists(path):
        fs.rm(path, recursive=True)
    fs.makedirs(path, exist_ok=True)
    for file in sorted(out_dir.iterdir()):
        fs.put_file(str(file), f"{path}/{file.name}")
    with fs.open(f"{path}/{COMMIT_MARKER}", "w") as f:
        f.write("ok\n")


def _write_error(target: str, message: str, trace: str) -> None:
    fs, path = fsspec.core.url_to_fs(target)
    fs.makedirs(path, exist_ok=True)
    with fs.open(f"{path}/{ERROR_FILE}", "w") as f:
        json.dump({"error": message, "traceback": trace}, f, indent=1)
