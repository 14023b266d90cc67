"""The ``dpo`` step: direct preference optimization through TRL's DPOTrainer.

The reference model is the SFT model (a second, frozen copy loaded from the same folder).
Held-out pairs are scored before and after training two ways:

- TRL's own eval metrics (``rewards/accuracies``, ``rewards/margins``): the implicit reward is
  ``beta * (log pi(y|x) - log pi_ref(y|x))``, so before training, with policy == reference, every
  margin is exactly 0 and the accuracy (strict ``>``) is 0.
- The policy's preference accuracy: the share of pairs where ``log p(chosen|prompt) >
  log p(rejected|prompt)``, summed over response tokens (the quantity DPO's rewards are built
  on), and the same with per-token means (length-normalized).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llmflow.tasks.framework.step import Metrics, RawFiles, report_table, step
from llmflow.tasks.posttrain.common import (
    TRAIN_EXECUTION,
    chat_tokenizer,
    common_training_args,
    load_normalized,
    quickstart_or_file,
    train_model,
)
from llmflow.tasks.posttrain.config import DPOStepConfig
from llmflow.tasks.posttrain.driver import PosttrainData, PosttrainMethod, run_posttrain, split_data
from llmflow.tasks.posttrain.formats import Record, normalize_preference
from llmflow.tasks.posttrain.quickstart import make_quickstart_preferences

if TYPE_CHECKING:  # NOTE: TRL (and mlflow under it) load when the step runs, not with the recipe
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from trl import DPOConfig, DPOTrainer

logger = logging.getLogger(__name__)
TRL_EVAL_KEYS = ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins")


def _chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list, **kwargs) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"])


def tokenize_pair(tokenizer: PreTrainedTokenizerBase, pair: Record) -> dict[str, list[int]]:
    """Prompt, chosen and rejected token ids, split the way TRL's DPOTrainer splits them.

    The response starts where the prompt rendered with the generation prompt and the full
    conversation stop sharing tokens.
    """
    prompt = _chat_ids(tokenizer, pair["prompt"], add_generation_prompt=True)
    chosen = _chat_ids(tokenizer, pair["prompt"] + pair["chosen"])
    rejected = _chat_ids(tokenizer, pair["prompt"] + pair["rejected"])
    shared = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
    return {
        "prompt_ids": prompt[:shared],
        "chosen_ids": chosen[shared:],
        "rejected_ids": rejected[shared:],
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@torch.no_grad()
def response_logps(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: list[Record],
    max_length: int,
    batch_size: int = 8,
) -> dict[str, torch.Tensor]:
    """Log-probabilities of chosen and rejected responses given their prompts.

    Sequences are truncated to ``max_length`` (keeping the start) like TRL's collator.

    Returns:
        ``chosen`` / ``rejected``: summed log-probs, shape (num_pairs,); ``chosen_tokens`` /
        ``rejected_tokens``: response token counts.
    """
    sums, counts = _summed_logps(model, tokenizer, pairs, max_length, batch_size)
    return {
        "chosen": sums[0],
        "rejected": sums[1],
        "chosen_tokens": counts[0],
        "rejected_tokens": counts[1],
    }


def _summed_logps(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: list[Record],
    max_length: int,
    batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`response_logps`' sums and token counts, shape (2, num_pairs): rows chosen, rejected."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=max_length)
    model.eval()
    sums, counts = [], []
    for start in range(0, len(pairs), batch_size):
        batch = collator([tokenize_pair(tokenizer, p) for p in pairs[start : start + batch_size]])
        batch = {k: v.to(model.device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        token_logps = logps.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)  # (2B, T-1)
        mask = batch["completion_mask"][:, 1:].to(token_logps.dtype)
        sums.append((token_logps * mask).sum(-1).view(2, -1))  # rows: chosen, rejected
        counts.append(mask.sum(-1).view(2, -1))
    return torch.cat(sums, dim=1).cpu(), torch.cat(counts, dim=1).cpu()


def preference_metrics(logps: dict[str, torch.Tensor]) -> dict[str, float]:
    """Preference accuracy (summed and length-normalized) and mean log-prob margin."""
    chosen_mean = logps["chosen"] / logps["chosen_tokens"].clamp(min=1)
    rejected_mean = logps["rejected"] / logps["rejected_tokens"].clamp(min=1)
    return {
        "preference_accuracy": (logps["chosen"] > logps["rejected"]).float().mean().item(),
        "preference_accuracy_length_normalized": (chosen_mean > rejected_mean)
        .float()
        .mean()
        .item(),
        "logp_margin": (logps["chosen"] - logps["rejected"]).mean().item(),
    }


def preference_accuracy(
    model_dir: Path, pairs: list[Record], max_length: int = 1024, batch_size: int = 8
) -> dict[str, float]:
    """Share of pairs where a saved model gives the chosen response the higher log-probability.

    Args:
        model_dir: HF model folder with a tokenizer and chat template.
        pairs: Normalized pairs (``load_preference_pairs``).
        max_length: Truncation length, as in training.
        batch_size: Pairs per forward pass.

    Returns:
        ``preference_accuracy`` (summed log-probs), ``preference_accuracy_length_normalized``
        (per-token means), ``logp_margin`` (mean summed chosen minus rejected).
    """
    model = train_model(model_dir, "sdpa")
    logps = response_logps(model, chat_tokenizer(model_dir), pairs, max_length, batch_size)
    return preference_metrics(logps)


def resolve_dpo_data(cfg: DPOStepConfig, out_dir: Path, data_path: Path | None) -> Path:
    """The local data file: ``data_path`` if given, else generated quickstart pairs, else cfg.data."""
    filename = "quickstart_preferences.jsonl"
    return quickstart_or_file(cfg, out_dir, data_path, filename, make_quickstart_preferences)


def dpo_training_args(cfg: DPOStepConfig, out_dir: Path) -> DPOConfig:
    """TRL's DPOConfig from the step config: checkpoints, no trackers, CPU-safe precision."""
    from trl import DPOConfig

    return DPOConfig(
        beta=cfg.beta,
        loss_type=[cfg.loss_type, "sft"] if cfg.sft_weight else [cfg.loss_type],
        loss_weights=[1.0, cfg.sft_weight] if cfg.sft_weight else None,
        max_length=cfg.max_length,
        **common_training_args(cfg, out_dir),
    )


