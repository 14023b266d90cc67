"""The ``average`` step: the mean of a pretraining stage's last K checkpoints (a checkpoint soup).

Levanter and OLMo-core average the weights of the last checkpoints of the decay stage: the
average sits nearer the bottom of the valley the noisy final iterates circle around, often at a
lower validation loss than the last checkpoint, for no extra training. This step reads a finished
pretrain output (``checkpoints/step-*`` plus ``final/``, the newest ``last_k`` of them), writes the
uniform average in the ``final/`` layout the ``export`` step reads, and reports the validation
loss of the plain final checkpoint and of the average on the same held-out batches.

It needs the stage to keep enough checkpoints: ``pretrain.train.checkpoint.interval`` small
enough for the stage to write some, and ``keep_last >= last_k - 1``. The trainer is untouched.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, report_table, step
from llmflow.tasks.posttrain.config import AverageConfig

logger = logging.getLogger("llmflow.posttrain.average")


def stage_checkpoints(run: Path, last_k: int) -> list[Path]:
    """The newest ``last_k`` complete checkpoints of a run, oldest first, ``final/`` last.

    Raises:
        BadInputError: the run has fewer complete checkpoints than ``last_k``.
    """
    from llmflow.tasks.pretrain.checkpoint import is_complete, list_checkpoints

    found = list_checkpoints(run) + ([run / "final"] if is_complete(run / "final") else [])
    if len(found) < last_k:
        raise BadInputError(
            f"average: last_k={last_k} but {run} holds {len(found)} complete checkpoints "
            f"({', '.join(p.name for p in found) or 'none'}); lower last_k, or save more often "
            "(pretrain.train.checkpoint.interval) and keep more (checkpoint.keep_last)"
        )
    return found[-last_k:]


def model_weights(checkpoint: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's model weights: ``model.safetensors`` when written, else read from DCP."""
    if (checkpoint / "model.safetensors").exists():
        return load_file(checkpoint / "model.safetensors")
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: torch.empty_like(v) for k, v in like.items()}}
    dcp.load(state, checkpoint_id=str(checkpoint / "dcp"), no_dist=True)
    return state["model"]


def average_weights(checkpoints: list[Path]) -> dict[str, torch.Tensor]:
    """The uniform mean of the checkpoints' weights, accumulated in float64."""
    like = load_file(checkpoints[-1] / "model.safetensors")
    sums = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in like.items()}
    for checkpoint in checkpoints:
        for name, tensor in model_weights(checkpoint, like).items():
            sums[name] += tensor.double()
    return {k: (v / len(checkpoints)).to(like[k].dtype) for k, v in sums.items()}


@torch.no_grad()
def validation_loss(
    weights: dict[str, torch.Tensor], model_config: dict, validation: Path, cfg: AverageConfig
) -> float:
    """Token-mean loss of weights on the first ``eval_batches`` held-out batches (as the trainer)."""
    from llmflow.model.config import ModelConfig
    from llmflow.model.loss import IGNORE_INDEX, causal_lm_loss
    from llmflow.model.transformer import Transformer
    from llmflow.tasks.dataprep.loader import PackedLoader

    model = Transformer(ModelConfig(**model_config))
    model.load_state_dict(weights)
    model.eval()
    loader = PackedLoader(validation, cfg.micro_batch_size, 0, 1, seed=0)
    total = count = 0.0
    for _ in range(cfg.eval_batches):
        batch = loader.next_batch()
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
        loss, _ = causal_lm_loss(logits, batch["labels"], 0.0)
        n = (batch["labels"] != IGNORE_INDEX).sum().item()
        total, count = total + loss.item() * n, count + n
    loader.close()
    return total / max(count, 1)


def write_final(source: Path, weights: dict[str, torch.Tensor], out: Path) -> Path:
    """``out/final/`` in the trainer's layout for export: weights, config, state, COMPLETE."""
    final = Path(out) / "final"
    final.mkdir(parents=True)
    save_file(weights, str(final / "model.safetensors"))
    for name in ("model_config.json", "trainer_state.json"):
        shutil.copy2(source / name, final / name)
    (final / "COMPLETE").write_text("")
    return final


def _compare_losses(
    run: Path,
    checkpoints: list[Path],
    weights: dict[str, torch.Tensor],
    validation: Path,
    cfg: AverageConfig,
) -> dict[str, Any]:
    """The averaged checkpoints' names, and the validation loss of the run's final weights and of
    the average ``weights``."""
    model_config = json.loads((run / "final" / "model_config.json").read_text())
    final_loss = validation_loss(load_file(run / "final" / "model.safetensors"), model_config, validation, cfg)  # fmt: skip
    average_loss = validation_loss(weights, model_config, validation, cfg)
    return {
        "checkpoints": json.dumps([p.name for p in checkpoints]),
        "val_loss_final": final_loss,
        "val_loss_average": average_loss,
        "val_loss_change": average_loss - final_loss,
    }


@step("average", version=1)
def average(cfg: AverageConfig, run: Path, validation: Path, out: Path) -> Metrics:
    """Average the last ``last_k`` checkpoints of a pretrain output; compare validation loss.

    Args:
        cfg: How many checkpoints, and the validation budget.
        run: A finished pretrain output (the decay stage).
        validation: The held-out set the stage validated on.
        out: Receives ``final/`` (export-ready) and ``summary.json``.

    Returns:
        The averaged steps, and the validation loss of the final checkpoint and of the average.
    """
    checkpoints = stage_checkpoints(run, cfg.last_k)
    weights = average_weights(checkpoints)
    metrics = _compare_losses(run, checkpoints, weights, validation, cfg)
    write_final(run / "final", weights, out)
    if (run / "summary.json").exists():  # tokens seen, for the export's progress
        shutil.copy2(run / "summary.json", out / "summary.json")
    (out / "average.json").write_text(json.dumps(metrics, indent=1))
    report_table("checkpoint-average", [metrics], f"Average of the last {cfg.last_k} checkpoints")
    return metrics
