"""Every command reads the recipe with CONFIG and --set; its flags are shorthands for fields."""

from __future__ import annotations

import pytest
import yaml

from llmflow.flows import cli
from llmflow.flows.cli_recipe import load_recipe
from llmflow.tasks.config import load_config
from llmflow.tasks.evaluation.card import card_config
from llmflow.tasks.framework.errors import ConfigError

FLAGS = [
    (
        ["preflight", "--steps", "6", "--processes", "1", "--no-data", "--seq-len", "64"],
        ["preflight.steps=6", "preflight.processes=1", "preflight.check_data=false",
         "preflight.seq_len=64"],
    ),
    (["preflight", "--no-train"], ["preflight.train=false"]),
    (
        ["critical-batch", "--base-batch", "8", "--factors", "1", "4", "--points", "10", "20",
         "--branch-tokens", "4096", "--lr-scaling", "linear", "--tolerance", "0.02"],
        ["critical_batch.base_batch=8", "critical_batch.factors=[1, 4]",
         "critical_batch.points=[10, 20]", "critical_batch.branch_tokens=4096",
         "critical_batch.lr_scaling=linear", "critical_batch.tolerance=0.02"],
    ),
    (["ablate", "--candidate", "math", "--num-tokens", "999"],
     ["ablation.candidate=math", "ablation.num_tokens=999"]),
    (["plan", "--gpu-mem", "40", "--mfu", "0.3"], ["hardware.gpu_mem_gb=40", "hardware.mfu=0.3"]),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "overrides"), FLAGS, ids=lambda v: " ".join(v)[:40])
def test_a_flag_gives_the_config_its_set_gives(argv, overrides):
    args = cli.build_parser().parse_args(argv)
    assert load_recipe(args) == load_config(None, overrides)
    assert load_recipe(args) != load_config(None, [])


def test_without_flags_the_recipe_values_apply():
    recipe = ["--set", "preflight.steps=8", "--set", "critical_batch.tolerance=0.05"]
    pre = load_recipe(cli.build_parser().parse_args(["preflight", *recipe]))
    assert pre.preflight.steps == 8 and pre.critical_batch.tolerance == 0.05
    # --set after a flag's field wins: the flag is only a shorthand
    both = cli.build_parser().parse_args(["preflight", "--steps", "6", *recipe])
    assert load_recipe(both).preflight.steps == 8


def test_plan_gpus_sets_the_machines_of_the_hardware():
    def hardware(gpus):
        argv = ["plan", "--gpus", str(gpus), "--set", "hardware.gpus_per_node=8"]
        config = load_recipe(cli.build_parser().parse_args(argv))
        return config.hardware.nodes, config.hardware.gpus_per_node, config.hardware.gpus

    assert hardware(32) == (4, 8, 32)
    assert hardware(3) == (1, 3, 3)


def test_a_bad_flag_value_names_the_field():
    args = cli.build_parser().parse_args(["critical-batch", "--factors", "2", "4"])
    with pytest.raises(ConfigError, match="critical_batch.factors"):
        load_recipe(args)


def test_ablate_without_a_candidate_says_which_field(capsys):
    assert cli.main(["ablate"]) == 2
    assert "ablation.candidate is not set" in capsys.readouterr().err


def test_the_card_embeds_the_recipe_without_unset_command_sections():
    """The model card embeds the recipe's YAML (its address depends on it): the command
    sections appear there only when a recipe sets them."""
    plain = yaml.safe_load(card_config(load_config(None, []), "base").config_yaml)
    assert not {"preflight", "critical_batch", "ablation"} & set(plain)
    assert list(plain) == list(load_config(None, []).model_dump())[: len(plain)]
    tuned = card_config(load_config(None, ["critical_batch.tolerance=0.05"]), "base")
    assert yaml.safe_load(tuned.config_yaml)["critical_batch"]["tolerance"] == 0.05
