"""Supervised fine-tuning on chat data through TRL's SFTTrainer (plain, Prefect-free).

Loss is on assistant tokens only: the chat template wraps assistant content in
``{% generation %}...{% endgeneration %}``, TRL asks for the assistant mask and sets every other
label to -100. Packing is TRL's best-fit-decreasing packing, which turns on padding-free
batches: one row holding several conversations, no attention mask, ``position_ids`` restarting
at 0 at each conversation. transformers derives a block-diagonal causal mask from those
position ids for ``sdpa`` and ``eager`` (``masking_utils.find_packed_sequence_indices``) and
``flash_attention_2`` uses them as varlen boundaries, so no token attends across examples on
CPU or GPU. ``tests/tasks/posttrain/test_posttrain_sft.py`` checks that a packed row's logits
equal those of its conversations run alone, for ``sdpa`` and ``eager``.

NOTE: transformers only looks for packed sequences when no KV cache is passed. The Trainer sets
``model.config.use_cache = False`` (``TrainingArguments.use_cache``); a model called with
``use_cache=True`` on a packed row silently attends across conversations.
NOTE: on CPU (``sdpa``/``eager``) the padding-free row is one sequence of ``batch * max_length``
tokens with a dense block-diagonal mask, so attention costs grow with its square; on GPU use
``flash_attention_2``, which runs the conversations as varlen segments.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from llmflow.tasks.posttrain.common import (
    common_training_args,
    finish_step,
    load_model,
    load_normalized,
    load_tokenizer,
    offline_environment,
    require_examples,
    split_heldout,
    write_rejects,
)
from llmflow.tasks.posttrain.config import SFTStepConfig
from llmflow.tasks.posttrain.formats import Record, normalize_sft
from llmflow.tasks.posttrain.quickstart import make_quickstart_sft

logger = logging.getLogger(__name__)


def resolve_sft_data(cfg: SFTStepConfig, out_dir: Path, data_path: Path | None) -> Path:
    """The local data file: ``data_path`` if given, else generated quickstart data, else cfg.data."""
    if data_path is not None:
        return Path(data_path)
    if cfg.data == "quickstart":
        path = Path(out_dir) / "quickstart_sft.jsonl"
        return make_quickstart_sft(path, cfg.num_quickstart_examples, cfg.seed)
    return Path(cfg.data)


def sft_training_args(cfg: SFTStepConfig, out_dir: Path) -> SFTConfig:
    """TRL's SFTConfig from the step config: no checkpoints, no trackers, CPU-safe precision."""
    return SFTConfig(
        max_length=cfg.max_length,
        packing=cfg.packing,
        packing_strategy="bfd",
        assistant_only_loss=cfg.assistant_only_loss,
        **common_training_args(cfg, out_dir),
    )


def build_sft_trainer(
    cfg: SFTStepConfig, model_dir: Path, out_dir: Path, train: list[Record], heldout: list[Record]
) -> SFTTrainer:
    """An SFTTrainer over normalized conversations (``{"messages": [...]}``)."""
    tokenizer = load_tokenizer(model_dir)
    return SFTTrainer(
        model=load_model(model_dir, cfg.attn_implementation),
        args=sft_training_args(cfg, out_dir),
        train_dataset=Dataset.from_list(train),
        eval_dataset=Dataset.from_list(heldout) if heldout else None,
        processing_class=tokenizer,
    )


def prepare_sft_examples(
    cfg: SFTStepConfig, model_dir: Path, data_file: Path
) -> tuple[list[Record], list[Record]]:
    """Load, normalize and length-check examples; rejects carry the record index and reason."""
    tokenizer = load_tokenizer(model_dir)
    return load_normalized(data_file, normalize_sft, tokenizer, cfg.max_length, "messages")


def sft(
    cfg: SFTStepConfig, model_dir: Path, out_dir: Path, data_path: Path | None = None
) -> dict[str, Any]:
    """Fine-tune a causal LM on chat data and export it in HF format.

    Args:
        cfg: The step config.
        model_dir: Local HF model folder (model + tokenizer with a chat template).
        out_dir: Existing local folder; receives ``model/``, ``rejects.jsonl``, ``metrics.json``.
        data_path: Local data file; overrides ``cfg.data`` (the flow passes the fetched file).

    Returns:
        Headline metrics: example and reject counts, held-out loss before and after, train loss.

    Raises:
        BadInputError: no usable example survives loading and length checks.
    """
    offline_environment()
    out_dir = Path(out_dir)
    data_file = resolve_sft_data(cfg, out_dir, data_path)
    examples, rejects = prepare_sft_examples(cfg, model_dir, data_file)
    metrics: dict[str, Any] = write_rejects(out_dir, rejects)
    require_examples(examples, "SFT examples", str(data_file), rejects)
    train, heldout = split_heldout(examples, cfg.num_heldout, cfg.seed)
    trainer = build_sft_trainer(cfg, model_dir, out_dir, train, heldout)
    if heldout:
        metrics["heldout_loss_before"] = trainer.evaluate()["eval_loss"]
    result = trainer.train()
    if heldout:
        metrics["heldout_loss_after"] = trainer.evaluate()["eval_loss"]
    metrics.update(
        num_examples=len(examples),
        num_train_examples=len(train),
        num_heldout_examples=len(heldout),
        num_steps=result.global_step,
        train_loss=result.training_loss,
    )
    finish_step(trainer, out_dir, metrics)
    logger.info("sft done: %s", metrics)
    return metrics
