"""The ``grpo`` step: GRPO with verifiable rewards through TRL's GRPOTrainer.

Prompts come with reference answers: generated arithmetic (``data: quickstart``, held-out
questions disjoint from training ones) or GSM8K-format JSONL (``{"question", "answer": "...
#### 18"}``, or ``{"prompt", "answer"}``). Each training prompt gets ``num_generations`` sampled
completions, scored by the configured rewards (``rewards.py``); TRL turns the group-normalized
rewards into advantages and a clipped policy-gradient loss with a KL penalty to the start model.

Before and after training, the policy answers the held-out prompts greedily: exact-match
accuracy, mean reward, mean completion length in tokens; after training also the KL to the
reference (the start model), estimated on completions sampled from the policy. The numbers go to
``metrics.json``, a Prefect table and ``leaderboard_metrics.json`` (read by the leaderboard).

Generation runs through transformers (CPU or GPU). On a GPU, ``use_vllm: true`` makes TRL
generate with vLLM (``vllm_mode: colocate`` shares the training GPU; ``server`` talks to a
``trl vllm-serve`` process); vLLM is not a dependency of the package and must be installed there.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmflow.tasks.decontam.posttrain import drop_excluded
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, RawFiles, report_table, step
from llmflow.tasks.posttrain.common import (
    TRAIN_EXECUTION,
    chat_tokenizer,
    common_training_args,
    drop_long_prompts,
    require_examples,
    split_heldout,
    stop_token_ids,
    train_model,
)
from llmflow.tasks.posttrain.config import GRPOStepConfig
from llmflow.tasks.posttrain.driver import PosttrainData, PosttrainMethod, run_posttrain
from llmflow.tasks.posttrain.formats import Record, read_records, write_jsonl
from llmflow.tasks.posttrain.quickstart import quickstart_grpo_prompts

if TYPE_CHECKING:  # NOTE: TRL (and mlflow under it) load when the step runs, not with the recipe
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from trl import GRPOConfig, GRPOTrainer

from llmflow.tasks.posttrain.generation import generate, kl_to_reference
from llmflow.tasks.posttrain.rewards import (
    GuardedReward,
    exact_answer,
    gsm8k_answer,
    guarded_rewards,
)

logger = logging.getLogger("llmflow.posttrain.grpo")

GSM8K_INSTRUCTION = "Solve the problem step by step. End with a final line '#### <answer>'."
LEADERBOARD_FILE = "leaderboard_metrics.json"
FAILURES_FILE = "reward_failures.jsonl"
TASK = "verifiable_rewards"
HIGHER_IS_BETTER = {
    "exact_match": True,
    "mean_reward": True,
    "completion_length": False,
    "kl_to_reference": False,
}


# -- data -------------------------------------------------------------------------------------
def normalize_grpo(record: Any, index: int) -> Record:
    """One record as ``{"prompt": [messages], "answer": "N", "answer_format": ...}``.

    Raises:
        ValueError: the record has no usable answer (the caller turns it into a reject).
    """
    if not isinstance(record, dict):
        raise ValueError(f"record {index} is {type(record).__name__}, not an object")
    if "question" in record:
        return _normalize_gsm8k(record)
    prompt = record["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    answer = str(record["answer"]).strip()
    if not answer:
        raise ValueError("empty answer")
    return {
        "prompt": prompt,
        "answer": answer,
        "answer_format": record.get("answer_format", "gsm8k"),
    }


def _normalize_gsm8k(record: dict) -> Record:
    """A GSM8K record (``question``, ``answer`` ending in ``#### N``) under the GSM8K instruction.

    Raises:
        ValueError: the answer has no ``#### N`` line.
    """
    answer = gsm8k_answer(str(record.get("answer", "")))
    if answer is None:
        raise ValueError("answer has no '#### N' line")
    prompt = [
        {"role": "system", "content": GSM8K_INSTRUCTION},
        {"role": "user", "content": str(record["question"])},
    ]
    return {"prompt": prompt, "answer": answer, "answer_format": "gsm8k"}


def check_has_answers(records: list[Any], source: str) -> None:
    """A file whose records carry no answer cannot give verifiable rewards: fail before compute.

    Raises:
        BadInputError: no record has an ``answer`` field, or none has ``question``/``prompt``.
    """
    if not records:
        raise BadInputError(f"GRPO data {source} holds no records")
    dicts = [r for r in records if isinstance(r, dict)]
    if not any("answer" in r for r in dicts):
        keys = sorted(dicts[0]) if dicts else []
        raise BadInputError(
            f"GRPO data {source} has no 'answer' field (records have keys {keys}); GRPO needs a "
            "reference answer per prompt ({question, answer with '#### N'} or {prompt, answer})"
        )
    if not any("question" in r or "prompt" in r for r in dicts):
        raise BadInputError(f"GRPO data {source} has no 'question' or 'prompt' field")


def load_grpo_records(path: Path) -> tuple[list[Record], list[int], list[Record]]:
    """Normalized records (deduplicated by prompt), their source positions, and rejects."""
    raw = read_records(path)
    check_has_answers(raw, str(path))
    kept, indices, rejects, seen = [], [], [], set()
    for index, record in enumerate(raw):
        try:
            normalized = normalize_grpo(record, index)
        except (KeyError, ValueError) as err:
            rejects.append({"index": index, "reason": "no_answer", "detail": str(err)})
            continue
        key = json.dumps(normalized["prompt"], sort_keys=True)
        if key in seen:  # a duplicate could land on both sides of the held-out split
            rejects.append({"index": index, "reason": "duplicate_prompt", "detail": ""})
            continue
        seen.add(key)
        kept.append(normalized)
        indices.append(index)
    return kept, indices, rejects


def prepare_prompts(
    cfg: GRPOStepConfig,
    tokenizer: PreTrainedTokenizerBase,
    data_file: Path | None,
    exclude: dict[int, str] | None = None,
) -> tuple[list[Record], list[Record], list[Record]]:
    """``(train, heldout, rejects)``: training and held-out prompts never share a prompt;
    ``exclude``: positions holding eval items (the file's, or the generated training list's)."""
    if data_file is None:
        train, heldout = quickstart_grpo_prompts(
            cfg.num_quickstart_examples, cfg.num_heldout, cfg.seed
        )
        train, _, dropped = drop_excluded(train, list(range(len(train))), exclude or {})
        return train, heldout, dropped
    records, indices, rejects = load_grpo_records(data_file)
    records, indices, dropped = drop_excluded(records, indices, exclude or {})
    rejects = rejects + dropped
    kept, too_long = drop_long_prompts(records, indices, tokenizer, cfg.max_length, "prompt")
    rejects = rejects + too_long
    require_examples(kept, "GRPO prompts with answers", str(data_file), rejects)
    train, heldout = split_heldout(kept, cfg.num_heldout, cfg.seed)
    return train, heldout, rejects


def resolve_grpo_data(cfg: GRPOStepConfig, data_path: Path | None) -> Path | None:
    """The user's file (``data_path`` or ``cfg.data``), or None for the generated prompts."""
    if data_path is not None:
        return Path(data_path)
    return None if cfg.data == "quickstart" else Path(cfg.data)


# -- training ---------------------------------------------------------------------------------
def grpo_training_args(
    cfg: GRPOStepConfig, out_dir: Path, stop_ids: list[int] | None = None
) -> GRPOConfig:
    """TRL's GRPOConfig from the step config (``use_vllm`` / ``vllm_mode`` passed through).

    ``stop_ids``: the chat template's end of turn and eos; vLLM's sampling stops there (TRL's
    transformers generation reads them from the model's generation_config instead)."""
    from trl import GRPOConfig

    vllm_stop = {"stop_token_ids": stop_ids} if cfg.use_vllm and stop_ids else None
    return GRPOConfig(
        generation_kwargs=vllm_stop,
        num_generations=cfg.num_generations,
        max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature,
        beta=cfg.beta,
        scale_rewards=cfg.scale_rewards,
        loss_type=cfg.loss_type,
        reward_weights=[spec.weight for spec in cfg.rewards],
        use_vllm=cfg.use_vllm,
        vllm_mode=cfg.vllm_mode,
        **common_training_args(cfg, out_dir),
    )


def build_grpo_trainer(
    cfg: GRPOStepConfig,
    model_dir: Path,
    out_dir: Path,
    train: list[Record],
    rewards: list[GuardedReward],
) -> GRPOTrainer:
    """A GRPOTrainer over prompts with answers; the reference is the start model (``beta > 0``)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    tokenizer = chat_tokenizer(model_dir)
    model, stop = _model_stopping_at_end_of_turn(cfg, model_dir, tokenizer)
    return GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=grpo_training_args(cfg, out_dir, stop),
        train_dataset=Dataset.from_list(train),
        processing_class=tokenizer,
    )


def _model_stopping_at_end_of_turn(
    cfg: GRPOStepConfig, model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> tuple[PreTrainedModel, list[int]]:
    """The start model, its generation_config ending at the stop ids; and those ids."""
    model = train_model(model_dir, cfg.attn_implementation)
    # NOTE: TRL ends completions at the tokenizer's eos and the model's generation_config eos ids;
    # a start model whose config names eos alone (a base Llama 3 under a Llama 3 template) would
    # run past <|eot_id|> to max_completion_length.
    stop = stop_token_ids(tokenizer)
    model.generation_config.eos_token_id = stop
    return model, stop


# -- held-out evaluation ----------------------------------------------------------------------


def heldout_metrics(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: list[Record],
    rewards: list[GuardedReward],
    cfg: GRPOStepConfig,
) -> dict[str, float]:
    """Greedy answers to held-out prompts: exact match, mean weighted reward, mean length."""
    generations = generate(model, tokenizer, records, cfg.max_completion_length)
    texts = [g["text"] for g in generations]
    answers = [r["answer"] for r in records]
    formats = [r["answer_format"] for r in records]
    totals = _weighted_rewards(records, texts, rewards, cfg)
    exact = [exact_answer(t, a, f) for t, a, f in zip(texts, answers, formats, strict=True)]
    lengths = [len(g["completion_ids"]) for g in generations]
    return {
        "exact_match": sum(exact) / len(exact),
        "mean_reward": sum(totals) / len(totals),
        "completion_length": sum(lengths) / len(lengths),
    }


def _weighted_rewards(
    records: list[Record], texts: list[str], rewards: list[GuardedReward], cfg: GRPOStepConfig
) -> list[float]:
    """Each completion's reward: the configured rewards summed with their weights."""
    prompts = [r["prompt"] for r in records]
    answers = [r["answer"] for r in records]
    formats = [r["answer_format"] for r in records]
    columns = [reward(prompts, texts, answers, formats) for reward in rewards]
    weights = [spec.weight for spec in cfg.rewards]
    return [sum(w * c[i] for w, c in zip(weights, columns, strict=True)) for i in range(len(texts))]


def before_after_rows(before: dict[str, float], after: dict[str, float]) -> list[dict[str, Any]]:
    """The held-out metrics as two table rows, ``when`` = before / after."""
    return [{"when": "before", **before}, {"when": "after", **after}]


def write_leaderboard_metrics(out: Path, before: dict, after: dict) -> None:
    """The GRPO model's held-out metrics (and the start model's, suffixed) for the leaderboard."""
    metrics = {**after, **{f"{k}_before": v for k, v in before.items()}}
    higher = {**HIGHER_IS_BETTER, **{f"{k}_before": v for k, v in HIGHER_IS_BETTER.items()}}
    record = {"metrics": {TASK: metrics}, "higher_is_better": {TASK: higher}}
    (Path(out) / LEADERBOARD_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))


