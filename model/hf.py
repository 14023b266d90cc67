"""Conversion to and from Hugging Face model folders, and our own checkpoint format.

`import_hf` reads a LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, SmolLM3ForCausalLM,
Qwen3MoeForCausalLM or MixtralForCausalLM folder (`model/hf_arch.py` maps the config and refuses
what does not map). The experts of a mixture are written as the Hub's checkpoints hold them and
transformers' `save_pretrained` writes them, one tensor per expert and projection (Qwen3-MoE:
`mlp.experts.{e}.gate_proj/up_proj/down_proj`, router `mlp.gate`; Mixtral:
`block_sparse_moe.experts.{e}.w1/w3/w2`, router `block_sparse_moe.gate`); the import also reads
the fused 3-D form transformers 5 holds in memory (`mlp.experts.gate_up_proj`/`down_proj`, e.g.
a `torch.save` of its state dict). The export is a
directory of the architecture the model came from (SmolLM3ForCausalLM for a model trained here:
safetensors weights, `config.json` with the RoPE parameters, `generation_config.json`, tokenizer
files) that `AutoModelForCausalLM.from_pretrained` loads with the same logits as
`Transformer.forward`. Nothing here imports transformers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from llmflow.model.config import ModelConfig
from llmflow.model.hf_arch import config_from_hf, hf_config
from llmflow.model.transformer import Transformer
from llmflow.tasks.framework.errors import BadInputError

__all__ = ["export_hf", "hf_config", "import_hf", "load_model", "save_model"]

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


def to_hf_state_dict(
    state_dict: dict[str, Tensor], cfg: ModelConfig, fused_experts: bool = False
) -> dict[str, Tensor]:
    """Rename and split our tensors into transformers' Llama/Qwen/SmolLM3/Qwen3-MoE/Mixtral names.

    Args:
        fused_experts: a mixture's experts as transformers 5 holds them in memory (3-D
            `mlp.experts.gate_up_proj`/`down_proj`, router `mlp.gate`) instead of the per-expert
            tensors of the Hub's checkpoints (the default). The router's selection bias is not
            written (`export_hf` refuses a non-zero one).
    """
    sd = _clean(state_dict)
    sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
    hf = {theirs: sd[ours] for ours, theirs in _outer_renames(cfg).items()}
    for i, (ours, theirs) in enumerate(_layer_prefixes(cfg)):
        sparse = cfg.is_sparse(i)
        renames = _layer_renames(cfg, sparse)
        hf.update({theirs + dst: sd[ours + src] for src, dst in renames.items()})
        for kind in _qkv_kinds(cfg):
            q, k, v = sd[ours + f"attn.qkv_proj.{kind}"].split(sizes)
            hf[theirs + f"self_attn.q_proj.{kind}"] = q
            hf[theirs + f"self_attn.k_proj.{kind}"] = k
            hf[theirs + f"self_attn.v_proj.{kind}"] = v
        if sparse:
            hf.update(_experts_to_hf(sd, ours, theirs, cfg, fused_experts))
            continue
        gate, up = sd[ours + "mlp.gate_up_proj.weight"].chunk(2)
        hf[theirs + "mlp.gate_proj.weight"] = gate
        hf[theirs + "mlp.up_proj.weight"] = up
    return {name: t.contiguous() for name, t in hf.items()}


def from_hf_state_dict(
    hf: dict[str, Tensor], cfg: ModelConfig, fused_experts: bool = False
) -> dict[str, Tensor]:
    """Inverse of `to_hf_state_dict`: fuse q/k/v, gate/up (and stack the experts) back into our
    names; a router's selection bias is zero (the transformers classes have none)."""
    sd = {ours: hf[theirs] for ours, theirs in _outer_renames(cfg).items()}
    for i, (ours, theirs) in enumerate(_layer_prefixes(cfg)):
        sparse = cfg.is_sparse(i)
        sd.update(
            {ours + src: hf[theirs + dst] for src, dst in _layer_renames(cfg, sparse).items()}
        )
        for kind in _qkv_kinds(cfg):
            qkv = [hf[theirs + f"self_attn.{p}_proj.{kind}"] for p in "qkv"]
            sd[ours + f"attn.qkv_proj.{kind}"] = torch.cat(qkv)
        if sparse:
            sd.update(_experts_from_hf(hf, ours, theirs, cfg, fused_experts))
            continue
        gate_up = [hf[theirs + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]
        sd[ours + "mlp.gate_up_proj.weight"] = torch.cat(gate_up)
    return sd


_EXPERT_NAMES = {  # transformers class -> (its sparse block, gate, up, down of one expert)
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}


def _experts_to_hf(
    sd: dict[str, Tensor], ours: str, theirs: str, cfg: ModelConfig, fused: bool
) -> dict[str, Tensor]:
    """One sparse layer's router and experts in transformers' names."""
    router, gate_up, down = (
        sd[ours + "mlp.router.weight"],
        sd[ours + "mlp.experts.gate_up_proj"],
        sd[ours + "mlp.experts.down_proj"],
    )
    if fused:  # transformers 5's modules: `mlp` for Mixtral too
        return {
            theirs + "mlp.gate.weight": router,
            theirs + "mlp.experts.gate_up_proj": gate_up,
            theirs + "mlp.experts.down_proj": down,
        }
    block, gate_name, up_name, down_name = _EXPERT_NAMES[cfg.hf_model_type]
    out = {theirs + f"{block}.gate.weight": router}
    for e in range(cfg.num_experts):
        gate, up = gate_up[e].chunk(2)
        prefix = theirs + f"{block}.experts.{e}."
        out[prefix + f"{gate_name}.weight"] = gate
        out[prefix + f"{up_name}.weight"] = up
        out[prefix + f"{down_name}.weight"] = down[e]
    return out


def _experts_from_hf(
    hf: dict[str, Tensor], ours: str, theirs: str, cfg: ModelConfig, fused: bool
) -> dict[str, Tensor]:
    """One sparse layer's router and experts in our names (experts stacked on dim 0)."""
    if fused:
        router = hf[theirs + "mlp.gate.weight"]
        gate_up = hf[theirs + "mlp.experts.gate_up_proj"]
        down = hf[theirs + "mlp.experts.down_proj"]
    else:
        block, gate_name, up_name, down_name = _EXPERT_NAMES[cfg.hf_model_type]
        router = hf[theirs + f"{block}.gate.weight"]
        prefix = theirs + f"{block}.experts."
        gate_up = torch.stack(
            [
                torch.cat([hf[f"{prefix}{e}.{n}.weight"] for n in (gate_name, up_name)])
                for e in range(cfg.num_experts)
            ]
        )
        down = torch.stack([hf[f"{prefix}{e}.{down_name}.weight"] for e in range(cfg.num_experts)])
    return {
        ours + "mlp.router.weight": router,
        ours + "mlp.router.expert_bias": torch.zeros(cfg.num_experts, dtype=torch.float32),
        ours + "mlp.experts.gate_up_proj": gate_up,
        ours + "mlp.experts.down_proj": down,
    }


def _outer_renames(cfg: ModelConfig) -> dict[str, str]:
    """Ours -> transformers, for the tensors outside the layers (the head only when untied)."""
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def _layer_prefixes(cfg: ModelConfig) -> Iterator[tuple[str, str]]:
    """Each layer's name prefix: ours, transformers'."""
    for i in range(cfg.num_layers):
        yield f"layers.{i}.", f"model.layers.{i}."


def _qkv_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """The fused q/k/v projection's tensors: its weight, and its bias where it has one."""
    return ("weight", "bias") if cfg.attention_bias else ("weight",)


def _layer_renames(cfg: ModelConfig, sparse: bool = False) -> dict[str, str]:
    """Ours -> transformers, for a layer's unfused tensors (a sparse layer has no dense
    `down_proj`: its experts are renamed by `_experts_to_hf`)."""
    renames = dict(_LAYER_RENAMES)
    if sparse:
        del renames["mlp.down_proj.weight"]
    if cfg.qk_norm:
        renames["attn.q_norm.weight"] = "self_attn.q_norm.weight"
        renames["attn.k_norm.weight"] = "self_attn.k_norm.weight"
    return renames


def export_hf(
    state_dict: dict[str, Tensor],
    cfg: ModelConfig,
    out_dir: Path,
    tokenizer_dir: Path | None = None,
) -> None:
    """Write a transformers-loadable directory of the class `cfg.hf_model_type` names.

    The weights are written in `cfg.hf_dtype` when set (an imported bf16 checkpoint goes back
    to bf16 after the trainer held it in float32), else in their own dtype.

    Args:
        state_dict: our model's state dict (wrapper prefixes are tolerated).
        cfg: the model's config; SmolLM3 (the default) refuses `qk_norm=True` (no equivalent).
        out_dir: created if missing; existing files of the same name are overwritten.
        tokenizer_dir: a saved tokenizer whose files (`tokenizer*`, vocab, merges, special
            tokens, chat template) are copied beside the weights.
    """
    dtype = _export_dtype(state_dict, cfg)
    config = hf_config(cfg, dtype=dtype)
    _refuse_expert_bias(state_dict, cfg)
    weights = to_hf_state_dict(state_dict, cfg)
    weights = {k: v.to(device="cpu", dtype=dtype).contiguous() for k, v in weights.items()}
    _write_hf_folder(Path(out_dir), weights, config, tokenizer_dir)


def _refuse_expert_bias(state_dict: dict[str, Tensor], cfg: ModelConfig) -> None:
    """A router with a non-zero selection bias (auxiliary-loss-free balancing) chooses other
    experts than the transformers class, which has no such bias, would: `ValueError`."""
    sd = _clean(state_dict)
    for i in range(cfg.num_layers):
        bias = sd.get(f"layers.{i}.mlp.router.expert_bias")
        if bias is not None and bias.any():
            raise ValueError(
                f"layer {i}: router.expert_bias is non-zero (range [{bias.min().item():.4g}, "
                f"{bias.max().item():.4g}]); {cfg.hf_model_type} has no "
                "expert selection bias, so the export would route tokens to other experts "
                "(train with router_bias_update_rate=0 to export)"
            )


def _export_dtype(state_dict: dict[str, Tensor], cfg: ModelConfig) -> torch.dtype:
    """`cfg.hf_dtype` when set, else the weights' own dtype."""
    if cfg.hf_dtype is not None:
        return getattr(torch, cfg.hf_dtype)
    return _clean(state_dict)["embed.weight"].dtype


def _write_hf_folder(
    out_dir: Path, weights: dict[str, Tensor], config: dict, tokenizer_dir: Path | None
) -> None:
    """The export's files: weights, ``config.json``, ``generation_config.json``, tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, out_dir / WEIGHTS_NAME, {"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    if tokenizer_dir is not None:
        _copy_tokenizer(Path(tokenizer_dir), out_dir)


def _generation_config(config: dict) -> dict:
    """``generation_config.json``: the token ids of ``config.json`` that are set."""
    generation = {"_from_model_config": True}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config[name] is not None:
            generation[name] = config[name]
    return generation


def _copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    files = [p for p in Path(tokenizer_dir).iterdir() if p.is_file()]
    wanted = [p for p in files if p.name.startswith("tokenizer") or p.name in TOKENIZER_FILES]
    if not wanted:
        raise FileNotFoundError(f"tokenizer_dir={tokenizer_dir} holds no tokenizer files")
    for path in wanted:
        shutil.copy2(path, out_dir / path.name)


def import_hf(hf_dir: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Read a transformers model folder into our config and state dict.

    The config, then the weights' names and shapes (from the safetensors headers), are checked
    before any tensor is read; what does not map raises `BadInputError` naming the field or
    tensor. Weights keep their saved dtype, and a bf16 or fp16 `config.json` dtype is kept in
    `ModelConfig.hf_dtype`, so the export writes it back.
    """
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise BadInputError(f"{hf_dir}: no such folder")
    if not (hf_dir / "config.json").is_file():
        raise BadInputError(f"{hf_dir} has no config.json; not a transformers model folder")
    try:
        config = json.loads((hf_dir / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise BadInputError(f"{hf_dir / 'config.json'} is not JSON: {err}") from err
    cfg = config_from_hf(config, source=str(hf_dir / "config.json"))
    files = _weight_files(hf_dir)
    saved = _saved_shapes(files)
    fused = any(name.endswith(".experts.gate_up_proj") for name in saved)
    expected = _expected_shapes(cfg, fused)
    _check_shapes(saved, expected, cfg, hf_dir)
    weights = _load_weights(files)
    weights = {k: v for k, v in weights.items() if k in expected}
    return cfg, from_hf_state_dict(weights, cfg, fused)


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_IGNORED = ("rotary_emb.inv_freq",)  # derived buffers some older checkpoints hold


def _weight_files(hf_dir: Path) -> list[Path]:
    """The weight files of a folder: one file, or the shards its index lists."""
    for name in WEIGHT_FILES:
        index = hf_dir / f"{name}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [s for s in shards if not (hf_dir / s).is_file()]
            if missing:
                raise BadInputError(f"{index} lists shards that are missing: {missing}")
            return [hf_dir / shard for shard in shards]
        if (hf_dir / name).is_file():
            return [hf_dir / name]
    raise BadInputError(
        f"{hf_dir} has no weights: no {' or '.join(WEIGHT_FILES)} (nor a sharded index of one)"
    )


def _expected_shapes(cfg: ModelConfig, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """transformers' tensor names and shapes for `cfg` (from a model on the meta device); a
    mixture's experts per expert, or fused (`fused_experts`)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    hf = to_hf_state_dict(model.state_dict(), cfg, fused_experts)
    return {k: tuple(v.shape) for k, v in hf.items()}


def _saved_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(path, framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        else:  # a pickle checkpoint: memory-mapped, so only the shapes are read
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            shapes.update({k: tuple(v.shape) for k, v in state.items()})
    return shapes


def _check_shapes(
    saved: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    cfg: ModelConfig,
    hf_dir: Path,
) -> None:
    embed = saved.get("model.embed_tokens.weight")
    if embed is not None and embed[0] != cfg.vocab_size:
        raise BadInputError(
            f"{hf_dir}: vocab_size={cfg.vocab_size} in config.json, but the embedding "
            f"model.embed_tokens.weight has {embed[0]} rows"
        )
    _check_names(saved, expected, cfg, hf_dir)
    wrong = [(k, saved[k], shape) for k, shape in expected.items() if saved[k] != shape]
    if wrong:
        name, got, want = wrong[0]
        raise BadInputError(
            f"{hf_dir}: {name} has shape {list(got)}, config.json implies {list(want)}"
        )


def _check_names(
    saved: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    cfg: ModelConfig,
    hf_dir: Path,
) -> None:
    """Every tensor ``cfg`` implies is saved, and every saved one is used (or ignorable)."""
    missing = sorted(set(expected) - set(saved))
    if missing:
        raise BadInputError(
            f"{hf_dir}: the weights lack {len(missing)} tensor(s) config.json implies, e.g. "
            f"{missing[:3]}"
        )
    unused = sorted(
        k
        for k in set(saved) - set(expected)
        if not k.endswith(_IGNORED) and not (cfg.tie_embeddings and k == "lm_head.weight")
    )
    if unused:
        raise BadInputError(
            f"{hf_dir}: the weights hold {len(unused)} tensor(s) the "
            f"{cfg.hf_model_type} architecture does not use, e.g. {unused[:3]}"
        )


def _load_weights(files: list[Path]) -> dict[str, Tensor]:
    weights: dict[str, Tensor] = {}
    for path in files:
        if path.suffix == ".safetensors":
            weights.update(load_file(path))
        else:
            weights.update(torch.load(path, map_location="cpu", weights_only=True))
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
