"""Models built with transformers' own classes import with equal logits and export back as the
same class; what does not map fails before any tensor is read, naming the config field."""

import json
import shutil
import time

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from llmflow.model.hf import export_hf, import_hf
from llmflow.model.transformer import Transformer
from llmflow.tasks.framework.errors import BadInputError

SHAPES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.1,  # larger than the default, so logits spread well past the tolerance
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
YARN = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
        "original_max_position_embeddings": 64}  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
CASES = {
    # untied, YaRN RoPE
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, rope_parameters=YARN)),
    # q/k/v bias (made non-zero below), tied, another RoPE base
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
    # Llama 3.1's RoPE, tied (as Llama 3.2 1B), several end-of-sequence ids (as its Instruct)
    "llama-llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(tie_word_embeddings=True, rope_parameters=LLAMA3, eos_token_id=[2, 3]),
    ),
    # linear RoPE scaling
    "qwen2-linear": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
    ),
    # per-head q/k RMSNorm, head_dim (32) != hidden_size / num_attention_heads (16)
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
    # NoPE layers in a pattern no interval gives
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, dict(no_rope_layers=[1, 0, 0, 1])),
    # SmolLM3's own every-4th-layer pattern
    "smollm3-interval": (SmolLM3Config, SmolLM3ForCausalLM, dict(no_rope_layer_interval=2)),
}


@torch.no_grad()
def _tiny(name: str, folder):
    """A random transformers model of `name`, saved to `folder`; 1-D weights randomized too."""
    config_cls, model_cls, extra = CASES[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SHAPES, **extra})).eval()
    for param_name, param in model.named_parameters():
        if param.ndim == 1:  # norms start at 1 and biases at 0: a mapping error would not show
            param.copy_(torch.randn_like(param) * 0.5 + ("norm" in param_name))
    model.save_pretrained(folder)
    return model


def _batch():
    return torch.randint(
        0, SHAPES["vocab_size"], (2, 96), generator=torch.Generator().manual_seed(1)
    )


def _ours(folder):
    cfg, state = import_hf(folder)
    model = Transformer(cfg).eval()
    model.load_state_dict(state)
    return cfg, model


@pytest.mark.parametrize("name", list(CASES))
def test_import_logits_match_transformers(name, tmp_path):
    theirs = _tiny(name, tmp_path)
    cfg, ours = _ours(tmp_path)
    input_ids = _batch()
    with torch.no_grad():
        expected, got = theirs(input_ids).logits, ours(input_ids)
    diff = (got - expected).abs().max().item()
    print(f"import parity {name}: max |logits diff| = {diff:.2e} (logits std {expected.std():.2f})")
    assert expected.std() > 0.1  # the tolerance is small against the logits
    assert diff < 1e-4
    assert cfg.hf_model_type == name.split("-")[0]


def test_import_maps_each_feature(tmp_path):
    """Each architecture's feature lands in its ModelConfig field (not only equal logits)."""
    found = {}
    for name in CASES:
        _tiny(name, tmp_path / name)
        found[name], _ = import_hf(tmp_path / name)
    assert found["qwen2"].attention_bias and found["qwen2"].tie_embeddings
    assert found["qwen3"].qk_norm and found["qwen3"].head_dim == 32
    assert found["smollm3"].nope_layers == [1, 2] and found["smollm3"].nope_interval == 0
    assert found["smollm3-interval"].nope_interval == 2
    assert found["llama"].rope_scaling["rope_type"] == "yarn"
    assert found["llama"].rope_theta == 500000.0 and not found["llama"].tie_embeddings


