"""Checks that a config fits its data and run before any compute starts.

Every failure is a ``BadInputError`` naming the field and both values: retrying cannot help.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.pretrain.checkpoint import check_same_architecture, resolve_init_from
from llmflow.tasks.pretrain.config import TrainConfig


def read_meta(data_dir: Path) -> dict[str, Any]:
    """Read a packed dataset's ``meta.json`` (a folder without one is a BadInputError)."""
    path = Path(data_dir) / "meta.json"
    if not path.exists():
        raise BadInputError(f"data_dir={data_dir}: no meta.json (not a packed dataset)")
    return json.loads(path.read_text())


def check_data(cfg: TrainConfig, data_dir: Path, role: str = "data_dir") -> dict[str, Any]:
    """Raise BadInputError when the data's vocab or sequence length does not fit the model."""
    meta = read_meta(data_dir)
    model_cfg = cfg.model_config_obj()
    if meta["vocab_size"] != model_cfg.vocab_size:
        raise BadInputError(
            f"model.vocab_size={model_cfg.vocab_size} differs from {role} meta.json "
            f"vocab_size={meta['vocab_size']} ({data_dir})"
        )
    if meta["seq_len"] > model_cfg.max_seq_len:
        raise BadInputError(
            f"{role} meta.json seq_len={meta['seq_len']} exceeds model.max_seq_len="
            f"{model_cfg.max_seq_len}"
        )
    return meta


def validate_run(
    cfg: TrainConfig,
    data_dir: Path,
    val_dir: Path | None,
    init_from: Path | None,
    world_size: int,
) -> None:
    """Fail fast, naming the mismatch: data vs model, init_from architecture."""
    meta = check_data(cfg, data_dir)
    if val_dir is not None:
        val_meta = check_data(cfg, val_dir, role="val_dir")
        if val_meta["seq_len"] != meta["seq_len"]:
            raise BadInputError(
                f"val_dir seq_len={val_meta['seq_len']} differs from data_dir seq_len="
                f"{meta['seq_len']}"
            )
    if init_from is not None:
        check_source(cfg, resolve_init_from(init_from))


def check_world_size(cfg: TrainConfig, world_size: int) -> None:
    """Every optimizer runs at any world size (Muon gathers whole matrices on owner ranks).

    Nothing is refused any more; kept while the trainer still calls it.
    """


def check_source(cfg: TrainConfig, checkpoint: Path) -> None:
    """Refuse a checkpoint of another architecture or optimizer (resume or init_from)."""
    check_same_architecture(checkpoint, cfg.model_config_obj())
    if not (Path(checkpoint) / "trainer_state.json").exists():
        return  # weights only (an imported model): any optimizer starts from it
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    if state.get("optimizer") != cfg.optimizer.name:
        raise BadInputError(
            f"checkpoint {checkpoint} used optimizer.name={state.get('optimizer')!r}, "
            f"this config sets optimizer.name={cfg.optimizer.name!r}"
        )
