"""The world size the run's address and step count use is the one that launches: an accelerate
config that starts more processes than ``pretrain.num_processes`` is refused when the recipe is
validated, before any compute."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmflow.tasks.config import load_config
from llmflow.tasks.framework.errors import ConfigError
from llmflow.tasks.pretrain.curriculum import stage_steps
from llmflow.tasks.pretrain.launchers import local_launcher

MULTI_GPU = "deployments/accelerate/multi_gpu_fsdp2.yaml"  # num_processes: 8
ARGS = ["--config", "c.json", "--data-dir", "d", "--out-dir", "o"]


def test_an_accelerate_config_alone_is_refused_naming_both_world_sizes():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"pretrain.accelerate_config={MULTI_GPU}"])
    message = str(info.value)
    assert message.startswith("invalid config:\n  pretrain: ")
    assert "num_processes is 1 but accelerate_config" in message
    assert f"{MULTI_GPU} launches 8 processes (num_processes: 8)" in message
    assert "pretrain.num_processes=8" in message  # what to set


def test_the_accelerate_config_with_its_world_size_trains_on_it():
    one = load_config()
    eight = load_config(
        overrides=[f"pretrain.accelerate_config={MULTI_GPU}", "pretrain.num_processes=8"]
    )
    assert eight.pretrain.world_size == 8
    # 8 ranks take a budget in an eighth of the steps (rounded up), as the hand computation says.
    per_step = [
        s.mixture.seq_len * one.pretrain.train.batch.micro_batch_size
        * one.pretrain.train.batch.grad_accum_steps
        for s in one.pretrain.stages
    ]  # fmt: skip
    tokens = [s.mixture.num_tokens for s in one.pretrain.stages]
    assert stage_steps(eight.pretrain, 8) == [
        -(-n // (p * 8)) for n, p in zip(tokens, per_step, strict=True)
    ]


@pytest.mark.parametrize(
    "overrides",
    [
        ["pretrain.accelerate_config=deployments/accelerate/cpu.yaml"],  # one process: agrees
        ["pretrain.accelerate_config=deployments/accelerate/single_gpu.yaml"],
        # More processes than the YAML's: accelerate's --num_processes override, as documented.
        [f"pretrain.accelerate_config={MULTI_GPU}", "pretrain.num_processes=4"],
        # Ray launches the workers: the accelerate config is not used.
        [f"pretrain.accelerate_config={MULTI_GPU}", "pretrain.launcher=ray"],
    ],
)
def test_configs_whose_world_size_is_unambiguous_load(overrides):
    load_config(overrides=overrides)


@pytest.mark.parametrize("recipe", ["configs/smollm3-1.7b.yaml", "configs/smollm3-3b.yaml"])
def test_the_shipped_multi_gpu_recipes_still_load(recipe):
    root = Path(__file__).resolve().parents[3]
    assert load_config(root / recipe).pretrain.world_size > 1


def test_a_missing_accelerate_config_is_refused_naming_it():
    with pytest.raises(
        ConfigError, match=r"pretrain: .*accelerate_config '.*nope.yaml' cannot be read"
    ):
        load_config(overrides=["pretrain.accelerate_config=deployments/accelerate/nope.yaml"])


def test_the_launcher_always_passes_the_world_size_to_accelerate():
    cfg = Path("deployments/accelerate/cpu.yaml")
    assert local_launcher(1, cfg).command(ARGS) == [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg),
        "--num_processes", "1", "-m", "llmflow.tasks.pretrain.train", *ARGS,
    ]  # fmt: skip
