"""Mixtures of experts in and out: tiny Qwen3MoeForCausalLM and MixtralForCausalLM built by
transformers (random weights, a router that routes unevenly) import with transformers' logits and
routing, export back as the same class in the Hub's per-expert layout, and what the classes
cannot express is refused naming the field.

The bf16 tolerance is test_hf_bf16's (``16 u max|logit|``, its docstring derives it): a sparse
layer adds the router (one matmul, a softmax in float32, the top-k weights) and the experts'
matmul pair to the chain of roundings, about as many roundings as a dense SwiGLU, so the same
``n ~ 40`` bound holds. One thing a dense model cannot do: two computations that differ by
rounding can choose different experts for a token whose k-th and (k+1)-th router scores are
closer than that rounding; that token's expert output then differs by its own size, and every
later position of its sequence reads it through attention: a difference no roundoff bound
covers. It happens to transformers' own bf16 forward against its float32 one just as often
(measured: 1-3% of the token-layer routes, ours against transformers' bf16 0.5-3.9%). So the
bf16 test asserts the bound on the positions whose sequence up to them both models routed alike
in every layer (measured: at most 9.5 u on 35-88% of the positions), that the routes differ no
more than twice as often as transformers' bf16 routes differ from its float32 ones (measured: at
most 1.25 times), and that, routing changes included, our bf16 logits are as close to the
float32 forward as transformers' bf16 logits are (mean and max, within 1.5 times; measured: at
most 1.11 times).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from llmflow.model.config import ModelConfig, preset
from llmflow.model.hf import _expected_shapes, export_hf, import_hf
from llmflow.model.hf_arch import config_from_hf, hf_config
from llmflow.model.moe import Router
from llmflow.model.transformer import Transformer
from llmflow.tasks.framework.errors import BadInputError
from tests.model.test_hf_bf16 import U  # bf16 unit roundoff
from tests.model.test_hf_import import SHAPES, _batch, _ours

EAGER = {
    "experts_implementation": "eager"
}  # transformers' per-expert loop (CPU default: grouped_mm)
CASES = {
    # a dense layer (mlp_only_layers) of another width than the experts; renormalised top-k
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
             norm_topk_prob=True, head_dim=32, tie_word_embeddings=False),
    ),
    # top-k weights as they are (Qwen3-MoE's class default), every other layer sparse, tied
    "qwen3_moe-unnormalised": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, decoder_sparse_step=2,
             norm_topk_prob=False, head_dim=16, tie_word_embeddings=True),
    ),
    # every layer sparse, experts of width intermediate_size, softmax over the top-k logits
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
    ),
}  # fmt: skip
ROUTER_STD = 0.3  # router logits of a few units: top-k choices differ from token to token


@torch.no_grad()
def tiny_moe(name: str, folder=None, dtype: torch.dtype = torch.float32):
    """A random transformers mixture of experts of `name` (1-D weights randomized, the router
    redrawn at `ROUTER_STD`), saved to `folder` when given, in `dtype`."""
    config_cls, model_cls, extra = CASES[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SHAPES, **extra}, **EAGER)).eval()
    for param_name, param in model.named_parameters():
        if param.ndim == 1:  # norms start at 1: a mapping error would not show
            param.copy_(torch.randn_like(param) * 0.5 + ("norm" in param_name))
        if param_name.endswith("mlp.gate.weight"):
            param.normal_(0.0, ROUTER_STD)
    model = model.to(dtype)
    if folder is not None:
        model.save_pretrained(folder)
    return model


def _their_routes(model, input_ids) -> list[torch.Tensor]:
    """transformers' top-k expert ids of every sparse layer, (layers, tokens, k), sorted."""
    found = []
    hooks = [
        module.register_forward_hook(lambda m, i, out: found.append(out[2].sort(-1).values))
        for name, module in model.named_modules()
        if name.endswith("mlp.gate")
    ]
    with torch.no_grad():
        logits = model(input_ids).logits
    for hook in hooks:
        hook.remove()
    return logits, torch.stack(found)