@pytest.mark.parametrize("name", list(CASES))
def test_export_round_trip_is_the_original_class(name, tmp_path):
    theirs = _tiny(name, tmp_path / "original")
    cfg, ours = _ours(tmp_path / "original")
    export_hf(ours.state_dict(), cfg, tmp_path / "export")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(back) is type(theirs)
    input_ids = _batch()
    with torch.no_grad():
        diff = (back(input_ids).logits - theirs(input_ids).logits).abs().max().item()
    print(f"export round trip {name}: max |logits diff| = {diff:.2e}")
    assert diff < 1e-5
    # The same config, but for bookkeeping keys and Qwen's unused window layer count.
    skip = {"transformers_version", "_name_or_path", "max_window_layers"}
    original, exported = theirs.config.to_dict(), back.config.to_dict()
    differ = {k for k in original.keys() | exported.keys() if original.get(k) != exported.get(k)}
    assert differ <= skip, {k: (original.get(k), exported.get(k)) for k in differ - skip}
    # and the same tensors, bit for bit
    back_state, original_state = back.state_dict(), theirs.state_dict()
    assert back_state.keys() == original_state.keys()
    assert all(torch.equal(back_state[k], original_state[k]) for k in original_state)


def _raises(folder, *fragments):
    start = time.perf_counter()
    with pytest.raises(BadInputError) as err:
        import_hf(folder)
    assert time.perf_counter() - start < 10
    for fragment in fragments:
        assert fragment in str(err.value)


def _save(model, folder):
    model.save_pretrained(folder)
    return folder