def write_failures(out: Path, rewards: list[GuardedReward]) -> dict[str, int]:
    """Every reward failure (function, prompt, completion, error) in reward_failures.jsonl."""
    failures = [f for r in rewards for f in r.failures]
    write_jsonl(Path(out) / FAILURES_FILE, failures)
    return {f"reward_failures_{r.name}": r.failed for r in rewards}


def evaluate_heldout(trainer, heldout, rewards, cfg, reference=None) -> dict[str, float]:
    """Held-out metrics of the trainer's policy (with the KL when ``reference`` is given)."""
    if not heldout:
        return {}
    tokenizer = trainer.processing_class
    metrics = heldout_metrics(trainer.model, tokenizer, heldout, rewards, cfg)
    metrics["kl_to_reference"] = (
        0.0  # the policy is the reference before training
        if reference is None
        else kl_to_reference(trainer.model, reference, tokenizer, heldout, cfg)
    )
    for reward in rewards:
        reward.check(final=True)
    return metrics


class GRPOMethod(PosttrainMethod):
    """GRPO: prompts with answers, TRL's GRPOTrainer with guarded rewards, greedy held-out
    answers (and the KL to the start model after training), a leaderboard entry."""

    name = "grpo"
    progress_keys = ("reward", "reward_std", "kl")

    def data(self, cfg, model_dir, out, data_path, exclude) -> PosttrainData:
        data_file = resolve_grpo_data(cfg, data_path)
        train, heldout, rejects = prepare_prompts(
            cfg, chat_tokenizer(model_dir), data_file, exclude
        )
        counts = {"num_train_prompts": len(train), "num_heldout_prompts": len(heldout)}
        rewards = guarded_rewards(cfg.rewards, cfg.max_failure_rate)
        return PosttrainData(train, heldout, rejects, counts, extra=rewards)

    def trainer(self, cfg, model_dir, out, data) -> GRPOTrainer:
        return build_grpo_trainer(cfg, model_dir, out, data.train, data.extra)

    def heldout(self, trainer, cfg, model_dir, data, when) -> dict[str, Any]:
        reference = None
        if when == "after" and data.heldout:
            reference = train_model(model_dir, cfg.attn_implementation)
        return evaluate_heldout(trainer, data.heldout, data.extra, cfg, reference)

    def finish(self, cfg, out, data, before, after) -> dict[str, Any]:
        if data.heldout:
            write_leaderboard_metrics(out, before, after)
        return write_failures(out, data.extra)

    def report(self, metrics, before, after) -> None:
        rows = before_after_rows(before, after) if before else []
        report_table(
            "grpo-heldout", rows, "Held-out verifiable-reward metrics before and after GRPO"
        )