def _our_routes(model, input_ids) -> tuple[torch.Tensor, torch.Tensor]:
    found = []
    hooks = [
        module.register_forward_hook(lambda m, i, out: found.append(out[2].sort(-1).values))
        for module in model.modules()
        if isinstance(module, Router)
    ]
    with torch.no_grad():
        logits = model(input_ids)
    for hook in hooks:
        hook.remove()
    return logits, torch.stack(found)


def _saved_names(folder) -> set[str]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("name", list(CASES))
def test_import_logits_and_routing_match_transformers(name, tmp_path):
    theirs = tiny_moe(name, tmp_path)
    cfg, ours = _ours(tmp_path)
    assert cfg.hf_model_type == name.split("-")[0]
    ids = _batch()
    expected, their_routes = _their_routes(theirs, ids)
    got, our_routes = _our_routes(ours, ids)
    diff = (got - expected).abs().max().item()
    used = [route.unique().numel() for route in our_routes]
    print(
        f"import parity {name}: max |logits diff| = {diff:.2e} (logits std {expected.std():.2f}); "
        f"experts used per sparse layer {used} of {cfg.num_experts}"
    )
    assert torch.equal(our_routes, their_routes)  # the same experts for every token and layer
    # the routing is not trivial: every expert gets tokens, and tokens differ in their choice
    assert used == [cfg.num_experts] * len(used)
    assert all(route.unique(dim=0).shape[0] > cfg.num_experts for route in our_routes)
    assert expected.std() > 0.1  # the tolerance is small against the logits
    assert diff < 1e-4


def test_import_maps_each_moe_field(tmp_path):
    found = {}
    for name in CASES:
        tiny_moe(name, tmp_path / name)
        found[name], _ = import_hf(tmp_path / name)
    qwen, plain, mixtral = found["qwen3_moe"], found["qwen3_moe-unnormalised"], found["mixtral"]
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.expert_size) == (8, 2, 32)
    assert qwen.mlp_only_layers == [1] and qwen.norm_topk_prob and qwen.qk_norm
    assert [qwen.is_sparse(i) for i in range(4)] == [True, False, True, True]
    assert plain.decoder_sparse_step == 2 and not plain.norm_topk_prob
    assert [plain.is_sparse(i) for i in range(4)] == [False, True, False, True]
    assert (mixtral.num_experts, mixtral.expert_size, mixtral.norm_topk_prob) == (8, 128, True)
    assert not mixtral.qk_norm and all(mixtral.is_sparse(i) for i in range(4))
    for cfg in found.values():  # transformers' class default, which Qwen trains with
        assert cfg.router_aux_loss_coef == 0.001 and cfg.n_shared_experts == 0


