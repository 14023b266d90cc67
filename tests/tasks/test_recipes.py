"""The SmolLM recipes in configs/: they resolve, plan on their declared GPUs, and can be based on."""

from __future__ import annotations

import pytest
import yaml

from llmflow.flows.cli import main
from llmflow.tasks.config import CONFIGS, deep_merge, load_config
from llmflow.tasks.framework.errors import ConfigError
from llmflow.tasks.pretrain.curriculum import stage_steps
from llmflow.tasks.pretrain.planner import HEADROOM, recipe_plan

RECIPES = {"smollm3-135m": 1, "smollm3-1.7b": 8, "smollm3-3b": 288}
"""Each recipe and the GPUs it declares."""


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_resolves_and_fits_its_declared_gpus(name):
    config = load_config(CONFIGS / f"{name}.yaml")
    assert config.hardware.gpus == RECIPES[name]
    result = recipe_plan(config.pretrain, config.hardware)
    assert result.fits, result.warnings
    assert result.memory.total_gb <= HEADROOM * config.hardware.gpu_mem_gb
    assert result.num_parameters == config.pretrain.train.model_config_obj().num_parameters()
    steps = sum(stage_steps(config.pretrain, config.hardware.gpus))
    assert abs(steps - result.num_steps) <= len(config.pretrain.stages)
    weights = {d for s in config.pretrain.stages for d in s.mixture.weights}
    assert config.tokenizer.vocab_size == config.pretrain.train.model_config_obj().vocab_size
    assert weights, name


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_ends_like_smollm3_with_dpo_merged_into_the_long_context_base(name):
    from llmflow.flows.recipe import recipe

    config = load_config(CONFIGS / f"{name}.yaml")
    assert not config.grpo.enabled and config.merge.enabled
    assert (config.merge.method, config.merge.weights) == ("linear", [0.9, 0.1])
    # The same post-training settings on the offline quickstart data: the merge takes the DPO
    # model and the extended base's export, and no GRPO step is planned.
    sections = {k: config.model_dump()[k] for k in ("grpo", "merge")}
    overrides = [
        f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in sections.items()
    ]
    graph = recipe(load_config(None, overrides))
    assert not graph.find(step="grpo")
    (merged,) = graph.find(step="merge")
    assert [m.step.name for m in merged.inputs["models"]] == ["dpo", "export"]


def test_135m_trains_in_a_day_on_one_gpu():
    config = load_config(CONFIGS / "smollm3-135m.yaml")
    result = recipe_plan(config.pretrain, config.hardware)
    assert result.estimated_hours <= 24
    assert 130e6 < result.num_parameters < 140e6


def test_3b_follows_smollm3s_published_recipe():
    config = load_config(CONFIGS / "smollm3-3b.yaml")
    model = config.pretrain.train.model_config_obj()
    assert (model.num_layers, model.num_heads, model.num_kv_heads) == (36, 16, 4)
    assert model.nope_interval == 4 and model.tie_embeddings
    assert [s.mixture.num_tokens for s in config.pretrain.stages] == [8e12, 2e12, 1.1e12]
    assert {s.mixture.seq_len for s in config.pretrain.stages} == {4096}
    train = config.pretrain.train
    assert train.optimizer.name == "adamw" and train.optimizer.lr == 2e-4
    assert config.pretrain.anneal_schedule == "wsd" and train.schedule.warmup_steps == 2000
    tokens_per_step = train.batch.micro_batch_size * 4096 * config.hardware.gpus
    assert tokens_per_step == 2_359_296  # SmolLM3's ~2.36M-token global batch
    assert config.pretrain.num_processes == config.hardware.gpus
    extend = config.extend
    assert [(s.seq_len, s.rope_theta) for s in extend.stages] == [(32768, 1.5e6), (65536, 5e6)]
    assert extend.stages[-1].seq_len * extend.yarn_factor == 131072
    last = config.pretrain.stages[-1].mixture.weights
    assert (
        last["math-reasoning"] > 0
        and "math-reasoning" not in config.pretrain.stages[0].mixture.weights
    )


