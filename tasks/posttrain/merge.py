"""The ``merge`` step: several model outputs combined into one, through mergekit.

Methods (mergekit's implementations, run on CPU from local folders, nothing downloaded):

- ``linear``: the weighted average of every parameter, ``sum_i w_i * theta_i``;
- ``slerp``: spherical interpolation of two models, per tensor, ``t`` of the way to the second;
- ``ties`` / ``dare_ties`` / ``dare_linear``: task vectors (each model minus ``models[base]``)
  trimmed to ``density`` (by magnitude for TIES, at random for DARE), sign-elected (TIES), and
  added back to the base with their weights.

SmolLM3's recipe is the quickstart's default: the preference-tuned (or GRPO) model merged
linearly with the long-context base at 0.9 / 0.1, which gives back some of what post-training
costs on long-context and pretraining-domain scores.

Every input must share the architecture and the vocabulary; a mismatch, or a weight list whose
length is not the number of models, fails before any tensor is read. The merged folder takes its
config, generation config, tokenizer and chat template from the first model.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.evaluation.models import hf_dir, write_progress
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.hashing import UNVERSIONED, versioned_fields
from llmflow.tasks.framework.step import Metrics, report_table, step

logger = logging.getLogger("llmflow.posttrain.merge")

# Config fields that fix every tensor's shape: merged models must agree on all of them.
SHAPE_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)
WEIGHT_FILES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


class MergeStepConfig(BaseModel):
    """How to merge the recipe's models, and which ones (``source`` with the long-context base)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Merge in the recipe.", json_schema_extra=UNVERSIONED)
    source: Literal["last", "sft", "dpo", "grpo"] = Field(
        "last",
        description="The post-trained model merged with the base: 'last' is GRPO when it runs, "
        "else DPO.",
        json_schema_extra=UNVERSIONED,
    )
    method: Literal["linear", "slerp", "ties", "dare_ties", "dare_linear"] = Field(
        "linear", description="mergekit merge method."
    )
    weights: list[float] = Field(
        default_factory=lambda: [0.9, 0.1],
        description="One weight per model, in input order (linear, TIES, DARE).",
    )
    t: float = Field(
        0.1, ge=0, le=1, description="SLERP: the share of the way to the second model."
    )
    density: float = Field(
        0.5, gt=0, le=1, description="TIES/DARE: the share of each task vector kept."
    )
    base: int = Field(
        1, ge=0, description="TIES/DARE: index of the base model the task vectors start from."
    )
    normalize: bool = Field(
        False, description="Linear/TIES: divide by the sum of the weights (mergekit 'normalize')."
    )
    seed: int = Field(0, description="Seed of DARE's random drops.")


def model_files(model: Path) -> Path:
    """The Hugging Face folder of a model output (or the folder itself)."""
    folder = hf_dir(model)
    return folder if (folder / "config.json").exists() else Path(model)


def check_compatible(cfg: MergeStepConfig, folders: list[Path]) -> None:
    """Fail before compute when the models cannot be merged as configured.

    Raises:
        BadInputError: a weight list that does not match the models, fewer than two models,
            SLERP of other than two, a base index out of range, different architectures
            (naming the field and both values) or different vocabularies.
    """
    _check_model_list(cfg, folders)
    configs = [json.loads((f / "config.json").read_text()) for f in folders]
    for folder, config in zip(folders[1:], configs[1:], strict=True):
        _same_architecture(folders[0], configs[0], folder, config)
        _same_vocabulary(folders[0], folder)


def _check_model_list(cfg: MergeStepConfig, folders: list[Path]) -> None:
    """The models' number, distinctness, weights and base index fit ``cfg`` (`check_compatible`)."""
    if len(folders) < 2:
        raise BadInputError(f"merge needs at least two models, got {len(folders)}")
    if cfg.method != "slerp" and len(cfg.weights) != len(folders):
        raise BadInputError(
            f"merge: weights={cfg.weights} has {len(cfg.weights)} entries for "
            f"{len(folders)} models ({', '.join(str(f) for f in folders)})"
        )
    if len({f.resolve() for f in folders}) < len(folders):
        raise BadInputError(f"merge: a model is given twice ({', '.join(map(str, folders))})")
    if cfg.method == "slerp" and len(folders) != 2:
        raise BadInputError(f"merge: slerp merges exactly two models, got {len(folders)}")
    if cfg.method in ("ties", "dare_ties", "dare_linear") and cfg.base >= len(folders):
        raise BadInputError(f"merge: base={cfg.base} is not an index of {len(folders)} models")