@pytest.mark.parametrize("name", list(CASES))
def test_export_round_trip_is_the_original_class_in_the_hub_layout(name, tmp_path):
    theirs = tiny_moe(name, tmp_path / "original")
    cfg, ours = _ours(tmp_path / "original")
    export_hf(ours.state_dict(), cfg, tmp_path / "export")
    # what transformers' save_pretrained writes (and the Hub's checkpoints hold): per expert
    assert _saved_names(tmp_path / "export") == _saved_names(tmp_path / "original")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export", **EAGER).eval()
    assert type(back) is type(theirs)
    ids = _batch()
    with torch.no_grad():
        diff = (back(ids).logits - theirs(ids).logits).abs().max().item()
    print(f"export round trip {name}: max |logits diff| = {diff:.2e}")
    assert diff < 1e-5
    skip = {"transformers_version", "_name_or_path"}
    original, exported = theirs.config.to_dict(), back.config.to_dict()
    differ = {k for k in original.keys() | exported.keys() if original.get(k) != exported.get(k)}
    if original.get("head_dim") is None:  # Mixtral's default: hidden / heads, which we write
        assert exported["head_dim"] == original["hidden_size"] // original["num_attention_heads"]
        skip.add("head_dim")
    assert differ <= skip, {k: (original.get(k), exported.get(k)) for k in differ - skip}
    back_state, original_state = back.state_dict(), theirs.state_dict()
    assert back_state.keys() == original_state.keys()
    assert all(torch.equal(back_state[k], original_state[k]) for k in original_state)
    # and the export imports to the same config
    assert import_hf(tmp_path / "export")[0] == cfg


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_fused_experts_import_the_same(name, tmp_path):
    """transformers 5's in-memory layout (3-D `mlp.experts.gate_up_proj`, Mixtral's router as
    `mlp.gate`), as a `torch.save` or a plain safetensors file of its state dict holds it."""
    theirs = tiny_moe(name, tmp_path / "hub")
    fused = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    cfg_hub, state_hub = import_hf(tmp_path / "hub")
    for folder, write in (
        ("bin", lambda f: torch.save(fused, f / "pytorch_model.bin")),
        ("st", lambda f: save_file(fused, f / "model.safetensors", {"format": "pt"})),
    ):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(
            (tmp_path / "hub" / "config.json").read_text()
        )
        write(tmp_path / folder)
        cfg, state = import_hf(tmp_path / folder)
        assert cfg == cfg_hub and state.keys() == state_hub.keys()
        assert all(torch.equal(state[k], state_hub[k]) for k in state_hub)