def test_user_config_names_a_base_and_lists_only_its_changes(tmp_path):
    user = tmp_path / "mine.yaml"
    user.write_text(
        "base: smollm3-1.7b\n"
        "name: mine\n"
        "data: ['hf://datasets/me/corpus?split=train&domain=web']\n"
        "pretrain:\n  train:\n    optimizer: {lr: 3.0e-4}\n"
        "  stages:\n    - name: only\n"
        "      mixture: {weights: {web: 1.0}, num_tokens: 1000000, seq_len: 2048}\n"
    )
    config = load_config(user)
    base = load_config(CONFIGS / "smollm3-1.7b.yaml")
    assert config.name == "mine" and config.pretrain.train.optimizer.lr == 3e-4
    # untouched siblings of a changed field keep the base's values
    assert config.pretrain.train.optimizer.betas == base.pretrain.train.optimizer.betas
    assert config.pretrain.train.batch == base.pretrain.train.batch
    assert config.pretrain.num_processes == 8 and config.hardware == base.hardware
    assert [s.name for s in config.pretrain.stages] == ["only"]  # lists replace
    assert config.extend == base.extend and config.tokenizer == base.tokenizer


def test_base_by_path_chains_and_dotted_overrides_win(tmp_path):
    (tmp_path / "mid.yaml").write_text("base: smollm3-135m\nname: mid\nhardware: {nodes: 2}\n")
    (tmp_path / "top.yaml").write_text("base: mid.yaml\nname: top\n")
    config = load_config(tmp_path / "top.yaml", ["hardware.gpu_mem_gb=40"])
    assert config.name == "top" and config.hardware.nodes == 2
    assert config.hardware.gpu_mem_gb == 40 and config.pretrain.train.model.preset == "135m"


def test_bad_bases_fail_naming_the_base(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: smollm3-7b\n")
    with pytest.raises(ConfigError, match="smollm3-7b.*smollm3-1.7b"):
        load_config(tmp_path / "c.yaml")


def test_deep_merge_merges_mappings_and_replaces_the_rest():
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    assert deep_merge(base, {"a": {"c": [3]}, "e": 2}) == {"a": {"b": 1, "c": [3]}, "d": 1, "e": 2}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": 1}  # the base is not modified


def test_show_prints_the_merged_recipe(tmp_path, capsys):
    user = tmp_path / "mine.yaml"
    user.write_text("base: smollm3-1.7b\nname: mine\nhardware: {gpu_mem_gb: 141}\n")
    assert main(["show", str(user)]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["name"] == "mine" and shown["hardware"]["gpu_mem_gb"] == 141
    assert shown["pretrain"]["train"]["model"]["preset"] == "1.7b"
    assert len(shown["pretrain"]["stages"]) == 3 and "base" not in shown


def test_plan_prints_memory_steps_and_time_for_the_recipes_gpus(capsys):
    assert main(["plan", str(CONFIGS / "smollm3-1.7b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "on 8 GPU(s)" in out and "memory per GPU" in out
    assert "steps" in out and "estimated time" in out and "fits                 yes" in out


def test_plan_fails_a_recipe_that_cannot_fit_and_proposes_a_fix(capsys):
    argv = ["plan", str(CONFIGS / "smollm3-135m.yaml")]
    argv += ["--set", "pretrain.train.batch.micro_batch_size=64"]
    assert main(argv) == 1
    out = capsys.readouterr()
    assert "fits                 NO" in out.out and "does not fit" in out.err
    assert "micro_batch_size=1" in out.out and "activation_checkpointing" in out.out


def test_cluster_deployment_runs_the_1_7b_recipe():
    from llmflow.flows.deploy import PipelineRun, deployment_specs

    spec = next(d for d in deployment_specs() if d["name"] == "cluster")
    run = PipelineRun(**spec["parameters"]["run"])
    config = run.config()
    assert run.preset == "smollm3-1.7b" and config.name == "smollm3-1.7b"
    assert config.pretrain.num_processes == 8 and config.root.startswith("s3://")


def test_every_recipe_file_is_valid_yaml_with_comments():
    for name in RECIPES:
        text = (CONFIGS / f"{name}.yaml").read_text()
        assert yaml.safe_load(text)["name"] == name
        assert sum(line.lstrip().startswith("#") for line in text.splitlines()) >= 8


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_llmflow_plan_accepts_each_recipe_and_sizes_its_extension(name, capsys):
    assert main(["plan", str(CONFIGS / f"{name}.yaml")]) == 0
    out = capsys.readouterr().out
    assert f"on {RECIPES[name]} GPU(s)" in out and "extension ctx" in out
    assert "does NOT fit" not in out  # smollm3-3b's 32k and 64k stages with their cp layouts
