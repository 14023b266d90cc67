"""The ``sft`` step: supervised fine-tuning on chat data through TRL's SFTTrainer.

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
from typing import TYPE_CHECKING, Any

from llmflow.tasks.framework.step import Metrics, RawFiles, step
from llmflow.tasks.posttrain.common import (
    TRAIN_EXECUTION,
    chat_tokenizer,
    check_assistant_masks,
    common_training_args,
    load_normalized,
    quickstart_or_file,
    train_model,
)
from llmflow.tasks.posttrain.config import SFTStepConfig
from llmflow.tasks.posttrain.driver import PosttrainData, PosttrainMethod, run_posttrain, split_data
from llmflow.tasks.posttrain.formats import Record, normalize_sft
from llmflow.tasks.posttrain.quickstart import make_quickstart_sft

if TYPE_CHECKING:  # NOTE: TRL (and mlflow under it) load when the step runs, not with the recipe
    from trl import SFTConfig, SFTTrainer

logger = logging.getLogger(__name__)


def resolve_sft_data(cfg: SFTStepConfig, out_dir: Path, data_path: Path | None) -> Path:
    """The local data file: ``data_path`` if given, else generated quickstart data, else cfg.data."""
    return quickstart_or_file(cfg, out_dir, data_path, "quickstart_sft.jsonl", make_quickstart_sft)


def sft_training_args(cfg: SFTStepConfig, out_dir: Path) -> SFTConfig:
    """TRL's SFTConfig from the step config: checkpoints, no trackers, CPU-safe precision."""
    from trl import SFTConfig

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
    tokenizer = chat_tokenizer(model_dir)
    from datasets import Dataset
    from trl import SFTTrainer

    return SFTTrainer(
        model=train_model(model_dir, cfg.attn_implementation),
        args=sft_training_args(cfg, out_dir),
        train_dataset=Dataset.from_list(train),
        eval_dataset=Dataset.from_list(heldout) if heldout else None,
        processing_class=tokenizer,
    )


def prepare_sft_examples(
    cfg: SFTStepConfig, model_dir: Path, data_file: Path, exclude: dict[int, str] | None = None
) -> tuple[list[Record], list[Record]]:
    """Load, normalize and length-check examples; rejects carry the record index and reason
    (``exclude``: positions holding eval items, dropped)."""
    tokenizer = chat_tokenizer(model_dir)
    if cfg.assistant_only_loss:
        check_assistant_masks(tokenizer, model_dir)  # before any record or weight is read
    return load_normalized(data_file, normalize_sft, tokenizer, cfg.max_length, "messages", exclude)


class SFTMethod(PosttrainMethod):
    """SFT: chat examples, TRL's SFTTrainer, the held-out loss."""

    name = "sft"
    progress_keys = ("mean_token_accuracy",)

    def data(self, cfg, model_dir, out, data_path, exclude) -> PosttrainData:
        data_file = resolve_sft_data(cfg, out, data_path)
        examples, rejects = prepare_sft_examples(cfg, model_dir, data_file, exclude)
        return split_data(cfg, examples, rejects, "examples", "SFT examples", data_file)

    def trainer(self, cfg, model_dir, out, data) -> SFTTrainer:
        return build_sft_trainer(cfg, model_dir, out, data.train, data.heldout)

    def heldout(self, trainer, cfg, model_dir, data, when) -> dict[str, Any]:
        return {"loss": trainer.evaluate()["eval_loss"]} if data.heldout else {}


SFT = SFTMethod()


# version 2: generation_config stops at the chat template's end of turn (<|eot_id|>, ...)
@step("sft", version=2, gpu=True, execution=TRAIN_EXECUTION)
def sft(
    cfg: SFTStepConfig,
    model: Path,
    out: Path,
    data: RawFiles | None = None,
    data_check: Path | None = None,
) -> Metrics:
    """Supervised fine-tuning of a model output with TRL; the chat model lands in hf/.

    Args:
        cfg: The step config.
        model: A model output (export, sft, dpo) whose ``hf/`` holds the model and a tokenizer
            with a chat template.
        out: Existing local folder; receives ``hf/``, ``rejects.jsonl``, ``metrics.json``,
            ``progress.json``, ``train_log.jsonl``.
        data: The user's data file (overrides ``cfg.data``); None: ``cfg.data``.
        data_check: The data's ``decontaminate-posttrain`` output; in ``remove`` mode the
            records holding eval items are dropped (listed in the rejects).

    Returns:
        Headline metrics: example and reject counts, held-out loss before and after, train loss.

    Raises:
        BadInputError: no usable example survives loading and length checks.
    """
    return run_posttrain(SFT, cfg, model, out, data, data_check)
