"""Which transformers architectures map onto `ModelConfig`, in both directions.

`config_from_hf` reads the `config.json` of a LlamaForCausalLM, Qwen2ForCausalLM (q/k/v bias),
Qwen3ForCausalLM (per-head q/k RMSNorm), SmolLM3ForCausalLM (NoPE layers), or of the mixtures of
experts Qwen3MoeForCausalLM (softmax top-k router, optional renormalisation, dense layers by
`mlp_only_layers`/`decoder_sparse_step`) and MixtralForCausalLM (every layer sparse, renormalised
top-k), and returns the `ModelConfig` whose `Transformer` computes the same logits. Anything else
(another head, another mixture of experts, shared experts, router jitter, sliding-window
attention, a RoPE scaling we do not implement) is refused before a weight is read, naming the
config field and its value. `hf_config` writes the config back for the
architecture the model came from (`ModelConfig.hf_model_type`). Nothing here imports transformers.
"""

from __future__ import annotations

import torch

from llmflow.model.config import HF_DTYPES, ROPE_TYPES, ModelConfig
from llmflow.tasks.framework.errors import BadInputError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
"""transformers class -> its `model_type`, for every class `config_from_hf` maps."""
CLASS_OF = {kind: name for name, kind in ARCHITECTURES.items()}
_DEFAULTS = {  # transformers' values for keys a config.json may leave out
    "llama": {"tie_word_embeddings": False, "rope_theta": 10000.0, "max_position_embeddings": 2048},
    "qwen2": {
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
    },
    "qwen3": {
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "head_dim": 128,
    },
    "smollm3": {
        "tie_word_embeddings": True,
        "rope_theta": 2000000.0,
        "max_position_embeddings": 32768,
    },
    "qwen3_moe": {
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "router_aux_loss_coef": 0.001,
    },
    "mixtral": {
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 131072,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
    },
}
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config fields that give a mixture of experts its expert count."""
MOE_KINDS = ("qwen3_moe", "mixtral")
"""The mixtures of experts `config_from_hf` maps (their transformers `model_type`)."""
SHARED_EXPERT_FIELDS = (
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "num_shared_experts",
    "moe_shared_expert_intermediate_size",
)
"""Config fields of shared experts (Qwen2-MoE, DeepSeek): neither mapped class has them."""
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def config_from_hf(config: dict, source: str = "config.json") -> ModelConfig:
    """The `ModelConfig` of a transformers `config.json`, or `BadInputError` naming the field.

    Args:
        config: the parsed `config.json`.
        source: where it came from, for the messages.
    """
    kind = _mappable_kind(config, source)
    fields = _model_fields(config, kind, source)
    try:
        return ModelConfig(**fields)
    except ValueError as err:
        raise BadInputError(f"{source}: {CLASS_OF[kind]} config does not map: {err}") from err


def _mappable_kind(config: dict, source: str) -> str:
    """The config's model_type once nothing in it refuses to map (`BadInputError` naming what)."""
    _refuse_other_heads(config, source)
    _refuse_moe(config, source)
    kind = _model_type(config, source)
    if kind in MOE_KINDS:
        _refuse_unmapped_moe(config, kind, source)
    missing = [name for name in _REQUIRED if config.get(name) is None]
    if missing:
        raise BadInputError(f"{source}: {CLASS_OF[kind]} config has no {', '.join(missing)}")
    _refuse_sliding_window(config, kind, config["num_hidden_layers"], source)
    _refuse_unsupported_layers(config, kind, source)
    return kind


def _model_fields(config: dict, kind: str, source: str) -> dict:
    """The `ModelConfig` fields of a config `_mappable_kind` let through."""
    defaults = _DEFAULTS[kind]
    shape = _shape_fields(config, kind)
    eos = config.get("eos_token_id")
    return dict(
        **shape,
        **_position_fields(config, kind, source),
        tie_embeddings=config.get("tie_word_embeddings", defaults["tie_word_embeddings"]),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        init_std=config.get("initializer_range", 0.02),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=(eos or None) if isinstance(eos, list) else eos,
        pad_token_id=config.get("pad_token_id"),
        hf_model_type=kind,
        hf_dtype=_dtype(config, source),
        **(_moe_fields(config, kind) if kind in MOE_KINDS else {}),
    )


