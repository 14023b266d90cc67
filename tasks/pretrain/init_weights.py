"""Start a run from a model's weights alone (an imported model: ``tasks/ingest/import_model.py``).

A weights-only checkpoint is a folder with ``model.safetensors`` (our names),
``model_config.json`` and ``COMPLETE``, and no ``trainer_state.json``: no optimizer state, no
step, no data position. The run starts at step 0 from those weights, with a fresh optimizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from llmflow.tasks.pretrain.checkpoint import check_same_architecture, resolve_init_from
from llmflow.tasks.pretrain.parallel import tp

if TYPE_CHECKING:
    from llmflow.tasks.pretrain.train import Trainer


def is_weights_only(init_from: Path) -> bool:
    """Whether ``init_from`` is a weights-only checkpoint (no trainer state beside it)."""
    source = resolve_init_from(init_from)
    return not (source / "trainer_state.json").exists()


def load_weights(trainer: Trainer, init_from: Path) -> None:
    """Copy the checkpoint's weights into the trainer's model (cast to its dtype; every rank
    reads the full tensors and keeps its shard)."""
    source = resolve_init_from(init_from)
    check_same_architecture(source, trainer.model_config)
    state_dict = load_file(source / "model.safetensors")
    for name, order in tp.permuted(trainer.model):  # tensor parallel: its own row order
        state_dict[name] = state_dict[name][order]
    set_model_state_dict(
        trainer.model, state_dict, options=StateDictOptions(full_state_dict=True, strict=True)
    )
    print(f"initialised from the weights in {source} (fresh optimizer, step 0)", flush=True)