def _rerouted(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(layers, tokens, k) routes of two models -> (tokens,) whether some layer differs."""
    return (a != b).any(-1).any(0)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_bf16_checkpoint_imports_with_transformers_bf16_logits(name, tmp_path):
    """The tolerance and why some tokens are left out of it: the module docstring."""
    saved = tiny_moe(name, tmp_path, torch.bfloat16)
    cfg, state = import_hf(tmp_path)
    assert cfg.hf_dtype == "bfloat16"
    assert state["embed.weight"].dtype == state["layers.0.mlp.experts.gate_up_proj"].dtype
    assert state["embed.weight"].dtype == torch.bfloat16
    ours = Transformer(cfg).to(torch.bfloat16).eval()
    ours.load_state_dict(state)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, **EAGER).eval()
    assert theirs.dtype == torch.bfloat16
    reference = type(saved).from_pretrained(tmp_path, dtype=torch.float32, **EAGER).eval()
    ids = torch.randint(
        0, SHAPES["vocab_size"], (16, 32), generator=torch.Generator().manual_seed(1)
    )
    want, their_routes = _their_routes(theirs, ids)
    got, our_routes = _our_routes(ours, ids)
    exact, exact_routes = _their_routes(reference, ids)
    got, want, scale = got.float(), want.float(), exact.abs().max().item()
    # a position is clean when no token up to it (attention reads them all) was routed
    # differently by the two models in any layer
    rerouted = _rerouted(our_routes, their_routes).view(ids.shape)
    clean = rerouted.int().cumsum(-1) == 0
    flips = (our_routes != their_routes).any(-1).float().mean().item()
    their_flips = (their_routes != exact_routes).any(-1).float().mean().item()
    err = (got - want).abs().amax(-1)  # (B, T)
    diff, diff_clean = err.max().item(), err[clean].max().item()
    ours_err, theirs_err = (got - exact).abs(), (want - exact).abs()
    print(
        f"bf16 import {name}: max|logit| {scale:.2f}; max|ours - theirs| on clean positions "
        f"({clean.float().mean():.0%}) {diff_clean:.3e} = {diff_clean / scale / U:.2f} u "
        f"max|logit|, on all {diff:.3e}; other experts chosen for {flips:.2%} of the token-layer "
        f"routes (transformers bf16 vs its fp32: {their_flips:.2%}); |bf16 - fp32| mean/max "
        f"ours {ours_err.mean():.4f}/{ours_err.max():.3f}, "
        f"transformers {theirs_err.mean():.4f}/{theirs_err.max():.3f}"
    )
    assert exact.std() > 0.5
    assert clean.float().mean() >= 0.25  # the bound below is tested on many positions
    assert diff_clean <= 16 * U * scale
    # routes differ between the two no more often than bf16 changes transformers' own routes
    assert 0 < their_flips and flips <= 2 * their_flips
    # and, routing changes included, ours is as close to the float32 logits as transformers'
    assert ours_err.mean() <= 1.5 * theirs_err.mean()
    assert ours_err.max() <= 1.5 * theirs_err.max()


def test_a_bf16_moe_exports_bf16_through_float32_master_weights(tmp_path):
    saved = tiny_moe("qwen3_moe", tmp_path / "source", torch.bfloat16)
    cfg, state = import_hf(tmp_path / "source")
    model = Transformer(cfg)  # float32, as the trainer holds it
    model.load_state_dict(state)
    export_hf(model.state_dict(), cfg, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (config["dtype"], config["torch_dtype"]) == ("bfloat16", "bfloat16")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export", **EAGER).eval()
    original = saved.state_dict()
    assert back.dtype == torch.bfloat16
    assert all(torch.equal(back.state_dict()[k], original[k]) for k in original)


# ----------------------------------------------------------------------------- refusals
def _refused(folder, *fragments):
    with pytest.raises(BadInputError) as err:
        import_hf(folder)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_router_jitter_noise_is_refused(tmp_path):
    config_cls, model_cls, extra = CASES["mixtral"]
    model = model_cls(config_cls(**SHAPES, **extra, router_jitter_noise=0.1))
    model.save_pretrained(tmp_path)
    _refused(tmp_path, "router_jitter_noise=0.1")


@pytest.mark.parametrize(
    "name, field, value, message",
    [
        ("qwen3_moe", "shared_expert_intermediate_size", 64, "shared_expert_intermediate_size=64"),
        ("mixtral", "sliding_window", 32, "sliding_window=32"),
        ("qwen3_moe", "num_experts_per_tok", 9, "num_experts_per_tok=9"),
    ],
)
def test_fields_that_do_not_map_are_refused(name, field, value, message, tmp_path):
    tiny_moe(name, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    _refused(tmp_path, message)


def test_other_mixtures_of_experts_are_refused(tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    model = Qwen2MoeForCausalLM(
        Qwen2MoeConfig(**SHAPES, num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2)
    )
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    field = "num_experts" if "num_experts" in saved else "num_local_experts"
    _refused(tmp_path, f"{field}=4", "Qwen2MoeForCausalLM", "MixtralForCausalLM")


def test_a_non_zero_expert_bias_is_refused_on_export(tmp_path):
    tiny_moe("qwen3_moe", tmp_path / "original")
    cfg, ours = _ours(tmp_path / "original")
    with torch.no_grad():
        ours.layers[2].mlp.router.expert_bias.copy_(torch.linspace(-0.01, 0.02, cfg.num_experts))
    with pytest.raises(ValueError, match=r"layer 2: router.expert_bias .*\[-0.01, 0.02\]"):
        export_hf(ours.state_dict(), cfg, tmp_path / "export")
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
        (dict(n_shared_experts=1), "n_shared_experts=1"),
        (dict(hf_model_type="mixtral", qk_norm=False, first_k_dense_replace=1),
         "first_k_dense_replace=1"),
        (dict(hf_model_type="mixtral", qk_norm=False, mlp_only_layers=[0]), "mlp_only_layers=[0]"),
        (dict(hf_model_type="mixtral", qk_norm=False, norm_topk_prob=False), "norm_topk_prob=False"),
    ],
)  # fmt: skip
def test_what_the_class_cannot_express_is_refused_on_export(overrides, message, tmp_path):
    fields = dict(vocab_size=256, num_layers=2, hf_model_type="qwen3_moe", qk_norm=True)
    cfg = preset("moe-debug", **{**fields, "router_bias_update_rate": 0.0, **overrides})
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        export_hf(Transformer(cfg).state_dict(), cfg, tmp_path)


def test_first_dense_layers_export_as_qwen_dense_only_layers(tmp_path):
    """DeepSeek's first_k_dense_replace is Qwen3-MoE's mlp_only_layers: the same model."""
    cfg = preset("moe-debug", vocab_size=256, num_layers=3, hf_model_type="qwen3_moe",
                 qk_norm=True, first_k_dense_replace=1)  # fmt: skip
    model = Transformer(cfg).eval()
    export_hf(model.state_dict(), cfg, tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, **EAGER).eval()
    assert back.config.mlp_only_layers == [0]
    with torch.no_grad():
        torch.testing.assert_close(back(_batch()).logits, model(_batch()), atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- released shapes
def _released(**fields) -> dict:
    common = dict(hidden_act="silu", rms_norm_eps=1e-6, attention_dropout=0.0, use_cache=True)
    return {**common, **fields}


# The shape fields of released models' config.json files.
RELEASED = {
    "Qwen3-30B-A3B": _released(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=40960, rope_theta=1e6, rope_scaling=None, use_sliding_window=False,
        sliding_window=None, max_window_layers=48, tie_word_embeddings=False,
        router_aux_loss_coef=0.001, output_router_logits=False, bos_token_id=151643,
        eos_token_id=151645,
    ),
    "Mixtral-8x7B-v0.1": _released(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None,
        router_aux_loss_coef=0.02, output_router_logits=False, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_moe_configs_map_to_transformers_shapes(name):
    """Each released config maps to transformers' tensors (fused, as it holds them), its
    parameter count is transformers', and its export maps back."""
    from transformers import AutoConfig

    cfg = config_from_hf(RELEASED[name])
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**RELEASED[name]))
    shapes = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert _expected_shapes(cfg, fused_experts=True) == shapes
    per_expert = _expected_shapes(cfg)
    assert len(per_expert) == len(shapes) + cfg.num_layers * (3 * cfg.num_experts - 2)
    assert cfg.num_parameters() == sum(p.numel() for p in theirs.parameters())
    routed = 3 * cfg.hidden_size * cfg.expert_size  # one expert's parameters
    inactive = cfg.num_layers * (cfg.num_experts - cfg.num_experts_per_tok) * routed
    assert cfg.active_parameters() == cfg.num_parameters() - inactive
    assert config_from_hf(hf_config(cfg)) == cfg
    print(f"{name}: {cfg.num_parameters() / 1e9:.2f}B parameters, "
          f"{cfg.active_parameters() / 1e9:.2f}B active")  # fmt: skip


