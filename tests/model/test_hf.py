import json

import pytest
import torch
from transformers import AutoModelForCausalLM, SmolLM3Config, SmolLM3ForCausalLM

from llmflow.model.config import ModelConfig, preset
from llmflow.model.hf import export_hf, hf_config, import_hf, load_model, save_model
from llmflow.model.transformer import Transformer

TINY = dict(vocab_size=300, hidden_size=64, num_heads=4, intermediate_size=96, max_seq_len=128)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def _export_and_load(cfg: ModelConfig, tmp_path, seed: int = 0):
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    export_hf(model.state_dict(), cfg, tmp_path)
    return model, AutoModelForCausalLM.from_pretrained(tmp_path).eval()


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_layers=3, num_kv_heads=4, nope_interval=0, tie_embeddings=True),  # Llama-like MHA
        dict(num_layers=4, num_kv_heads=2, nope_interval=4, tie_embeddings=True),  # SmolLM3 NoPE
        dict(num_layers=4, num_kv_heads=1, nope_interval=2, tie_embeddings=False),  # MQA, untied
        dict(num_layers=2, num_kv_heads=2, rope_theta=2e6, bos_token_id=1, eos_token_id=2),
    ],
)
def test_logits_match_transformers(overrides, tmp_path):
    cfg = ModelConfig(**{**TINY, **overrides})
    model, hf = _export_and_load(cfg, tmp_path)
    assert isinstance(hf, SmolLM3ForCausalLM)
    input_ids = torch.randint(0, cfg.vocab_size, (2, 50))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids), hf(input_ids).logits, atol=1e-4, rtol=0)


def test_yarn_model_logits_match_transformers(tmp_path):
    cfg = ModelConfig(**{**TINY, "num_layers": 2, "nope_interval": 2, "rope_scaling": YARN})
    model, hf = _export_and_load(cfg, tmp_path)
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    assert hf.config.rope_parameters["factor"] == 4.0
    input_ids = torch.randint(0, cfg.vocab_size, (1, 120))  # past the original 32 positions
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids), hf(input_ids).logits, atol=1e-4, rtol=0)
    # The scaling is really in effect: the same weights without YaRN give other logits.
    plain = Transformer(ModelConfig(**{**TINY, "num_layers": 2, "nope_interval": 2})).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (plain(input_ids) - model(input_ids)).abs().max() > 1e-3


def test_packed_position_ids_match_transformers(tmp_path):
    """transformers also treats restarting position_ids as separate documents (without a cache)."""
    cfg = ModelConfig(**{**TINY, "num_layers": 2})
    model, hf = _export_and_load(cfg, tmp_path)
    input_ids = torch.randint(0, cfg.vocab_size, (2, 12))
    position_ids = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])
    with torch.no_grad():
        ours = model(input_ids, position_ids=position_ids)
        theirs = hf(input_ids, position_ids=position_ids, use_cache=False).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_export_import_round_trip(tie, tmp_path):
    cfg = ModelConfig(
        **{
            **TINY,
            "num_layers": 3,
            "nope_interval": 3,
            "tie_embeddings": tie,
            "rope_scaling": YARN,
        },
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    export_hf(model.state_dict(), cfg, tmp_path)
    cfg_back, state_back = import_hf(tmp_path)
    assert cfg_back == cfg
    original = model.state_dict()
    assert state_back.keys() == original.keys()
    assert all(torch.equal(state_back[k], original[k]) for k in original)


def test_pad_token_falls_back_to_eos_then_zero():
    assert hf_config(ModelConfig(eos_token_id=5))["pad_token_id"] == 5
    assert hf_config(ModelConfig())["pad_token_id"] == 0


def test_qk_norm_export_is_refused(tmp_path):
    cfg = ModelConfig(**TINY, qk_norm=True)
    with pytest.raises(ValueError, match="qk_norm"):
        export_hf(Transformer(cfg).state_dict(), cfg, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_export_writes_generation_config_and_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(["hello world, a tiny corpus for a tiny tokenizer"] * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(tmp_path / "tok")
    cfg = ModelConfig(**TINY, num_layers=1, bos_token_id=1, eos_token_id=2)
    export_hf(Transformer(cfg).state_dict(), cfg, tmp_path / "hf", tokenizer_dir=tmp_path / "tok")
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    loaded = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert loaded("hello world")["input_ids"] == fast("hello world")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.generation_config.eos_token_id == 2


def test_bf16_export_keeps_dtype(tmp_path):
    cfg = ModelConfig(**TINY, num_layers=1)
    model = Transformer(cfg).to(torch.bfloat16)
    export_hf(model.state_dict(), cfg, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    _, state = import_hf(tmp_path)
    assert state["embed.weight"].dtype == torch.bfloat16


def test_save_and_load_own_format(tmp_path):
    cfg = ModelConfig(**TINY, num_layers=2, qk_norm=True, tie_embeddings=False)
    model = Transformer(cfg)
    save_model(model, cfg, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.cfg == cfg
    input_ids = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids), model(input_ids))


@pytest.mark.parametrize("name", ["135m", "3b"])
def test_preset_parameter_count_matches_transformers(name):
    cfg = preset(name)
    config = SmolLM3Config(**{k: v for k, v in hf_config(cfg).items() if k != "dtype"})
    with torch.device("meta"):
        hf = SmolLM3ForCausalLM(config)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_import_checkpoints_saved_by_transformers(tmp_path):
    """Configs written by transformers itself (Llama and SmolLM3) import with equal logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shapes = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    for name, model in [
        ("llama", LlamaForCausalLM(LlamaConfig(**shapes, tie_word_embeddings=False))),
        ("smollm3", SmolLM3ForCausalLM(SmolLM3Config(**shapes, no_rope_layer_interval=2))),
    ]:
        model.save_pretrained(tmp_path / name)
        cfg, state = import_hf(tmp_path / name)
        ours = Transformer(cfg).eval()
        ours.load_state_dict(state)
        input_ids = torch.randint(0, 300, (2, 20))
        with torch.no_grad():
            torch.testing.assert_close(
                ours(input_ids), model.eval()(input_ids).logits, atol=1e-4, rtol=0
            )


@pytest.mark.parametrize("name", ["135m", "360m", "3b"])
def test_preset_shapes_match_transformers(name, tmp_path):
    """Real head counts (9/3, 15/5, 16/4) and NoPE settings, cut to 4 layers and a small vocab."""
    small = dict(num_layers=4, vocab_size=512, intermediate_size=256)
    if name == "3b":
        small["hidden_size"] = 512  # keeps 16 / 4 heads, at head_dim 32
    cfg = preset(name, **small)
    model, hf = _export_and_load(cfg, tmp_path)
    input_ids = torch.randint(0, 512, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids), hf(input_ids).logits, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_full_135m_preset_matches_transformers(tmp_path):
    cfg = preset("135m")
    model, hf = _export_and_load(cfg, tmp_path)
    input_ids = torch.randint(0, cfg.vocab_size, (1, 64))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids), hf(input_ids).logits, atol=1e-4, rtol=0)
