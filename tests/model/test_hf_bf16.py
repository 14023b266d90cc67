"""bf16 checkpoints in and out: tiny Llama, Qwen3 and SmolLM3 saved by transformers in bfloat16
(as every released checkpoint is) import with their dtype, give transformers' bf16 logits, and
export back as bf16 (weights and config.json's ``dtype``/``torch_dtype``) even after the trainer
held them in float32; a model trained from scratch exports float32, as before.

The tolerance of the bf16 parity. bf16 keeps 8 significant bits: its unit roundoff is
``u = 2**-8`` (a rounded value is within a relative ``u/2`` of the exact one, half a unit in the
last place; ``u`` is the spacing just above 1). Our model and transformers' compute the same
function in a different order (one fused q/k/v and gate/up matmul instead of three and two, our
own RoPE kernel and norms), so each rounds differently: every matmul, norm,
residual add and activation output is rounded to bf16, and the logits themselves are. A logit
of size ``|z|`` computed by a chain of ``n`` bf16 roundings can be off by about ``n * u/2 * |z|``
in the worst case; with 4 layers of roughly 10 roundings each plus the head, ``n ~ 40`` gives
``20 u |z|``; random-walk accumulation (independent errors) gives ``sqrt(n) u/2 |z| ~ 3 u |z|``.
Two such computations differ by at most the sum of their errors. We therefore require

    max |ours - theirs| <= 16 u * max |logits|      (= 0.0625 * max |logits|)

which sits between the random-walk estimate (about 6 u for the two together) and the worst case
(40 u); measured over 5 seeds of each architecture: at most 6.8 u (Qwen3: 0, the same kernels).
As a check that we are not merely inside a loose bound, our bf16 logits must be about as close
to the float32 forward of the same (bf16-valued) weights as transformers' bf16 logits are:
``max |ours - fp32| <= 1.5 * max |theirs - fp32|`` (measured: at most 1.17 times). A mapping
error (a swapped q/k, a missing norm weight, RoPE on a NoPE layer) moves logits by their own
size, 1/u = 256 times more than u.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from llmflow.model.config import preset
from llmflow.model.hf import export_hf, import_hf, load_model, save_model
from llmflow.model.hf_arch import config_from_hf, hf_config
from llmflow.model.transformer import Transformer
from llmflow.tasks.framework.errors import BadInputError
from tests.model.test_hf_import import SHAPES  # the import tests' tiny shapes

U = 2.0**-8  # bf16 unit roundoff
CASES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, dict(no_rope_layers=[1, 0, 0, 1])),
}


@torch.no_grad()
def save_bf16(name: str, folder):
    """A random transformers model of ``name`` saved in bfloat16 (1-D weights randomized too);
    returns the saved model (bf16)."""
    config_cls, model_cls, extra = CASES[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SHAPES, **extra})).eval()
    for param_name, param in model.named_parameters():
        if param.ndim == 1:  # norms start at 1: a mapping error would not show
            param.copy_(torch.randn_like(param) * 0.5 + ("norm" in param_name))
    model = model.to(torch.bfloat16)
    model.save_pretrained(folder)
    return model


def _batch():
    return torch.randint(
        0, SHAPES["vocab_size"], (2, 96), generator=torch.Generator().manual_seed(1)
    )


def _saved_dtypes(folder) -> set[str]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_checkpoint_imports_with_transformers_bf16_logits(name, tmp_path):
    saved = save_bf16(name, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert _saved_dtypes(tmp_path) == {"BF16"}

    cfg, state = import_hf(tmp_path)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}  # no silent upcast
    assert cfg.hf_dtype == "bfloat16"
    ours = Transformer(cfg).to(torch.bfloat16).eval()
    ours.load_state_dict(state)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert theirs.dtype == torch.bfloat16
    reference = type(saved).from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = _batch()
    with torch.no_grad():
        got, want, exact = ours(ids), theirs(ids).logits, reference(ids).logits
    assert got.dtype == want.dtype == torch.bfloat16
    scale = exact.abs().max().item()
    diff = (got.float() - want.float()).abs().max().item()
    theirs_err = (want.float() - exact).abs().max().item()
    ours_err = (got.float() - exact).abs().max().item()
    print(
        f"bf16 import {name}: max|logit| {scale:.2f}, max|ours - theirs| {diff:.3e} "
        f"({diff / scale / U:.2f} u max|logit|), transformers bf16 vs fp32 {theirs_err:.3e}, "
        f"ours bf16 vs fp32 {ours_err:.3e}"
    )
    assert exact.std() > 0.5  # logits well spread: the tolerance is small against them
    assert diff <= 16 * U * scale
    assert ours_err <= 1.5 * theirs_err  # as close to the float32 logits as transformers'


def _trainer_final(tmp_path, name):
    """A bf16 checkpoint imported, held in float32 by the trainer (master weights), saved as
    the trainer's final checkpoint is (``save_model``): float32 weights, our config."""
    saved = save_bf16(name, tmp_path / "source")
    cfg, state = import_hf(tmp_path / "source")
    model = Transformer(cfg)  # float32, as the trainer builds it
    model.load_state_dict(state)  # cast to float32, exactly (bf16 -> fp32 is exact)
    save_model(model, cfg, tmp_path / "final")
    return saved, cfg


