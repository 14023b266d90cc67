"""The merge step through mergekit: hand-computed averages, SLERP identity, bad input first."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.posttrain.merge import MergeStepConfig, merge


def _smollm3(tokenizer, seed: int):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    torch.manual_seed(seed)
    config = SmolLM3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return SmolLM3ForCausalLM(config)


def _output(root: Path, name: str, model, tokenizer) -> Path:
    path = root / name
    model.save_pretrained(path / "hf", safe_serialization=True)
    tokenizer.save_pretrained(path / "hf")
    return path


def _weights(output: Path) -> dict[str, torch.Tensor]:
    return load_file(output / "hf" / "model.safetensors")


@pytest.fixture(scope="module")
def three_smollm3(tmp_path_factory, tokenizer) -> list[Path]:
    root = tmp_path_factory.mktemp("merge_inputs")
    return [_output(root, f"m{seed}", _smollm3(tokenizer, seed), tokenizer) for seed in range(3)]


def test_linear_merge_equals_the_weighted_average(three_smollm3, tmp_path):
    weights = [0.5, 0.3, 0.2]
    metrics = merge(MergeStepConfig(weights=weights), three_smollm3, tmp_path)
    merged = _weights(tmp_path)
    parents = [_weights(p) for p in three_smollm3]
    assert set(merged) == set(parents[0]) and metrics["num_models"] == 3
    for name, tensor in merged.items():
        expected = sum(w * p[name] for w, p in zip(weights, parents, strict=True))
        torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-6)
    name = "model.layers.0.self_attn.k_proj.weight"
    assert all(not torch.equal(merged[name], p[name]) for p in parents)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # a complete folder
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template


def test_slerp_of_identical_models_is_the_identity(three_smollm3, tmp_path):
    twin = _smollm3_config(three_smollm3[0], tmp_path / "twin")  # same weights, another folder
    out = tmp_path / "out"
    out.mkdir()
    merge(MergeStepConfig(method="slerp", t=0.37), [three_smollm3[0], twin], out)
    parent = _weights(three_smollm3[0])
    for name, tensor in _weights(out).items():
        torch.testing.assert_close(tensor, parent[name], rtol=0, atol=1e-6)
    with pytest.raises(BadInputError, match="twice"):
        merge(MergeStepConfig(method="slerp"), [twin, twin], tmp_path / "again")


def test_slerp_of_two_models_interpolates_on_the_sphere(three_smollm3, tmp_path):
    """One 2-D tensor against the SLERP formula: angle between the flattened, normalized
    tensors, sin-weighted sum of the originals."""
    merge(MergeStepConfig(method="slerp", t=0.3), three_smollm3[:2], tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    a, b = _weights(three_smollm3[0])[name].double(), _weights(three_smollm3[1])[name].double()
    omega = math.acos((a / a.norm() * (b / b.norm())).sum().clamp(-1, 1).item())
    expected = (math.sin(0.7 * omega) * a + math.sin(0.3 * omega) * b) / math.sin(omega)
    torch.testing.assert_close(_weights(tmp_path)[name].double(), expected, rtol=0, atol=1e-5)


def test_ties_keeps_the_base_where_task_vectors_are_trimmed(three_smollm3, tmp_path):
    cfg = MergeStepConfig(method="ties", weights=[1.0, 1.0], density=0.2, base=1)
    merge(cfg, three_smollm3[:2], tmp_path)
    name = "model.layers.1.self_attn.q_proj.weight"
    merged, base = _weights(tmp_path)[name], _weights(three_smollm3[1])[name]
    unchanged = (merged == base).float().mean().item()
    assert 0.7 < unchanged < 0.9  # density 0.2: about 80% of the entries keep the base value


def test_weights_not_matching_the_models_fail_before_compute(three_smollm3, tmp_path):
    with pytest.raises(BadInputError, match=r"weights=\[0.9, 0.1\] has 2 entries for 3 models"):
        merge(MergeStepConfig(), three_smollm3, tmp_path)
    assert not (tmp_path / "hf").exists()


def test_other_architecture_fails_naming_the_field(three_smollm3, tiny_model_output, tmp_path):
    with pytest.raises(
        BadInputError, match="architectures: .*SmolLM3ForCausalLM.*LlamaForCausalLM"
    ):
        merge(MergeStepConfig(), [three_smollm3[0], tiny_model_output], tmp_path)
    wider = _smollm3_config(three_smollm3[1], tmp_path / "wide", intermediate_size=256)
    with pytest.raises(BadInputError, match="intermediate_size: 128 vs 256"):
        merge(MergeStepConfig(), [three_smollm3[0], wider], tmp_path)
    assert not (tmp_path / "hf").exists()


def _smollm3_config(source: Path, target: Path, **changes) -> Path:
    """A copy of a model output whose config.json differs in ``changes``."""
    (target / "hf").mkdir(parents=True)
    for path in (source / "hf").iterdir():
        (target / "hf" / path.name).write_bytes(path.read_bytes())
    config = json.loads((target / "hf" / "config.json").read_text())
    (target / "hf" / "config.json").write_text(json.dumps({**config, **changes}))
    return target


def test_other_vocabulary_fails(three_smollm3, tmp_path):
    other = _smollm3_config(three_smollm3[1], tmp_path / "other")
    tokenizer_file = other / "hf" / "tokenizer.json"
    data = json.loads(tokenizer_file.read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same size, other ids
    tokenizer_file.write_text(json.dumps(data))
    with pytest.raises(BadInputError, match="another vocabulary"):
        merge(MergeStepConfig(), [three_smollm3[0], other], tmp_path / "out")