def test_dense_configs_are_unchanged_by_the_moe_keys():
    """A dense model's config.json has no mixture-of-experts key (its export is as before)."""
    config = hf_config(ModelConfig(hf_model_type="qwen3", qk_norm=True))
    assert not {"num_experts", "num_local_experts", "moe_intermediate_size"} & set(config)


# ----------------------------------------------------------------------------- model card
def _exported_size(tmp_path, cfg: ModelConfig) -> dict:
    """The export step's metrics for a trainer checkpoint of `cfg` (run as the step runs it)."""
    from llmflow.model.hf import save_model
    from llmflow.tasks.evaluation.export import ExportConfig, export
    from tests.flows.tiny_llama import build_tokenizer

    checkpoint, tokenizer, out = (tmp_path / n for n in ("ckpt", "tok", "out"))
    save_model(Transformer(cfg), cfg, checkpoint / "final")
    (checkpoint / "summary.json").write_text(json.dumps({"steps": 10, "tokens_seen": 1000}))
    build_tokenizer(cfg.vocab_size).save_pretrained(tokenizer)
    out.mkdir()
    return export.fn(ExportConfig(label="base"), checkpoint, tokenizer, out)


def test_the_card_states_total_and_active_parameters_of_a_mixture_only(tmp_path):
    from llmflow.tasks.evaluation.card import CardConfig, compute_line, limitations_section
    from llmflow.tasks.evaluation.card_facts import model_size

    moe = preset("moe-debug", vocab_size=384, num_layers=2, router_bias_update_rate=0.0,
                 hf_model_type="qwen3_moe", qk_norm=True)  # fmt: skip
    dense = preset("debug", vocab_size=384, num_layers=2)
    stages = [{"tokens": 1000, "device-hours": None}]
    lines = {}
    for name, cfg in (("moe", moe), ("dense", dense)):
        metrics = _exported_size(tmp_path / name, cfg)
        assert metrics["num_parameters"] == cfg.num_parameters()
        facts = {**model_size({"export": [("uri", {"metrics": metrics})]}), "stages": stages}
        lines[name] = compute_line(facts), limitations_section(CardConfig(model_name="m"), facts)
        if name == "dense":  # the dense record and facts are as before: no new key
            assert "active_parameters" not in metrics and "active_parameters" not in facts
            assert facts["parameters"] == cfg.num_parameters()
            continue
        assert metrics["active_parameters"] == cfg.active_parameters() < cfg.num_parameters()
        assert facts["active_parameters"] == cfg.active_parameters()
    compute, limits = lines["moe"]
    assert f"{moe.num_parameters()} ({moe.active_parameters()} active per token" in compute
    assert f"{6 * moe.active_parameters() * 1000:.3e}" in compute  # 6·N·D with N active
    assert f"({moe.active_parameters() / 1e6:,.1f}M active per token)" in limits
    assert "active" not in lines["dense"][0] + lines["dense"][1]
    assert f"{6 * dense.num_parameters() * 1000:.3e}" in lines["dense"][0]


