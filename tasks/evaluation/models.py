"""Model outputs: where their Hugging Face folder lives, how it loads, what they have seen.

Every model output in the store (``export``, ``sft``, ``dpo``) holds its Hugging Face folder at
one fixed place, ``<output>/hf/``, and its training progress in ``<output>/progress.json``.
Nothing probes for other layouts. ``load_hf_model`` and ``load_tokenizer`` are the project's one
model loader and one tokenizer loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HF_DIR = "hf"
PROGRESS_FILE = "progress.json"


def hf_dir(output: Path) -> Path:
    """The Hugging Face folder of a model output (``<output>/hf``)."""
    return Path(output) / HF_DIR


def load_hf_model(
    folder: Path,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    device: str | None = None,
):
    """A causal LM from a Hugging Face folder (``AutoModelForCausalLM``), never from the Hub.

    Args:
        folder: A local folder with ``config.json`` and safetensors weights (``hf_dir(output)``).
        dtype: ``float32``, ``float16``, ``bfloat16`` or ``auto`` (the dtype saved in the folder).
        attn_implementation: ``sdpa``, ``eager``, ``flash_attention_2``...; None: transformers'
            default.
        device: Where to put the weights; None leaves them on the CPU.
    """
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, **kwargs)
    inference_router(model)
    return model if device is None else model.to(device)


def inference_router(model) -> None:
    """Turn a mixture of experts' router logits off (a no-op for a dense model).

    They only feed the load-balancing loss of training (TRL turns them on and a saved config keeps
    them), and with them on transformers' ``generate`` fails on its cached steps: the loss sees
    one token's router logits against the whole attention mask. A trainer that wants them sets
    them again from its own coefficient (TRL does).
    """
    config = model.config.get_text_config()
    if getattr(config, "output_router_logits", False):
        config.output_router_logits = False


def load_tokenizer(folder: Path):
    """The tokenizer of a Hugging Face folder or of a ``tokenizer`` step output (same files)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def write_progress(output: Path, tokens_seen: int | None, step: int | None) -> None:
    """Record how far training got (pretraining tokens and optimizer steps) in a model output."""
    progress = {"tokens_seen": tokens_seen, "step": step}
    (Path(output) / PROGRESS_FILE).write_text(json.dumps(progress, indent=1) + "\n")


def read_progress(output: Path) -> dict[str, int | None]:
    """``tokens_seen`` and ``step`` of a model output (None where it did not record them)."""
    path = Path(output) / PROGRESS_FILE
    progress = json.loads(path.read_text()) if path.exists() else {}
    return {"tokens_seen": progress.get("tokens_seen"), "step": progress.get("step")}