def build_dpo_trainer(
    cfg: DPOStepConfig,
    sft_model_dir: Path,
    out_dir: Path,
    train: list[Record],
    heldout: list[Record],
) -> DPOTrainer:
    """A DPOTrainer whose policy and frozen reference both start from the SFT model."""
    from datasets import Dataset
    from trl import DPOTrainer

    return DPOTrainer(
        model=train_model(sft_model_dir, cfg.attn_implementation),
        ref_model=train_model(sft_model_dir, cfg.attn_implementation),
        args=dpo_training_args(cfg, out_dir),
        train_dataset=Dataset.from_list(train),
        eval_dataset=Dataset.from_list(heldout) if heldout else None,
        processing_class=chat_tokenizer(sft_model_dir),
    )


def heldout_scores(trainer: DPOTrainer, heldout: list[Record], cfg: DPOStepConfig) -> dict:
    """TRL's eval metrics and the policy's preference accuracy on the held-out pairs.

    NOTE: in bf16 the trainer autocasts the reference from the start but the policy only once
    ``train()`` has prepared it, so before training the policy computed in float32 against a
    bf16 reference (margins of 1e-6, not 0); the accelerator's autocast puts both in bf16,
    before and after (a no-op in fp32).
    """
    if not heldout:
        return {}
    with trainer.accelerator.autocast():
        trl_metrics = trainer.evaluate()
        logps = response_logps(
            trainer.model,
            trainer.processing_class,
            heldout,
            cfg.max_length,
            cfg.per_device_batch_size,
        )
    metrics = {k.removeprefix("eval_").replace("/", "_"): trl_metrics[k] for k in TRL_EVAL_KEYS}
    return {**metrics, **preference_metrics(logps)}