def _same_architecture(first: Path, a: dict, other: Path, b: dict) -> None:
    fields = ("architectures", *SHAPE_FIELDS)
    diff = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in fields if a.get(k) != b.get(k)]
    if diff:
        raise BadInputError(
            f"merge: {other} has another architecture than {first} ({'; '.join(diff)})"
        )


def _same_vocabulary(first: Path, other: Path) -> None:
    from transformers import AutoTokenizer

    a = AutoTokenizer.from_pretrained(first).get_vocab()
    b = AutoTokenizer.from_pretrained(other).get_vocab()
    if a != b:
        differing = sorted(set(a.items()) ^ set(b.items()), key=str)[:3]
        raise BadInputError(
            f"merge: {other} has another vocabulary than {first} ({len(a)} vs {len(b)} tokens; "
            f"e.g. {differing})"
        )


def mergekit_config(cfg: MergeStepConfig, folders: list[Path]) -> dict[str, Any]:
    """The mergekit YAML (as a dict) for ``cfg`` over local folders."""
    paths = [str(f) for f in folders]
    if cfg.method == "slerp":
        return {
            "merge_method": "slerp",
            "base_model": paths[0],
            "models": [{"model": p} for p in paths],
            "parameters": {"t": cfg.t},
            "dtype": "float32",
        }
    models = [
        {"model": p, "parameters": {"weight": w, **_sparsity(cfg)}}
        for p, w in zip(paths, cfg.weights, strict=True)
    ]
    merged: dict[str, Any] = {
        "merge_method": cfg.method,
        "models": models,
        "parameters": {"normalize": cfg.normalize},
        "dtype": "float32",
    }
    if cfg.method != "linear":
        merged["base_model"] = paths[cfg.base]
    return merged


def _sparsity(cfg: MergeStepConfig) -> dict[str, float]:
    return {} if cfg.method == "linear" else {"density": cfg.density}


class _QuietMergekit(logging.Filter):
    """mergekit logs through the root logger (architecture inference, per-run notices)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "mergekit" not in record.pathname


def run_mergekit(cfg: MergeStepConfig, folders: list[Path], target: Path) -> None:
    """Merge on CPU into ``target`` with mergekit."""
    import torch
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    quiet = _QuietMergekit()
    logging.getLogger().addFilter(quiet)
    try:
        torch.manual_seed(cfg.seed)  # DARE's random drops
        run_merge(
            MergeConfiguration.model_validate(mergekit_config(cfg, folders)),
            str(target),
            MergeOptions(device="cpu", copy_tokenizer=False, lazy_unpickle=False, quiet=True),
        )
    finally:
        logging.getLogger().removeFilter(quiet)


def copy_metadata(source: Path, target: Path) -> None:
    """Config, generation config, tokenizer and chat template of the first model, not weights."""
    for path in Path(source).iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_FILES):
            shutil.copy2(path, Path(target) / path.name)


def merge_models(cfg: MergeStepConfig, models: list[Path], target: Path) -> list[Path]:
    """Check, merge and complete one Hugging Face folder; returns the input folders."""
    folders = [model_files(m) for m in models]
    check_compatible(cfg, folders)
    run_mergekit(cfg, folders, target)
    copy_metadata(folders[0], target)
    return folders


def _write_merge_json(out: Path, cfg: MergeStepConfig, rows: list[dict[str, Any]]) -> None:
    """``merge.json``: the method, each input model with its weight, the versioned config."""
    (out / "merge.json").write_text(
        json.dumps(
            {"method": cfg.method, "inputs": rows, "config": versioned_fields(cfg)}, indent=1
        )
    )


@step("merge", version=2)
def merge(cfg: MergeStepConfig, models: list[Path], out: Path) -> Metrics:
    """Merge model outputs into one model in hf/; its lineage names every parent.

    Args:
        cfg: Method, weights and parameters.
        models: Model outputs (``hf/`` folders), in the order of ``cfg.weights``.
        out: Existing local folder; receives ``hf/``, ``merge.json`` and ``progress.json``.

    Returns:
        The method, the number of models and the weights.

    Raises:
        BadInputError: models that cannot be merged as configured (checked before compute).
    """
    folders = merge_models(cfg, models, hf_dir(out))
    weights = [1 - cfg.t, cfg.t] if cfg.method == "slerp" else cfg.weights
    rows = [{"model": str(m.name), "weight": w} for m, w in zip(models, weights, strict=True)]
    _write_merge_json(out, cfg, rows)
    write_progress(out, tokens_seen=None, step=None)
    report_table("merge", rows, f"{cfg.method} merge of {len(folders)} models")
    return {"method": cfg.method, "num_models": len(folders), "weights": json.dumps(weights)}