def test_an_external_mixture_records_its_active_parameters(tmp_path):
    """The external-model step reads them from config.json; a dense config gives none."""
    from llmflow.tasks.evaluation.external import active_parameters

    tiny_moe("qwen3_moe", tmp_path / "moe")
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    cfg = config_from_hf(config)
    assert active_parameters(config) == cfg.active_parameters() < cfg.num_parameters()
    assert active_parameters(hf_config(preset("debug"))) is None
    assert active_parameters({**config, "router_jitter_noise": 0.5}) is None  # does not map


# ----------------------------------------------------------------------------- continued pretraining
def _transformers_loss(model, data_dir, batch_size: int, seed: int, batches: int = 1) -> float:
    """transformers' token-mean loss on the trainer's first `batches` batches of a packed set:
    each document of a row on its own (the trainer masks attention and restarts positions per
    document), labels as the loader gives them (aligned: no shift; -100 ignored), as
    tests/flows/test_init_model.py computes it for a dense model."""
    import torch.nn.functional as F

    from llmflow.tasks.dataprep.loader import PackedLoader

    loader = PackedLoader(data_dir, batch_size, 0, 1, seed=seed)
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for _ in range(batches):
            batch = loader.next_batch()
            for row in range(batch["input_ids"].shape[0]):
                starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist()
                for a, b in zip(starts, [*starts[1:], batch["input_ids"].shape[1]], strict=True):
                    logits = model(batch["input_ids"][row, a:b][None]).logits[0]
                    labels = batch["labels"][row, a:b]
                    total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
                    count += int((labels != -100).sum())
    return float(total / count)