def evaluate_heldout(trainer: DPOTrainer, heldout: list[Record], cfg: DPOStepConfig, when: str):
    """`heldout_scores`, keys as in metrics.json: ``heldout_<metric>_<when>``."""
    scores = heldout_scores(trainer, heldout, cfg)
    return {f"heldout_{k}_{when}": v for k, v in scores.items()}


def heldout_rows(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """The held-out metrics of ``dpo()`` as two table rows, ``when`` = before / after.

    ``heldout_rewards_margins_before`` becomes ``{"when": "before", "rewards_margins": ...}``.
    """
    rows = []
    for when in ("before", "after"):
        row = {
            key.removeprefix("heldout_").removesuffix(f"_{when}"): value
            for key, value in metrics.items()
            if key.startswith("heldout_") and key.endswith(f"_{when}")
        }
        rows.append({"when": when, **row})
    return rows


def prepare_pairs(
    cfg: DPOStepConfig, model_dir: Path, data_file: Path, exclude: dict[int, str] | None = None
) -> tuple[list, list]:
    """Load, normalize and length-check pairs; rejects carry the record index and reason."""
    tokenizer = chat_tokenizer(model_dir)
    return load_normalized(
        data_file, normalize_preference, tokenizer, cfg.max_length, "prompt", exclude
    )


class DPOMethod(PosttrainMethod):
    """DPO (and APO, its ``loss_type``): preference pairs, TRL's DPOTrainer with the start model
    as the frozen reference, held-out rewards and preference accuracy."""

    name = "dpo"
    progress_keys = ("rewards/accuracies", "rewards/margins")

    def data(self, cfg, model_dir, out, data_path, exclude) -> PosttrainData:
        data_file = resolve_dpo_data(cfg, out, data_path)
        pairs, rejects = prepare_pairs(cfg, model_dir, data_file, exclude)
        return split_data(cfg, pairs, rejects, "pairs", "preference pairs", data_file)

    def trainer(self, cfg, model_dir, out, data) -> DPOTrainer:
        return build_dpo_trainer(cfg, model_dir, out, data.train, data.heldout)

    def heldout(self, trainer, cfg, model_dir, data, when) -> dict[str, Any]:
        return heldout_scores(trainer, data.heldout, cfg)

    def finish(self, cfg, out, data, before, after) -> dict[str, Any]:
        return {"beta": cfg.beta}

    def report(self, metrics, before, after) -> None:
        rows = heldout_rows(metrics)
        report_table("dpo-heldout", rows, "Held-out preference metrics before and after DPO")


DPO = DPOMethod()


# version 2: generation_config stops at the chat template's end of turn (<|eot_id|>, ...)
@step("dpo", version=2, gpu=True, execution=TRAIN_EXECUTION)
def dpo(
    cfg: DPOStepConfig,
    model: Path,
    out: Path,
    data: RawFiles | None = None,
    data_check: Path | None = None,
) -> Metrics:
    """DPO of an SFT model output (also the frozen reference) with TRL; the model lands in hf/.

    Args:
        cfg: The step config.
        model: The SFT model output; its ``hf/`` is the policy's start and the reference.
        out: Existing local folder; receives ``hf/``, ``rejects.jsonl``, ``metrics.json``,
            ``progress.json``, ``train_log.jsonl``.
        data: The user's preference file (overrides ``cfg.data``); None: ``cfg.data``.
        data_check: The data's ``decontaminate-posttrain`` output (``remove`` mode: records
            holding eval items are dropped, listed in the rejects).

    Returns:
        Headline metrics: pair and reject counts, train loss, and on held-out pairs before and
        after DPO: TRL's loss, reward accuracy and margin, and the policy's preference accuracy.

    Raises:
        BadInputError: no usable pair survives loading and length checks.
    """
    return run_posttrain(DPO, cfg, model, out, data, data_check)