def _moe_fields(config: dict, kind: str) -> dict:
    """The mixture-of-experts fields of a Qwen3-MoE or Mixtral config.

    Mixtral: `num_local_experts` experts of width `intermediate_size` in every layer, and its
    router's softmax over the top-k logits, which equals the top-k of the softmax over all
    experts renormalised (`norm_topk_prob=True`). Qwen3-MoE: `num_experts` (transformers 5
    writes it as `num_local_experts`) of width `moe_intermediate_size`, dense layers of width
    `intermediate_size` where `mlp_only_layers` or `decoder_sparse_step` say.
    """
    defaults = _DEFAULTS[kind]
    fields = dict(
        num_experts=_num_experts(config, kind),
        num_experts_per_tok=config.get("num_experts_per_tok", defaults["num_experts_per_tok"]),
        router_aux_loss_coef=float(
            config.get("router_aux_loss_coef", defaults["router_aux_loss_coef"])
        ),
    )
    if kind == "mixtral":
        return dict(
            **fields, moe_intermediate_size=config["intermediate_size"], norm_topk_prob=True
        )
    return dict(
        **fields,
        moe_intermediate_size=config.get(
            "moe_intermediate_size", defaults["moe_intermediate_size"]
        ),
        norm_topk_prob=bool(config.get("norm_topk_prob", defaults["norm_topk_prob"])),
        decoder_sparse_step=config.get("decoder_sparse_step", defaults["decoder_sparse_step"]),
        mlp_only_layers=sorted(config.get("mlp_only_layers") or []) or None,
    )


def _num_experts(config: dict, kind: str) -> int:
    """The expert count: `num_experts` or `num_local_experts` (transformers' alias either way)."""
    for name in ("num_experts", "num_local_experts"):
        if config.get(name) is not None:
            return config[name]
    return _DEFAULTS[kind]["num_experts"]


