import pytest
import torch

from llmflow.model.config import PRESETS, ModelConfig, preset
from llmflow.model.transformer import Transformer


@pytest.mark.parametrize(
    "kwargs, field, value",
    [
        (dict(hidden_size=130, num_heads=4), "hidden_size", "130"),
        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads", "3"),
        (dict(hidden_size=12, num_heads=4, num_kv_heads=2), "head_dim", "3"),
        (dict(vocab_size=0), "vocab_size", "0"),
        (dict(nope_interval=-1), "nope_interval", "-1"),
        (dict(eos_token_id=8192), "eos_token_id", "8192"),
        (dict(eos_token_id=[2, 8192]), "eos_token_id", "8192"),
        (dict(rope_scaling={"rope_type": "ntk"}), "rope_type", "ntk"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 0.5}), "factor", "0.5"),
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
            "original_max_position_embeddings",
            "None",
        ),
        (dict(hf_model_type="mistral"), "hf_model_type", "mistral"),
        (dict(hf_model_type="qwen2"), "attention_bias", "False"),
        (dict(hf_model_type="qwen3"), "qk_norm", "False"),
        (dict(attention_bias=True), "attention_bias", "smollm3"),
        (dict(hf_model_type="llama", nope_interval=4), "nope_interval", "llama"),
        (dict(nope_layers=[4]), "nope_layers", "[4]"),
        (dict(nope_layers=[1], nope_interval=2), "nope_interval", "2"),
        (dict(explicit_head_dim=0), "explicit_head_dim", "0"),
    ],
)
def test_validation_names_field_and_value(kwargs, field, value):
    with pytest.raises(ValueError) as err:
        ModelConfig(**kwargs)
    assert field in str(err.value) and value in str(err.value)


def test_preset_rejects_unknown_name_and_field():
    with pytest.raises(ValueError, match="7b"):
        preset("7b")
    with pytest.raises(ValueError, match="num_layer"):
        preset("debug", num_layer=2)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_parameters_equals_real_model(name):
    cfg = preset(name)
    with torch.device("meta"):  # shapes only, no memory
        model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    embeddings = model.embed.weight.numel() + (
        0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    )
    assert cfg.num_parameters() == total
    assert cfg.num_parameters(non_embedding=True) == total - embeddings


@pytest.mark.parametrize(
    "name, low, high",
    [
        ("debug", 1.5e6, 2.5e6),
        ("135m", 125e6, 145e6),
        ("360m", 350e6, 370e6),
        ("1.7b", 1.6e9, 1.8e9),
        ("3b", 2.9e9, 3.2e9),
    ],
)
def test_preset_sizes_match_their_names(name, low, high):
    assert low <= preset(name).num_parameters() <= high


def test_untied_and_qk_norm_counts():
    cfg = ModelConfig(tie_embeddings=False, qk_norm=True)
    model = Transformer(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())


def test_nope_layers_follow_smollm3_convention():
    cfg = ModelConfig(num_layers=8, nope_interval=4)
    assert [cfg.uses_rope(i) for i in range(8)] == [1, 1, 1, 0, 1, 1, 1, 0]
    assert all(ModelConfig(num_layers=8).uses_rope(i) for i in range(8))


def test_added_fields_stay_out_of_the_pretrain_hash_at_their_default():
    """Fields added for imported models keep every earlier model's step hash."""
    from llmflow.tasks.framework.hashing import versioned_fields
    from llmflow.tasks.pretrain.config import ModelSpec

    added = {"attention_bias", "explicit_head_dim", "nope_layers", "hf_model_type"}
    assert not added & set(versioned_fields(ModelSpec())["overrides"])
    spec = ModelSpec(overrides={"hf_model_type": "qwen2", "attention_bias": True})
    assert versioned_fields(spec)["overrides"]["attention_bias"] is True


def test_checkpoint_written_before_the_added_fields_is_the_same_architecture(tmp_path):
    import dataclasses
    import json

    from llmflow.tasks.pretrain.checkpoint import check_same_architecture

    cfg = ModelConfig()
    old = dataclasses.asdict(cfg)
    for name in ("attention_bias", "explicit_head_dim", "nope_layers", "hf_model_type"):
        del old[name]
    (tmp_path / "model_config.json").write_text(json.dumps(old))
    check_same_architecture(tmp_path, cfg)  # no error
    with pytest.raises(ValueError, match="hf_model_type"):
        check_same_architecture(tmp_path, ModelConfig(hf_model_type="llama"))


def test_explicit_head_dim_and_bias_shape_the_model():
    cfg = ModelConfig(
        hidden_size=64, num_heads=4, num_kv_heads=2, explicit_head_dim=32, qk_norm=True,
        hf_model_type="qwen3",
    )  # fmt: skip
    model = Transformer(cfg)
    assert model.layers[0].attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 32, 64)
    assert model.layers[0].attn.o_proj.weight.shape == (64, 4 * 32)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    biased = ModelConfig(attention_bias=True, hf_model_type="qwen2")
    model = Transformer(biased)
    assert model.layers[0].attn.qkv_proj.bias.abs().sum() == 0  # starts at 0
    assert biased.num_parameters() == sum(p.numel() for p in model.parameters())
