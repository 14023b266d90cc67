"""configs/smollm3-3b-posttrain.yaml: SmolLM3's post-training path from its base validates, and
`llmflow plan` plans it on the base's own architecture, read from config.json alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.model.test_hf_import import RELEASED

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "configs" / "smollm3-3b-posttrain.yaml"


def test_the_posttrain_recipe_follows_smollm3():
    from llmflow.tasks.config import load_config

    config = load_config(PRESET, [])
    assert config.init == "hf://models/HuggingFaceTB/SmolLM3-3B-Base"
    assert [s.name for s in config.pretrain.stages] == ["midtrain"]  # mid-training
    assert config.pretrain.train.schedule.min_lr_ratio == 0.0  # annealed
    assert config.extend.stages == []
    assert config.sft.assistant_only_loss and config.dpo.loss_type == "apo_zero"
    assert not config.grpo.enabled
    assert (config.merge.source, config.merge.method, config.merge.weights) == (
        "dpo", "linear", [0.9, 0.1],
    )  # fmt: skip


def test_plan_reads_the_base_architecture_from_a_mirror_holding_only_config_json(tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path / "mirror" / "HuggingFaceTB" / "SmolLM3-3B-Base"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(RELEASED["SmolLM3-3B"]))
    env = {**os.environ, "LLMFLOW_HUB_MIRROR": str(tmp_path / "mirror")}
    cmd = [sys.executable, "-m", "llmflow.flows.cli", "plan", str(PRESET)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "unreadable" not in out.stdout
    assert "init: planned on the architecture of HuggingFaceTB/SmolLM3-3B-Base@local-" in out.stdout
    with torch.device("meta"):
        released = AutoModelForCausalLM.from_config(AutoConfig.for_model(**RELEASED["SmolLM3-3B"]))
    count = sum(p.numel() for p in released.parameters())
    assert f"parameters           {count / 1e6:,.1f}M" in out.stdout
    assert "fits                 yes" in out.stdout


def test_plan_takes_the_init_architecture_not_the_preset(tmp_path, monkeypatch):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmflow.flows.cli import _init_architecture
    from llmflow.tasks.config import load_config
    from llmflow.tasks.pretrain.planner import recipe_plan

    folder = tmp_path / "meta-llama" / "Llama-3.2-1B"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(RELEASED["Llama-3.2-1B"]))
    monkeypatch.setenv("LLMFLOW_HUB_MIRROR", str(tmp_path))
    config = load_config(PRESET, ["init=hf://models/meta-llama/Llama-3.2-1B"])
    planned = recipe_plan(_init_architecture(config).pretrain, config.hardware)
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**RELEASED["Llama-3.2-1B"]))
    assert planned.num_parameters == sum(p.numel() for p in theirs.parameters())
    assert recipe_plan(config.pretrain, config.hardware).num_parameters != planned.num_parameters