def _shape_fields(config: dict, kind: str) -> dict:
    """Sizes, heads and the attention's extra parameters (Qwen3's q/k norm, Qwen2's bias)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or _DEFAULTS[kind].get("head_dim") or hidden // heads
    return dict(
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        intermediate_size=config["intermediate_size"],
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        attention_bias=kind == "qwen2",
        explicit_head_dim=None if head_dim * heads == hidden else head_dim,
    )


def _position_fields(config: dict, kind: str, source: str) -> dict:
    """Context length, RoPE and (SmolLM3) the NoPE layers."""
    max_seq_len = (
        config.get("max_position_embeddings") or _DEFAULTS[kind]["max_position_embeddings"]
    )
    rope_theta, rope_scaling = _rope(config, kind, source)
    nope_interval, nope_layers = (
        _nope(config, config["num_hidden_layers"], source) if kind == "smollm3" else (0, None)
    )
    return dict(
        max_seq_len=max_seq_len,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        nope_interval=nope_interval,
        nope_layers=nope_layers,
    )


def _dtype(config: dict, source: str) -> str | None:
    """The checkpoint's dtype when the export must write it back (bfloat16, float16); None for
    float32 or none given (the export then writes the weights' own dtype, as before)."""
    field = "dtype" if config.get("dtype") is not None else "torch_dtype"
    dtype = config.get(field)
    if dtype is None:
        return None
    if dtype not in HF_DTYPES:
        raise BadInputError(
            f"{source}: {field}={dtype!r} is not supported (supported: {', '.join(HF_DTYPES)})"
        )
    return None if dtype == "float32" else dtype


def _refuse_other_heads(config: dict, source: str) -> None:
    architectures = config.get("architectures") or []
    others = [name for name in architectures if "For" in name and not name.endswith("ForCausalLM")]
    if others:
        raise BadInputError(
            f"{source}: architectures={architectures} is not a causal language model "
            f"({others[0]} has another head than ...ForCausalLM); import a causal LM checkpoint"
        )


def _refuse_moe(config: dict, source: str) -> None:
    """A mixture of experts of another class than the mapped ones is refused, naming the field."""
    architectures = config.get("architectures") or []
    kinds = [ARCHITECTURES.get(name) for name in architectures] or [config.get("model_type")]
    if kinds[0] in MOE_KINDS:
        return
    for name in MOE_FIELDS:
        value = config.get(name)
        if isinstance(value, int) and value > 1:
            raise BadInputError(
                f"{source}: {name}={value}: this mixture-of-experts model "
                f"({architectures or config.get('model_type')}) is not supported; the "
                f"mixture-of-experts classes that map are {', '.join(CLASS_OF[k] for k in MOE_KINDS)}"
            )


def _refuse_unmapped_moe(config: dict, kind: str, source: str) -> None:
    """What a Qwen3-MoE or Mixtral config may set that our `MoE` does not compute."""
    for name in SHARED_EXPERT_FIELDS:
        if config.get(name):
            raise BadInputError(
                f"{source}: {name}={config[name]}: shared experts are not supported for "
                f"{CLASS_OF[kind]} (its transformers class has none)"
            )
    jitter = config.get("router_jitter_noise") or 0.0
    if jitter:
        raise BadInputError(
            f"{source}: router_jitter_noise={jitter} is not supported (the router takes the "
            "hidden states as they are; continued pretraining would train another model)"
        )
    experts = _num_experts(config, kind)
    top_k = config.get("num_experts_per_tok", _DEFAULTS[kind]["num_experts_per_tok"])
    if not (isinstance(experts, int) and experts > 0):
        raise BadInputError(f"{source}: num_experts={experts} must be > 0 for {CLASS_OF[kind]}")
    if not (isinstance(top_k, int) and 1 <= top_k <= experts):
        raise BadInputError(
            f"{source}: num_experts_per_tok={top_k} must be in [1, num_experts={experts}]"
        )


def _model_type(config: dict, source: str) -> str:
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    supported = sorted(ARCHITECTURES)
    if not architectures:
        if model_type in CLASS_OF:
            return model_type
        raise BadInputError(
            f"{source}: model_type={model_type!r} is not supported (supported: {sorted(CLASS_OF)})"
        )
    known = [ARCHITECTURES[name] for name in architectures if name in ARCHITECTURES]
    if not known:
        raise BadInputError(
            f"{source}: architectures={architectures} is not supported (supported: {supported})"
        )
    if model_type is not None and model_type != known[0]:
        raise BadInputError(
            f"{source}: model_type={model_type!r} does not match architectures={architectures} "
            f"(expected {known[0]!r})"
        )
    return known[0]


def _refuse_sliding_window(config: dict, kind: str, num_layers: int, source: str) -> None:
    layer_types = config.get("layer_types")
    window = config.get("sliding_window")
    if kind == "mixtral" and window is not None:  # Mixtral slides whenever a window is given
        raise BadInputError(
            f"{source}: sliding_window={window}: sliding-window attention is not supported"
        )
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise BadInputError(
                f"{source}: layer_types={layer_types} has {other} layers (use_sliding_window="
                f"{config.get('use_sliding_window')}, sliding_window={window}); only full "
                "attention is supported"
            )
        return
    if not (config.get("use_sliding_window") and window):
        return
    if kind in ("qwen2", "qwen3") and config.get("max_window_layers", 28) >= num_layers:
        return  # Qwen applies the window only from layer max_window_layers on: to no layer here
    raise BadInputError(
        f"{source}: use_sliding_window=True with sliding_window={window}: sliding-window "
        "attention is not supported"
    )


def _refuse_unsupported_layers(config: dict, kind: str, source: str) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise BadInputError(f"{source}: hidden_act={act!r} is not supported (silu only)")
    if config.get("mlp_bias"):
        raise BadInputError(f"{source}: mlp_bias={config['mlp_bias']} is not supported")
    if kind != "qwen2" and config.get("attention_bias"):
        raise BadInputError(
            f"{source}: attention_bias={config['attention_bias']} is not supported for "
            f"{CLASS_OF[kind]} (it puts a bias on o_proj too; only Qwen2's q/k/v bias is)"
        )


def _rope(config: dict, kind: str, source: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers 5's `rope_parameters` or 4.x's keys."""
    field = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    params = dict(config.get(field) or {})
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta", _DEFAULTS[kind]["rope_theta"])
    legacy_type = params.pop("type", None)
    rope_type = params.setdefault("rope_type", legacy_type or "default")
    partial = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise BadInputError(
            f"{source}: partial_rotary_factor={partial} is not supported (RoPE on whole heads)"
        )
    if rope_type not in ROPE_TYPES:
        raise BadInputError(
            f"{source}: {field}.rope_type={rope_type!r} is not implemented "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    return float(theta), None if rope_type == "default" else params


def _nope(config: dict, num_layers: int, source: str) -> tuple[int, list[int] | None]:
    """(nope_interval, nope_layers) from SmolLM3's `no_rope_layers` (1 = RoPE, 0 = NoPE)."""
    uses_rope = config.get("no_rope_layers")
    interval = config.get("no_rope_layer_interval", 4)
    if uses_rope is None:
        return interval, None
    uses_rope = list(uses_rope)
    if len(uses_rope) < num_layers:
        raise BadInputError(
            f"{source}: no_rope_layers has {len(uses_rope)} entries for "
            f"num_hidden_layers={num_layers}"
        )
    uses_rope = uses_rope[:num_layers]
    if all(uses_rope):
        return 0, None
    for k in range(1, num_layers + 1):
        if uses_rope == [int((i + 1) % k != 0) for i in range(num_layers)]:
            return k, None
    return 0, [i for i, rope in enumerate(uses_rope) if not rope]


def hf_config(cfg: ModelConfig, dtype: torch.dtype | None = None) -> dict:
    """`config.json` contents for the transformers class of `cfg.hf_model_type`; its `dtype` is
    `cfg.hf_dtype`, else `dtype`, else float32."""
    if cfg.hf_model_type == "smollm3" and cfg.qk_norm:
        raise ValueError(
            "qk_norm=True has no equivalent in transformers' SmolLM3/Llama (no q_norm/k_norm "
            "weights), so this model cannot be exported; train with qk_norm=False to export"
        )
    dtype_name = cfg.hf_dtype or str(dtype or torch.float32).removeprefix("torch.")
    config = {**_size_config(cfg), **_token_rope_config(cfg, dtype_name)}
    _add_class_fields(config, cfg)
    if cfg.hf_model_type in MOE_KINDS:
        config.update(_moe_config(cfg))
    return config


def _moe_config(cfg: ModelConfig) -> dict:
    """`config.json`'s mixture-of-experts keys; `ValueError` naming the field for what the
    class cannot express (shared experts, sigmoid scores; Mixtral: a dense layer, no
    renormalisation)."""
    kind = cfg.hf_model_type
    if cfg.n_shared_experts:
        raise ValueError(
            f"n_shared_experts={cfg.n_shared_experts}: {CLASS_OF[kind]} has no shared experts, "
            "so this model cannot be exported as it"
        )
    if cfg.scoring_func != "softmax":
        raise ValueError(
            f"scoring_func={cfg.scoring_func!r}: {CLASS_OF[kind]}'s router is a softmax, so this "
            "model cannot be exported as it"
        )
    common = {
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
    }
    if kind == "mixtral":
        _refuse_dense_layers_for_mixtral(cfg)
        return {
            **common,
            "num_local_experts": cfg.num_experts,
            "intermediate_size": cfg.expert_size,  # Mixtral's experts are its only MLPs
            "router_jitter_noise": 0.0,
        }
    # the first k dense layers are dense-only layers in Qwen3-MoE's terms
    dense = sorted(set(cfg.mlp_only_layers or []) | set(range(cfg.first_k_dense_replace)))
    return {
        **common,
        "num_experts": cfg.num_experts,
        "moe_intermediate_size": cfg.expert_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": dense,
    }


def _refuse_dense_layers_for_mixtral(cfg: ModelConfig) -> None:
    """Mixtral has a mixture of experts in every layer and always renormalises the top k."""
    for name, value, default in (
        ("first_k_dense_replace", cfg.first_k_dense_replace, 0),
        ("decoder_sparse_step", cfg.decoder_sparse_step, 1),
    ):
        if value != default:
            raise ValueError(
                f"{name}={value}: MixtralForCausalLM has every layer sparse, so this model "
                "cannot be exported as it (export it as qwen3_moe)"
            )
    dense = [i for i in range(cfg.num_layers) if not cfg.is_sparse(i)]
    if dense:
        raise ValueError(
            f"mlp_only_layers={cfg.mlp_only_layers}: layers {dense} are dense and "
            "MixtralForCausalLM has every layer sparse, so this model cannot be exported as it"
        )
    if not cfg.norm_topk_prob:
        raise ValueError(
            "norm_topk_prob=False: MixtralForCausalLM always renormalises the top-k weights, so "
            "this model cannot be exported as it"
        )


def _size_config(cfg: ModelConfig) -> dict:
    """`config.json`'s class, sizes, activation, context length and norm epsilon."""
    kind = cfg.hf_model_type
    return {
        "architectures": [CLASS_OF[kind]],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.rms_norm_eps,
    }


def _token_rope_config(cfg: ModelConfig, dtype_name: str) -> dict:
    """`config.json`'s special tokens, RoPE, tied embeddings and dtype."""
    rope_parameters = {"rope_type": "default", **(cfg.rope_scaling or {})}
    rope_parameters["rope_theta"] = cfg.rope_theta
    return {
        "use_cache": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": _pad_id(cfg),
        # transformers >= 5 reads rope_parameters; 4.x reads rope_theta and rope_scaling.
        "rope_parameters": rope_parameters,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


def _pad_id(cfg: ModelConfig) -> int | None:
    """`config.json`'s pad_token_id: the config's own; SmolLM3 always gets one."""
    if cfg.hf_model_type != "smollm3":
        return cfg.pad_token_id
    # NOTE: SmolLM3Config defaults pad_token_id to 128004, which fails ("Padding_idx must
    # be within num_embeddings") for small vocabularies, so it is always written.
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else _first(cfg.eos_token_id)
    return pad if pad is not None else 0


def _add_class_fields(config: dict, cfg: ModelConfig) -> None:
    """The keys only some of the transformers classes read (each class's own defaults)."""
    kind = cfg.hf_model_type
    if cfg.explicit_head_dim is not None or kind in ("llama", "qwen3", "qwen3_moe", "mixtral"):
        config["head_dim"] = cfg.head_dim
    if kind not in ("qwen2", "mixtral"):
        config["attention_bias"] = False
    if kind in ("llama", "smollm3"):
        config["mlp_bias"] = False
    if kind == "llama":
        config["pretraining_tp"] = 1
    if kind not in ("llama", "mixtral"):
        config["use_sliding_window"] = False
    if kind != "llama":
        config["sliding_window"] = None
    if kind in ("qwen2", "qwen3"):
        config["max_window_layers"] = cfg.num_layers
        config["layer_types"] = ["full_attention"] * cfg.num_layers
    if kind == "smollm3":
        config["no_rope_layers"] = [int(cfg.uses_rope(i)) for i in range(cfg.num_layers)]
        if cfg.nope_interval:
            config["no_rope_layer_interval"] = cfg.nope_interval


def _first(ids: int | list[int] | None) -> int | None:
    return ids[0] if isinstance(ids, list) else ids
