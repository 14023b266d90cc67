"""GRPO's held-out generation: completions of the prompts (greedy, or sampled from a seed) up
to the first end-of-turn id, their log-probabilities, and the KL to a reference model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from llmflow.tasks.posttrain.common import (
    stop_token_ids,
)
from llmflow.tasks.posttrain.config import GRPOStepConfig
from llmflow.tasks.posttrain.formats import Record

if TYPE_CHECKING:  # NOTE: transformers loads when the step runs, not with the recipe
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def _prompt_batch(tokenizer: PreTrainedTokenizerBase, records: list[Record], device) -> dict:
    texts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in records
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: list[Record],
    max_new_tokens: int,
    sample: bool = False,
    seed: int = 0,
    batch_size: int = 16,
) -> list[dict[str, Any]]:
    """Completions for ``records``: greedy, or sampled at temperature 1 from ``seed``.

    Returns:
        Per record: ``text``, ``prompt_ids`` and ``completion_ids`` (up to the first stop token,
        which is kept, as TRL keeps it).
    """
    model.eval()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    results = _generate_batches(model, tokenizer, records, max_new_tokens, sample, batch_size)
    torch.random.set_rng_state(generator_state)
    return results


def _generate_batches(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: list[Record],
    max_new_tokens: int,
    sample: bool,
    batch_size: int,
) -> list[dict[str, Any]]:
    """`generate`'s completions, ``batch_size`` prompts at a time (the seed set by the caller)."""
    stop = stop_token_ids(tokenizer)
    results = []
    for start in range(0, len(records), batch_size):
        batch = _prompt_batch(tokenizer, records[start : start + batch_size], model.device)
        output = model.generate(
            **batch,
            **_sampling(sample),
            max_new_tokens=max_new_tokens,
            eos_token_id=stop,
            pad_token_id=tokenizer.pad_token_id,
        )
        results += _completions(tokenizer, batch, output, stop)
    return results


def _sampling(sample: bool) -> dict[str, Any]:
    """``generate``'s arguments for sampling at temperature 1 (plain), or for greedy decoding."""
    return {
        "do_sample": sample,
        "temperature": 1.0 if sample else None,
        "top_k": 0 if sample else None,
        "top_p": 1.0 if sample else None,
    }


def _completions(
    tokenizer: PreTrainedTokenizerBase, batch: dict, output: torch.Tensor, stop: list[int]
) -> list[dict[str, Any]]:
    """`generate`'s records of one batch: the prompt without its padding, the completion."""
    width = batch["input_ids"].shape[1]
    results = []
    for row, mask in zip(output, batch["attention_mask"], strict=True):
        completion = _until_stop(row[width:].tolist(), stop)
        results.append(
            {
                "prompt_ids": row[:width][mask.bool().cpu()].tolist(),
                "completion_ids": completion,
                "text": tokenizer.decode(completion, skip_special_tokens=True),
            }
        )
    return results


def _until_stop(ids: list[int], stop: list[int]) -> list[int]:
    for i, token in enumerate(ids):
        if token in stop:
            return ids[: i + 1]
    return ids


@torch.no_grad()
def completion_logps(model: PreTrainedModel, generations: list[dict[str, Any]]) -> torch.Tensor:
    """Summed log-probability of each completion given its prompt, shape (n,)."""
    model.eval()
    sums = []
    for g in generations:
        ids = torch.tensor([g["prompt_ids"] + g["completion_ids"]], device=model.device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        logps = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        sums.append(logps[len(g["prompt_ids"]) - 1 :].sum())
    return torch.stack(sums).cpu() if sums else torch.zeros(0)


def kl_to_reference(
    policy: PreTrainedModel,
    reference: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: list[Record],
    cfg: GRPOStepConfig,
) -> float:
    """Monte Carlo KL(policy || reference) per completion: completions sampled from the policy,
    mean of ``log p_policy(y|x) - log p_reference(y|x)`` summed over the completion's tokens."""
    sampled = generate(policy, tokenizer, records, cfg.max_completion_length, True, cfg.seed)
    return (completion_logps(policy, sampled) - completion_logps(reference, sampled)).mean().item()
