"""Conversion to and from Hugging Face's SmolLM3 format, and our own checkpoint format.

The export is a `SmolLM3ForCausalLM` directory (safetensors weights, `config.json` with the RoPE
parameters, `generation_config.json`, tokenizer files) that `AutoModelForCausalLM.from_pretrained`
loads with the same logits as `Transformer.forward`. Nothing here imports transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from llmflow.model.config import ModelConfig
from llmflow.model.transformer import Transformer

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "model_config.json"
TOKENIZER_FILES = (
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
_LAYER_RENAMES = {  # ours -> transformers, for unfused tensors
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def _clean(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop wrapper prefixes (torch.compile's `_orig_mod.`, DDP's `module.`)."""
    out = {}
    for name, tensor in state_dict.items():
        for prefix in ("_orig_mod.", "module."):
            name = name.removeprefix(prefix)
        out[name] = tensor.detach()
    return out


def to_hf_state_dict(state_dict: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Rename and split our tensors into transformers' SmolLM3/Llama names."""
    sd = _clean(state_dict)
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hf = {
        "model.embed_tokens.weight": sd["embed.weight"],
        "model.norm.weight": sd["norm.weight"],
    }
    if not cfg.tie_embeddings:
        hf["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for src, dst in _LAYER_RENAMES.items():
            hf[theirs + dst] = sd[ours + src]
        q, k, v = sd[ours + "attn.qkv_proj.weight"].split([q_size, kv_size, kv_size])
        hf[theirs + "self_attn.q_proj.weight"] = q
        hf[theirs + "self_attn.k_proj.weight"] = k
        hf[theirs + "self_attn.v_proj.weight"] = v
        gate, up = sd[ours + "mlp.gate_up_proj.weight"].chunk(2)
        hf[theirs + "mlp.gate_proj.weight"] = gate
        hf[theirs + "mlp.up_proj.weight"] = up
    return {name: t.contiguous() for name, t in hf.items()}


def from_hf_state_dict(hf: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Inverse of `to_hf_state_dict`: fuse q/k/v and gate/up back into our names."""
    sd = {
        "embed.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
    }
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for src, dst in _LAYER_RENAMES.items():
            sd[ours + src] = hf[theirs + dst]
        qkv = [hf[theirs + f"self_attn.{p}_proj.weight"] for p in "qkv"]
        sd[ours + "attn.qkv_proj.weight"] = torch.cat(qkv)
        gate_up = [hf[theirs + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]
        sd[ours + "mlp.gate_up_proj.weight"] = torch.cat(gate_up)
    return sd


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` contents for a SmolLM3ForCausalLM with this shape."""
    if cfg.qk_norm:
        raise ValueError(
            "qk_norm=True has no equivalent in transformers' SmolLM3/Llama (no q_norm/k_norm "
            "weights), so this model cannot be exported; train with qk_norm=False to export"
        )
    # NOTE: SmolLM3Config defaults pad_token_id to 128004, which fails ("Padding_idx must be
    # within num_embeddings") for small vocabularies, so it is always written.
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
    rope_parameters = {"rope_type": "default", **(cfg.rope_scaling or {})}
    rope_parameters["rope_theta"] = cfg.rope_theta
    config = {
        "architectures": ["SmolLM3ForCausalLM"],
        "model_type": "smollm3",
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
        "use_cache": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": pad if pad is not None else 0,
        # transformers >= 5 reads rope_parameters; 4.x reads rope_theta and rope_scaling.
        "rope_parameters": rope_parameters,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "no_rope_layers": [int(cfg.uses_rope(i)) for i in range(cfg.num_layers)],
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.nope_interval:
        config["no_rope_layer_interval"] = cfg.nope_interval
    return config


def export_hf(
    state_dict: dict[str, Tensor],
    cfg: ModelConfig,
    out_dir: Path,
    tokenizer_dir: Path | None = None,
) -> None:
    """Write a transformers-loadable SmolLM3ForCausalLM directory.

    Args:
        state_dict: our model's state dict (wrapper prefixes are tolerated).
        cfg: the model's config; `qk_norm=True` is refused (no SmolLM3 equivalent).
        out_dir: created if missing; existing files of the same name are overwritten.
        tokenizer_dir: a saved tokenizer whose files (`tokenizer*`, vocab, merges, special
            tokens, chat template) are copied beside the weights.
    """
    out_dir = Path(out_dir)
    config = hf_config(cfg, dtype=_clean(state_dict)["embed.weight"].dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = to_hf_state_dict(state_dict, cfg)
    save_file({k: v.cpu() for k, v in weights.items()}, out_dir / WEIGHTS_NAME, {"format": "pt"})
    _write_json(out_dir / "config.json", config)
    generation = {"_from_model_config": True}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config[name] is not None:
            generation[name] = config[name]
    _write_json(out_dir / "generation_config.json", generation)
    if tokenizer_dir is not None:
        _copy_tokenizer(Path(tokenizer_dir), out_dir)


def _copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    files = [p for p in Path(tokenizer_dir).iterdir() if p.is_file()]
    wanted = [p for p in files if p.name.startswith("tokenizer") or p.name in TOKENIZER_FILES]
    if not wanted:
        raise FileNotFoundError(f"tokenizer_dir={tokenizer_dir} holds no tokenizer files")
    for path in wanted:
        shutil.copy2(path, out_dir / path.name)


def import_hf(hf_dir: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Read a SmolLM3 (or Llama) transformers directory back into our config and state dict."""
    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    cfg = _config_from_hf(config)
    return cfg, from_hf_state_dict(_load_hf_weights(hf_dir), cfg)


def _config_from_hf(config: dict) -> ModelConfig:
    model_type = config.get("model_type")
    if model_type not in ("smollm3", "llama"):
        raise ValueError(f"model_type={model_type!r} is not supported (smollm3 or llama)")
    for name in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if config.get(name):
            raise ValueError(f"{name}={config[name]} is not supported by model.Transformer")
    head_dim = config.get("head_dim")
    if head_dim and head_dim != config["hidden_size"] // config["num_attention_heads"]:
        raise ValueError(
            f"head_dim={head_dim} != hidden_size / num_attention_heads is not supported"
        )
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.pop("type", "default"))
    num_layers = config["num_hidden_layers"]
    eos = config.get("eos_token_id")
    return ModelConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=num_layers,
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        max_seq_len=config["max_position_embeddings"],
        rope_theta=float(rope_theta),
        rope_scaling=None if rope["rope_type"] == "default" else rope,
        nope_interval=_nope_interval(config, num_layers),
        tie_embeddings=config.get("tie_word_embeddings", True),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        init_std=config.get("initializer_range", 0.02),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        pad_token_id=config.get("pad_token_id"),
    )


def _nope_interval(config: dict, num_layers: int) -> int:
    """Recover our `nope_interval` from SmolLM3's `no_rope_layers` (1 = RoPE, 0 = NoPE)."""
    if config.get("model_type") == "llama":
        return 0
    uses_rope = config.get("no_rope_layers")
    interval = config.get("no_rope_layer_interval", 4)
    if uses_rope is None:
        return interval
    uses_rope = list(uses_rope)[:num_layers]
    if all(uses_rope):
        return 0
    for k in range(1, num_layers + 1):
        if uses_rope == [int((i + 1) % k != 0) for i in range(num_layers)]:
            return k
    raise ValueError(f"no_rope_layers={uses_rope} is not every k-th layer; unsupported")


def _load_hf_weights(hf_dir: Path) -> dict[str, Tensor]:
    index = hf_dir / f"{WEIGHTS_NAME}.index.json"
    if not index.exists():
        return load_file(hf_dir / WEIGHTS_NAME)
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    weights: dict[str, Tensor] = {}
    for shard in shards:
        weights.update(load_file(hf_dir / shard))
    return weights


def save_model(model_or_state_dict: nn.Module | dict, cfg: ModelConfig, out_dir: Path) -> None:
    """Save in our own format: `model.safetensors` (our names) and `model_config.json`."""
    state_dict = model_or_state_dict
    if isinstance(model_or_state_dict, nn.Module):
        state_dict = model_or_state_dict.state_dict()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous().cpu() for k, v in _clean(state_dict).items()}
    save_file(tensors, out_dir / WEIGHTS_NAME, {"format": "pt"})
    _write_json(out_dir / CONFIG_NAME, cfg.to_dict())


def load_model(model_dir: Path, device: str | torch.device = "cpu") -> Transformer:
    """Rebuild a `Transformer` saved by `save_model` (weights keep their saved dtype)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig(**json.loads((model_dir / CONFIG_NAME).read_text()))
    state_dict = load_file(model_dir / WEIGHTS_NAME, device=str(device))
    with torch.device(device):
        model = Transformer(cfg)
    dtype = state_dict["embed.weight"].dtype
    model.to(dtype).load_state_dict(state_dict)
    return model


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