@pytest.mark.slow  # the recipe's data steps, 12 trainer steps and the export: about 50 s on CPU
def test_continued_pretraining_of_an_imported_qwen3_moe(tmp_path, monkeypatch):
    """`init=` a Hub Qwen3-MoE (tests/flows/foreign_models.py: 4 experts, 2 per token, tied):
    the trainer's first loss is transformers' loss on the same batch, the held-out loss falls,
    and the export is a Qwen3MoeForCausalLM with the trained weights' logits."""
    from llmflow.flows.recipe import recipe
    from llmflow.model.hf import load_model
    from llmflow.tasks.config import load_config
    from llmflow.tasks.framework.executor import Executor
    from llmflow.tasks.ingest.hub import MIRROR_ENV
    from tests.flows.foreign_models import save_foreign_model
    from tests.flows.test_init_model import CONFIG, SMALL

    monkeypatch.setenv(MIRROR_ENV, str(tmp_path / "mirror"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = save_foreign_model(tmp_path / "mirror", "acme/tiny-moe", "qwen3-moe", "c" * 40)
    root = tmp_path / "runs"
    graph = recipe(load_config(CONFIG, [f"root={root}", "init=hf://models/acme/tiny-moe", *SMALL]))
    (stage,) = graph.find(step="pretrain")
    model_cfg = stage.config.train.model_config_obj()
    assert (model_cfg.hf_model_type, model_cfg.num_experts, model_cfg.num_experts_per_tok) == (
        "qwen3_moe", 4, 2
    )  # fmt: skip
    (exported,) = graph.find(step="export")
    outcome = Executor(str(root)).run(graph.closure([exported]))
    run = Path(outcome[stage].uri)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}

    # Step 1 trains the imported weights: its loss is transformers' loss on the same batch (the
    # logged loss is the cross-entropy; the router's auxiliary loss only adds gradient).
    train = stage.config.train
    data = Path(outcome[stage.inputs["data"]].uri)
    theirs = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **EAGER).eval()
    reference = _transformers_loss(theirs, data, train.batch.micro_batch_size, train.seed)
    assert losses[1] == pytest.approx(reference, abs=1e-4)

    # The held-out loss (transformers' own forward on the validation set) falls.
    held_out = Path(outcome[stage.inputs["validation"]].uri)
    back = AutoModelForCausalLM.from_pretrained(outcome[exported].uri + "/hf", **EAGER).eval()
    assert type(back) is Qwen3MoeForCausalLM
    before = _transformers_loss(theirs, held_out, 4, 0, batches=4)
    after = _transformers_loss(back, held_out, 4, 0, batches=4)
    print(f"qwen3-moe init: step-1 loss {losses[1]:.4f}, transformers {reference:.4f}; step 12 "
          f"{losses[12]:.4f} (|diff| at step 1 {abs(losses[1] - reference):.1e}); held-out loss "
          f"{before:.4f} -> {after:.4f}")  # fmt: skip
    assert after < before - 0.1

    # The export is the trained checkpoint: transformers' logits are ours.
    ours = load_model(run / "final").eval()
    ids = torch.randint(
        0, model_cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_a_yarn_extended_moe_export_builds_in_transformers(kind):
    """The context-extended export (YaRN) writes head_dim: transformers' YaRN reads it from the
    config, and MixtralConfig's default is None (the quickstart-moe's extended model failed to
    load with "unsupported operand type(s) for *: 'NoneType' and 'float'")."""
    import transformers

    from llmflow.model.config import preset
    from llmflow.model.hf_arch import hf_config

    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
            "beta_fast": 32, "beta_slow": 1}  # fmt: skip
    cfg = preset("moe-debug", vocab_size=256, max_seq_len=256, rope_scaling=yarn,
                 hf_model_type=kind, qk_norm=kind == "qwen3_moe")  # fmt: skip
    config = hf_config(cfg)
    assert config["head_dim"] == cfg.head_dim
    hf = transformers.AutoConfig.for_model(
        **{k: v for k, v in config.items() if k != "architectures"}
    )
    model = transformers.AutoModelForCausalLM.from_config(hf)
    assert type(model).__name__ == config["architectures"][0]
