"""Model configuration and size presets (SmolLM / SmolLM3 family shapes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

ROPE_TYPES = ("default", "yarn", "linear", "llama3")
HF_MODEL_TYPES = ("smollm3", "llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
"""transformers architectures a model is exported as (`model_type` in its config.json)."""
HF_DTYPES = ("float32", "bfloat16", "float16")
"""dtypes an export writes its weights in (`dtype`/`torch_dtype` in its config.json)."""
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
"""The transformers architectures of mixture-of-experts models (`num_experts` > 0)."""
SCORING_FUNCS = ("softmax", "sigmoid")
ADDED = {"omit_default": True}
"""Metadata of a field added after outputs were made: at its default it stays out of the hashes
of the configs that carry it, so those outputs keep their addresses."""


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only transformer in the Llama / SmolLM3 layout."""

    vocab_size: int = 8192
    """Number of token ids; the embedding and output matrices have this many rows."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Query heads; `hidden_size` must divide evenly into them."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide `num_heads`."""
    intermediate_size: int = 384
    """Width of the SwiGLU hidden layer."""
    max_seq_len: int = 256
    """Longest sequence the model is meant for (exported as `max_position_embeddings`)."""
    rope_theta: float = 10000.0
    """RoPE base; raising it is ABF (adjusted base frequency)."""
    rope_scaling: dict | None = None
    """RoPE scaling in transformers' `rope_parameters` form, e.g. `{"rope_type": "yarn",
    "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}`;
    "linear" and "llama3" (Llama 3.1+) are read from imported models."""
    nope_interval: int = 0
    """0: RoPE in every layer; k: layer i has no RoPE when (i + 1) % k == 0 (SmolLM3 uses 4)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output projection."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    init_std: float = 0.02
    """Std of the normal initialization; residual output projections get
    `init_std / sqrt(2 * num_layers)`."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (no SmolLM3 equivalent: not exportable)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id, written into the exported configs."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence id, or ids (Llama 3 Instruct stops on several), written into the exported
    configs."""
    pad_token_id: int | None = None
    """Padding id; the export falls back to (the first) `eos_token_id`, then 0."""
    attention_bias: bool = field(default=False, metadata=ADDED)
    """The q, k and v projections carry a bias (Qwen2); the output projection never does."""
    explicit_head_dim: int | None = field(default=None, metadata=ADDED)
    """Width of one attention head when it is not `hidden_size / num_heads` (Qwen3: 128)."""
    nope_layers: list[int] | None = field(default=None, metadata=ADDED)
    """Indices of the layers without RoPE, for a pattern `nope_interval` cannot express."""
    hf_model_type: str = field(default="smollm3", metadata=ADDED)
    """The transformers architecture the export writes (one of `HF_MODEL_TYPES`); an imported
    model keeps its own."""
    hf_dtype: str | None = field(default=None, metadata=ADDED)
    """The dtype the export writes (one of `HF_DTYPES`): an imported bf16 checkpoint keeps
    "bfloat16" though the trainer holds float32 master weights; None: the weights' own dtype."""

    num_experts: int = field(default=0, metadata=ADDED)
    """Routed experts of each sparse layer (transformers' Qwen3-MoE name); 0: a dense model."""
    num_experts_per_tok: int = field(default=2, metadata=ADDED)
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int | None = field(default=None, metadata=ADDED)
    """Width of one expert's SwiGLU hidden layer; None: `intermediate_size`."""
    norm_topk_prob: bool = field(default=True, metadata=ADDED)
    """Renormalize the top-k routing weights to sum to 1 (Mixtral always does; Qwen3-MoE's
    released models do)."""
    scoring_func: str = field(default="softmax", metadata=ADDED)
    """Router scores: "softmax" over the experts (Qwen3-MoE, Mixtral) or "sigmoid" of each
    (DeepSeek-V3's name and choice)."""
    n_shared_experts: int = field(default=0, metadata=ADDED)
    """Experts every token goes through (DeepSeek-V3's name), one SwiGLU of width
    `n_shared_experts * moe_intermediate_size`."""
    decoder_sparse_step: int = field(default=1, metadata=ADDED)
    """Layer i is sparse when (i + 1) % decoder_sparse_step == 0 (Qwen3-MoE's name)."""
    mlp_only_layers: list[int] | None = field(default=None, metadata=ADDED)
    """Layers kept dense whatever the step (Qwen3-MoE's name)."""
    first_k_dense_replace: int = field(default=0, metadata=ADDED)
    """The first k layers are dense (DeepSeek-V3's name)."""
    router_aux_loss_coef: float = field(default=0.0, metadata=ADDED)
    """Weight of the auxiliary load-balancing loss, summed over the sparse layers (1 per layer
    when balanced); 0: off."""
    router_z_loss_coef: float = field(default=0.0, metadata=ADDED)
    """Weight of the router z-loss (ST-MoE), summed over the sparse layers; 0: off."""
    router_bias_update_rate: float = field(default=0.0, metadata=ADDED)
    """DeepSeek-V3's auxiliary-loss-free balancing: the per-expert selection bias moves by this
    much after each optimizer step, towards even loads; 0: off (DeepSeek-V3 used 0.001)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            _require_positive(self, name)
        for name in ("intermediate_size", "max_seq_len", "rope_theta", "rms_norm_eps", "init_std"):
            _require_positive(self, name)
        self._check_heads()
        if self.nope_interval < 0:
            raise ValueError(f"nope_interval={self.nope_interval} must be >= 0 (0 disables NoPE)")
        self._check_nope_layers()
        self._check_hf_model_type()
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            values = value if isinstance(value, list) else [value]
            if any(v is not None and not 0 <= v < self.vocab_size for v in values):
                raise ValueError(f"{name}={value} must be in [0, vocab_size={self.vocab_size})")
        _validate_rope_scaling(self.rope_scaling)
        self._check_moe()

    def _check_moe(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"num_experts={self.num_experts} must be >= 0 (0: dense)")
        if not self.num_experts:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func={self.scoring_func!r} must be one of {SCORING_FUNCS}")
        if self.moe_intermediate_size is not None:
            _require_positive(self, "moe_intermediate_size")
        for name in ("n_shared_experts", "first_k_dense_replace", "router_aux_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        for name in ("router_z_loss_coef", "router_bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        _require_positive(self, "decoder_sparse_step")
        if not any(self.is_sparse(i) for i in range(self.num_layers)):
            raise ValueError(
                f"num_experts={self.num_experts} but no layer is sparse (decoder_sparse_step="
                f"{self.decoder_sparse_step}, mlp_only_layers={self.mlp_only_layers}, "
                f"first_k_dense_replace={self.first_k_dense_replace}, num_layers={self.num_layers})"
            )

    @property
    def expert_size(self) -> int:
        """Width of one expert's hidden layer."""
        return self.moe_intermediate_size or self.intermediate_size

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has a mixture of experts (Qwen3-MoE's and DeepSeek-V3's
        rules: the sparse step, the dense-only list, the first k dense)."""
        if not self.num_experts or layer_idx < self.first_k_dense_replace:
            return False
        if self.mlp_only_layers and layer_idx in self.mlp_only_layers:
            return False
        return (layer_idx + 1) % self.decoder_sparse_step == 0

    def _check_heads(self) -> None:
        if self.explicit_head_dim is not None:
            _require_positive(self, "explicit_head_dim")
        elif self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = hidden_size / num_heads = {self.head_dim} must be even for RoPE"
            )

    def _check_nope_layers(self) -> None:
        if self.nope_layers is None:
            return
        if self.nope_interval:
            raise ValueError(
                f"nope_layers={self.nope_layers} and nope_interval={self.nope_interval} are both "
                "set; give one of them"
            )
        bad = [i for i in self.nope_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"nope_layers={self.nope_layers}: {bad} not in [0, num_layers={self.num_layers})"
            )

    def _check_hf_model_type(self) -> None:
        """Each architecture has the features its transformers class has, no others."""
        kind = self.hf_model_type
        if kind not in HF_MODEL_TYPES:
            raise ValueError(f"hf_model_type={kind!r} must be one of {HF_MODEL_TYPES}")
        if self.hf_dtype is not None and self.hf_dtype not in HF_DTYPES:
            raise ValueError(f"hf_dtype={self.hf_dtype!r} must be one of {HF_DTYPES} or None")
        required = {  # field: the value the architecture needs (None: any)
            "attention_bias": {"qwen2": True}.get(kind, False),
            "qk_norm": {"qwen3": True, "qwen3_moe": True, "smollm3": None}.get(kind, False),
        }
        if (kind in MOE_MODEL_TYPES) != (self.num_experts > 0):
            raise ValueError(
                f"num_experts={self.num_experts} does not fit hf_model_type={kind!r} (the "
                f"mixture-of-experts architectures are {MOE_MODEL_TYPES}; num_experts > 0 needs "
                "one of them, and they need it)"
            )
        for name, value in required.items():
            if value is not None and getattr(self, name) != value:
                raise ValueError(
                    f"{name}={getattr(self, name)} does not fit hf_model_type={kind!r} "
                    f"(its transformers class has {name}={value})"
                )
        has_nope = any(not self.uses_rope(i) for i in range(self.num_layers))
        if has_nope and kind != "smollm3":
            raise ValueError(
                f"NoPE layers (nope_interval={self.nope_interval}, nope_layers="
                f"{self.nope_layers}) need hf_model_type='smollm3', not {kind!r}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    def uses_rope(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` applies RoPE (SmolLM3's `no_rope_layers` convention)."""
        if self.nope_layers is not None:
            return layer_idx not in self.nope_layers
        return self.nope_interval == 0 or (layer_idx + 1) % self.nope_interval != 0

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Count parameters exactly as the model built from this config holds them.

        Args:
            non_embedding: leave out the token embedding and, when untied, the output projection.
        """
        hidden, head_dim = self.hidden_size, self.head_dim
        attention = hidden * (self.num_heads + 2 * self.num_kv_heads) * head_dim
        attention += self.num_heads * head_dim * hidden + (2 * head_dim if self.qk_norm else 0)
        if self.attention_bias:
            attention += (self.num_heads + 2 * self.num_kv_heads) * head_dim
        body = hidden  # final norm
        for i in range(self.num_layers):
            body += attention + self._mlp_parameters(i, active=False) + 2 * hidden  # two norms
        if non_embedding:
            return body
        embeddings = self.vocab_size * hidden * (1 if self.tie_embeddings else 2)
        return body + embeddings

    def active_parameters(self, non_embedding: bool = False) -> int:
        """Parameters a token goes through: `num_parameters` with each sparse layer's routed
        experts counted `num_experts_per_tok` times instead of `num_experts` (equal for a dense
        model)."""
        total = self.num_parameters(non_embedding)
        for i in range(self.num_layers):
            total -= self._mlp_parameters(i, active=False) - self._mlp_parameters(i, active=True)
        return total

    def _mlp_parameters(self, layer_idx: int, active: bool) -> int:
        hidden = self.hidden_size
        if not self.is_sparse(layer_idx):
            return 3 * hidden * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = 3 * hidden * self.n_shared_experts * self.expert_size
        return experts * 3 * hidden * self.expert_size + shared + self.num_experts * hidden

    def to_dict(self) -> dict:
        """Plain-JSON form (round-trips through `ModelConfig(**d)`)."""
        return dataclasses.asdict(self)


def _require_positive(cfg: ModelConfig, name: str) -> None:
    value = getattr(cfg, name)
    if not value > 0:
        raise ValueError(f"{name}={value} must be > 0")


def _validate_rope_scaling(rope_scaling: dict | None) -> None:
    if rope_scaling is None:
        return
    rope_type = rope_scaling.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} must be one of {ROPE_TYPES}")
    if rope_type == "linear":
        factor = rope_scaling.get("factor")
        if factor is None or factor <= 0:
            raise ValueError(f"rope_scaling.factor={factor} must be > 0 for linear")
    if rope_type == "llama3":
        _validate_llama3(rope_scaling)
    if rope_type == "yarn":
        _validate_yarn(rope_scaling)


def _validate_yarn(rope_scaling: dict) -> None:
    factor = rope_scaling.get("factor")
    if factor is None or factor < 1:
        raise ValueError(f"rope_scaling.factor={factor} must be >= 1 for yarn")
    original = rope_scaling.get("original_max_position_embeddings")
    if original is None or original <= 0:
        raise ValueError(
            f"rope_scaling.original_max_position_embeddings={original} must be > 0 for yarn"
        )
    beta_fast, beta_slow = rope_scaling.get("beta_fast") or 32, rope_scaling.get("beta_slow") or 1
    if beta_fast < beta_slow:
        raise ValueError(
            f"rope_scaling.beta_fast={beta_fast} must be >= rope_scaling.beta_slow={beta_slow}"
        )


def _validate_llama3(rope_scaling: dict) -> None:
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        value = rope_scaling.get(name)
        if value is None or value <= 0:
            raise ValueError(f"rope_scaling.{name}={value} must be > 0 for llama3")
    low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    if high <= low:
        raise ValueError(
            f"rope_scaling.high_freq_factor={high} must be > rope_scaling.low_freq_factor={low}"
        )
    original = rope_scaling.get("original_max_position_embeddings")
    if original is None or original <= 0:
        raise ValueError(
            f"rope_scaling.original_max_position_embeddings={original} must be > 0 for llama3"
        )


# Shapes follow the released SmolLM2 (135M, 360M, 1.7B) and SmolLM3 (3B) configs; sequence
# lengths and RoPE bases are the pretraining ones (context is extended later with ABF + YaRN).
PRESETS: dict[str, dict] = {
    "debug": {},
    "135m": dict(
        vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
        intermediate_size=1536, max_seq_len=2048, rope_theta=100000.0, rms_norm_eps=1e-5,
    ),
    "360m": dict(
        vocab_size=49152, hidden_size=960, num_layers=32, num_heads=15, num_kv_heads=5,
        intermediate_size=2560, max_seq_len=2048, rope_theta=100000.0, rms_norm_eps=1e-5,
    ),
    "1.7b": dict(
        vocab_size=49152, hidden_size=2048, num_layers=24, num_heads=32, num_kv_heads=32,
        intermediate_size=8192, max_seq_len=2048, rope_theta=130000.0, rms_norm_eps=1e-5,
    ),
    "3b": dict(
        vocab_size=128256, hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=4,
        intermediate_size=11008, max_seq_len=4096, rope_theta=50000.0, nope_interval=4,
    ),
    # "debug" with a mixture of experts in every layer, at its active size: 8 experts of half
    # its SwiGLU width, 2 per token (the same 384 active width, plus a 8 x 128 router per
    # layer); Mixtral's layout (exported as MixtralForCausalLM), balanced by the auxiliary
    # loss as Mixtral and Qwen3-MoE are. DeepSeek-V3's auxiliary-loss-free bias
    # (`router_bias_update_rate`) balances better but selects experts by a bias those classes
    # do not have, so such a model does not export to them.
    "moe-debug": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
        hf_model_type="mixtral", router_aux_loss_coef=0.01,
    ),
    # Qwen3-30B-A3B's shapes (48 layers, 128 experts of width 768, 8 per token), for the planner.
    "30b-a3b": dict(
        vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        explicit_head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, max_seq_len=4096, rope_theta=1000000.0,
        qk_norm=True, hf_model_type="qwen3_moe", tie_embeddings=False,
        router_aux_loss_coef=0.001,
    ),
}  # fmt: skip


def preset(name: str, **overrides) -> ModelConfig:
    """Build a preset config ("debug", "135m", "360m", "1.7b", "3b", "moe-debug", "30b-a3b"),
    with field overrides."""
    if name not in PRESETS:
        raise ValueError(f"preset name={name!r} must be one of {sorted(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {sorted(unknown)} in preset overrides")
    return ModelConfig(**{**PRESETS[name], **overrides})
