"""Checkpoint averaging: the mean of DCP step checkpoints and final/, against a hand average."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from llmflow.model.config import ModelConfig
from llmflow.model.transformer import Transformer
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.posttrain.average import average_weights, stage_checkpoints, write_final

CONFIG = ModelConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)


def _state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Transformer(CONFIG).state_dict().items()}


def _run(root: Path) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """A pretrain output in the trainer's layout: three DCP step checkpoints (model and a
    stand-in optimizer state) and final/ with model.safetensors."""
    states = [_state(seed) for seed in range(4)]
    for step, state in zip((10, 20, 30), states[:3], strict=True):
        folder = root / "checkpoints" / f"step-{step:06d}"
        dcp.save({"model": state, "optim": {"lr": torch.tensor(0.1)}}, checkpoint_id=str(folder / "dcp"), no_dist=True)  # fmt: skip
        (folder / "COMPLETE").write_text("")
    final = root / "final"
    final.mkdir(parents=True)
    save_file(states[3], str(final / "model.safetensors"))
    (final / "model_config.json").write_text(json.dumps(dataclasses.asdict(CONFIG)))
    (final / "trainer_state.json").write_text(json.dumps({"step": 40}))
    (final / "COMPLETE").write_text("")
    return root, states


def test_average_of_the_last_k_equals_the_hand_mean(tmp_path):
    run, states = _run(tmp_path / "run")
    chosen = stage_checkpoints(run, 3)
    assert [p.name for p in chosen] == ["step-000020", "step-000030", "final"]
    averaged = average_weights(chosen)
    for name, tensor in averaged.items():
        expected = (states[1][name] + states[2][name] + states[3][name]) / 3
        torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-7)
    final = write_final(run / "final", averaged, tmp_path / "out")
    assert (final / "COMPLETE").exists() and json.loads((final / "trainer_state.json").read_text())
    Transformer(CONFIG).load_state_dict(load_file(final / "model.safetensors"))  # export-ready


def test_too_few_checkpoints_fail_naming_last_k(tmp_path):
    run, _ = _run(tmp_path / "run")
    with pytest.raises(BadInputError, match="last_k=5 but .* holds 4 complete checkpoints"):
        stage_checkpoints(run, 5)