GRPO = GRPOMethod()


# version 2: generation_config stops at the chat template's end of turn (<|eot_id|>, ...)
@step("grpo", version=2, gpu=True, execution=TRAIN_EXECUTION)
def grpo(
    cfg: GRPOStepConfig,
    model: Path,
    out: Path,
    data: RawFiles | None = None,
    data_check: Path | None = None,
) -> Metrics:
    """GRPO of an SFT or DPO model output on prompts with verifiable answers; model in hf/.

    Args:
        cfg: The step config.
        model: The start model output (SFT or DPO); also the KL reference.
        out: Existing local folder; receives ``hf/``, ``metrics.json``, ``rejects.jsonl``,
            ``reward_failures.jsonl``, ``leaderboard_metrics.json``, ``progress.json``,
            ``train_log.jsonl``.
        data: The user's prompt file (overrides ``cfg.data``); None: ``cfg.data``.
        data_check: The data's ``decontaminate-posttrain`` output (``remove`` mode: prompts
            holding eval items are dropped, listed in the rejects).

    Returns:
        Prompt counts, train loss and held-out exact match, mean reward, completion length
        (before and after) and the KL to the reference after training.

    Raises:
        BadInputError: the data has no answers or no usable prompt; a reward failed on more
            than ``max_failure_rate`` of its completions.
    """
    return run_posttrain(GRPO, cfg, model, out, data, data_check)