@pytest.mark.parametrize("name", list(CASES))
def test_a_model_imported_from_bf16_exports_bf16(name, tmp_path):
    """Through the trainer's float32 master weights and back: the export is bf16 again, config
    and weights, transformers loads it as bf16, and its logits are the source's (bit for bit:
    bf16 -> fp32 -> bf16 is exact)."""
    saved, _ = _trainer_final(tmp_path, name)
    final = load_model(tmp_path / "final")
    assert final.embed.weight.dtype == torch.float32
    saved_cfg = json.loads((tmp_path / "final" / "model_config.json").read_text())
    assert saved_cfg["hf_dtype"] == "bfloat16"

    from llmflow.model.config import ModelConfig

    export_hf(final.state_dict(), ModelConfig(**saved_cfg), tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (config["dtype"], config["torch_dtype"]) == ("bfloat16", "bfloat16")
    assert _saved_dtypes(tmp_path / "export") == {"BF16"}
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert back.dtype == torch.bfloat16 and type(back) is type(saved)
    original = saved.state_dict()
    assert all(torch.equal(back.state_dict()[k], original[k]) for k in original)
    source = AutoModelForCausalLM.from_pretrained(tmp_path / "source").eval()  # same attention
    with torch.no_grad():
        assert torch.equal(back(_batch()).logits, source(_batch()).logits)
    # and our model loads the export back with the same bf16 logits transformers gives
    cfg, state = import_hf(tmp_path / "export")
    ours = Transformer(cfg).to(torch.bfloat16).eval()
    ours.load_state_dict(state)
    with torch.no_grad():
        got, want = ours(_batch()).float(), back(_batch()).logits.float()
    assert (got - want).abs().max() <= 16 * U * want.abs().max()


def test_a_model_trained_from_scratch_exports_float32(tmp_path):
    """No source dtype: the weights' own (the trainer's float32), as before."""
    cfg = preset("debug", vocab_size=256, num_layers=2)
    assert cfg.hf_dtype is None
    model = Transformer(cfg)
    export_hf(model.state_dict(), cfg, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["dtype"], config["torch_dtype"]) == ("float32", "float32")
    assert _saved_dtypes(tmp_path) == {"F32"}
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.dtype == torch.float32
    ids = _batch()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids), atol=1e-4, rtol=0)


def test_a_model_trained_from_scratch_exports_bf16_when_configured(tmp_path):
    """``hf_dtype='bfloat16'`` (``pretrain.train.model.overrides.hf_dtype``) on a from-scratch
    model: the float32 weights are rounded to bf16 on export, and transformers' bf16 logits
    are ours in bf16 within the tolerance of the module docstring."""
    cfg = preset("debug", vocab_size=256, num_layers=2, hf_dtype="bfloat16")
    model = Transformer(cfg).eval()
    export_hf(model.state_dict(), cfg, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert _saved_dtypes(tmp_path) == {"BF16"}
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.dtype == torch.bfloat16
    ours = model.to(torch.bfloat16)
    with torch.no_grad():
        got, want = ours(_batch()).float(), back(_batch()).logits.float()
    assert (got - want).abs().max() <= 16 * U * want.abs().max()


def test_float32_and_unset_source_dtype_export_as_the_weights(tmp_path):
    """A float32 checkpoint (or a config.json without a dtype) leaves ``hf_dtype`` unset, so the
    config round trip is unchanged; a dtype we cannot write is refused naming the field."""
    fields = hf_config(preset("debug", vocab_size=256))
    assert config_from_hf(fields).hf_dtype is None
    assert config_from_hf({**fields, "torch_dtype": "bfloat16", "dtype": None}).hf_dtype == (
        "bfloat16"
    )
    assert config_from_hf({k: v for k, v in fields.items() if "dtype" not in k}).hf_dtype is None
    with pytest.raises(BadInputError, match="dtype='int8'"):
        config_from_hf({**fields, "dtype": "int8", "torch_dtype": "int8"})
    with pytest.raises(ValueError, match="hf_dtype='fp8'"):
        preset("debug", hf_dtype="fp8")