def test_other_mixtures_of_experts_are_refused(tmp_path):
    """Qwen3-MoE and Mixtral import (tests/model/test_hf_moe.py); another mixture is refused
    naming its expert count and the classes that do map."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    small = {k: v for k, v in SHAPES.items() if k != "initializer_range"}
    qwen2 = Qwen2MoeForCausalLM(Qwen2MoeConfig(**small, num_experts=4, moe_intermediate_size=32))
    folder = _save(qwen2, tmp_path / "qwen2moe")
    saved = json.loads((folder / "config.json").read_text())  # which name transformers writes
    field = "num_experts" if "num_experts" in saved else "num_local_experts"
    _raises(folder, f"{field}=4", "mixture-of-experts", "Qwen3MoeForCausalLM")


def test_sliding_window_is_refused(tmp_path):
    config = Qwen2Config(**SHAPES, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    folder = _save(Qwen2ForCausalLM(config), tmp_path)
    _raises(folder, "sliding_attention", "sliding_window=16", "use_sliding_window=True")


def test_sliding_window_on_no_layer_imports(tmp_path):
    """Qwen slides only from layer max_window_layers on; past the last layer it is full attention."""
    config = Qwen2Config(**SHAPES, use_sliding_window=True, sliding_window=16, max_window_layers=4)
    theirs = _save(Qwen2ForCausalLM(config).eval(), tmp_path)
    _, ours = _ours(theirs)
    model = AutoModelForCausalLM.from_pretrained(theirs).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(_batch()), model(_batch()).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "model_cls, config, message",
    [
        (LlamaForCausalLM, LlamaConfig(**SHAPES, mlp_bias=True), "mlp_bias=True"),
        (LlamaForCausalLM, LlamaConfig(**SHAPES, attention_bias=True), "attention_bias=True"),
        (LlamaForCausalLM, LlamaConfig(**SHAPES, hidden_act="gelu"), "hidden_act='gelu'"),
        (  # SmolLM3 slides the window on its NoPE layers
            SmolLM3ForCausalLM,
            SmolLM3Config(**SHAPES, use_sliding_window=True, sliding_window=8),
            "sliding_window=8",
        ),
    ],
)
def test_layers_we_do_not_have_are_refused(model_cls, config, message, tmp_path):
    _raises(_save(model_cls(config), tmp_path), message)


def test_weights_of_another_shape_are_refused(tmp_path):
    _tiny("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    _raises(tmp_path, "mlp.down_proj.weight has shape [64, 128], config.json implies [64, 96]")


def test_unimplemented_rope_scaling_is_refused(tmp_path):
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    folder = _save(LlamaForCausalLM(LlamaConfig(**SHAPES, rope_parameters=rope)), tmp_path)
    _raises(folder, "rope_parameters.rope_type='dynamic'")


def test_unknown_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4))
    _raises(_save(gpt2, tmp_path), "architectures=['GPT2LMHeadModel']", "not supported")


def test_sequence_classification_is_refused(tmp_path):
    model = LlamaForSequenceClassification(LlamaConfig(**SHAPES, num_labels=3))
    _raises(_save(model, tmp_path), "LlamaForSequenceClassification", "not a causal language model")


def test_folder_without_weights_is_refused(tmp_path):
    _tiny("llama", tmp_path / "full")
    (tmp_path / "bare").mkdir()
    shutil.copy(tmp_path / "full" / "config.json", tmp_path / "bare" / "config.json")
    _raises(tmp_path / "bare", "has no weights", "model.safetensors")
    _raises(tmp_path / "missing", "no such folder")
    (tmp_path / "bare" / "config.json").unlink()
    _raises(tmp_path / "bare", "has no config.json")


def test_vocab_size_disagreeing_with_the_embedding_is_refused(tmp_path):
    _tiny("qwen2", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    _raises(tmp_path, "vocab_size=300", "model.embed_tokens.weight has 256 rows")


def test_pickle_checkpoint_imports(tmp_path):
    """A folder with pytorch_model.bin instead of safetensors imports the same."""
    theirs = _tiny("qwen3", tmp_path / "st")
    (tmp_path / "bin").mkdir()
    shutil.copy(tmp_path / "st" / "config.json", tmp_path / "bin" / "config.json")
    torch.save(theirs.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    cfg_st, state_st = import_hf(tmp_path / "st")
    cfg_bin, state_bin = import_hf(tmp_path / "bin")
    assert cfg_bin == cfg_st
    assert all(torch.equal(state_bin[k], state_st[k]) for k in state_st)


def test_sharded_checkpoint_imports(tmp_path):
    """A checkpoint saved in shards (model.safetensors.index.json) imports the same."""
    theirs = _tiny("qwen2", tmp_path / "one")
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    cfg_one, state_one = import_hf(tmp_path / "one")
    cfg_sharded, state_sharded = import_hf(tmp_path / "sharded")
    assert cfg_sharded == cfg_one
    assert state_sharded.keys() == state_one.keys()
    assert all(torch.equal(state_sharded[k], state_one[k]) for k in state_one)
    sorted((tmp_path / "sharded").glob("*.safetensors"))[-1].unlink()
    _raises(tmp_path / "sharded", "lists shards that are missing")


def _released(num_layers: int, **fields) -> dict:
    common = dict(hidden_act="silu", rms_norm_eps=1e-6, attention_dropout=0.0, use_cache=True)
    return {**common, "num_hidden_layers": num_layers, **fields}


# The shape fields of released models' config.json files.
RELEASED = {
    "SmolLM3-3B": _released(
        36, architectures=["SmolLM3ForCausalLM"], model_type="smollm3", vocab_size=128256,
        hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=4,
        max_position_embeddings=65536, rope_theta=5e6, rope_scaling=None,
        no_rope_layers=[int((i + 1) % 4 != 0) for i in range(36)], no_rope_layer_interval=4,
        use_sliding_window=False, sliding_window=None, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=128012, pad_token_id=128004,
    ),
    "Llama-3.2-1B": _released(
        16, architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, max_position_embeddings=131072, rope_theta=5e5, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
    ),
    "Qwen2.5-0.5B": _released(
        24, architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936,
        hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1e6, use_sliding_window=False,
        sliding_window=32768, max_window_layers=24, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151643,
    ),
    "Qwen3-0.6B": _released(
        28, architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
        hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rope_theta=1e6, rope_scaling=None,
        use_sliding_window=False, sliding_window=None, max_window_layers=28,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_configs_map_to_transformers_shapes(name):
    """Each released config maps to tensors of transformers' shapes, and its export maps back."""
    from transformers import AutoConfig

    from llmflow.model.hf import _expected_shapes
    from llmflow.model.hf_arch import config_from_hf, hf_config

    cfg = config_from_hf(RELEASED[name])
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**RELEASED[name]))
    shapes = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    if cfg.tie_embeddings:
        del shapes["lm_head.weight"]
    assert _expected_shapes(cfg) == shapes
    assert cfg.num_parameters() == sum(p.numel() for p in theirs.parameters())
    assert config_from_hf(hf_config(cfg)) == cfg
