"""Helpers shared by SFT and DPO: loading, length checks, held-out split, rejects, export."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from fsspec.implementations.local import LocalFileSystem

from llmflow.tasks.evaluation.models import (
    hf_dir,
    inference_router,
    load_hf_model,
    load_tokenizer,
    write_progress,
)
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.s3config import filesystem
from llmflow.tasks.framework.step import RawFiles

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer

from llmflow.tasks.posttrain.formats import (
    Message,
    Record,
    normalize_records,
    read_records,
    write_jsonl,
)

# Execution-only fields the trainers read (common_training_args): they leave the hash out.
TRAIN_EXECUTION = (
    "gradient_checkpointing",
    "logging_steps",
    "dataloader_num_workers",
    "checkpoint_interval",
)
REJECTS_FILE = "rejects.jsonl"
METRICS_FILE = "metrics.json"
END_OF_TURN = "<|im_end|>"
logger = logging.getLogger("llmflow.posttrain")


def load_normalized(
    path: Path,
    normalize: Callable[[Record], Record],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    key: str,
    exclude: dict[int, str] | None = None,
) -> tuple[list[Record], list[Record]]:
    """Read, normalize and length-check records; rejects name their position in the file.

    ``exclude``: positions to drop (eval items found in them), each with its reason."""
    from llmflow.tasks.decontam.posttrain import drop_excluded

    kept, indices, rejects = normalize_records(read_records(path), normalize)
    kept, indices, contaminated = drop_excluded(kept, indices, exclude or {})
    rejects += contaminated
    kept, too_long = drop_long_prompts(kept, indices, tokenizer, max_length, key)
    return kept, rejects + too_long


def chat_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved beside a model, with its chat template.

    A base model released without a chat template (a base Llama) gets the project's ChatML
    template (``tasks/tokenizer/train.py``): post-training teaches it, and the tokenizer saved
    with the result carries it. Its ``<|im_start|>``/``<|im_end|>`` are single tokens only where
    the vocabulary has them (Qwen, SmolLM); elsewhere they are spelled out in ordinary tokens,
    and a spelled-out ``<|im_end|>`` is no id generation can stop at: there every turn ends with
    the tokenizer's eos instead, which the model then learns to emit (see `stop_token_ids`).
    """
    tokenizer = load_tokenizer(model_dir)
    if not tokenizer.chat_template:
        tokenizer.chat_template = _chatml_template(tokenizer, model_dir)
    if tokenizer.pad_token is None:
        # NOTE: padding with eos would mask eos out of the labels in some collators; the project's
        # tokenizer has <|pad|>, this is only for foreign models.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _chatml_template(tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> str:
    """The project's ChatML template, its turns ending with eos where ``<|im_end|>`` is no token
    of the vocabulary (said once)."""
    from llmflow.tasks.tokenizer.train import CHAT_TEMPLATE

    template = CHAT_TEMPLATE
    if END_OF_TURN not in tokenizer.get_vocab() and tokenizer.eos_token:
        template = CHAT_TEMPLATE.replace("'<|im_end|>", "eos_token + '")
    _say_once(
        f"the tokenizer in {model_dir} has no chat template: using ChatML, turns ending "
        f"with {END_OF_TURN if template == CHAT_TEMPLATE else tokenizer.eos_token}"
    )
    return template


_PROBE = "llmflow end-of-turn probe"


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The token the chat template closes an assistant turn with, or None when that is no single
    added token (a template that closes turns with plain text, or none at all).

    ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``, Mistral's eos:
    read from an assistant turn the template renders, never from a list of known names.
    """
    from jinja2 import TemplateError

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except TemplateError:  # a template that wants another conversation shape: eos alone
        return None
    at = text.rfind(_PROBE)
    if at < 0:  # the template rewrote the content; nothing to read
        return None
    suffix = text[at + len(_PROBE) :].lstrip()
    ids = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
    return ids[0] if ids and ids[0] in tokenizer.added_tokens_decoder else None


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids that end a generated answer: the template's end of turn first, then eos."""
    ids = [end_of_turn_id(tokenizer), tokenizer.eos_token_id]
    return list(dict.fromkeys(i for i in ids if i is not None))


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        logger.info(message)


def check_assistant_masks(tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> None:
    """Assistant-only loss needs ``{% generation %}`` markers: the template's own, or those of
    TRL's training version of a template it knows (Qwen2.5, Qwen3, Llama 3, ...).

    Raises:
        BadInputError: neither, naming the folder and the way out.
    """
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if has_generation_markers(tokenizer.chat_template):
        return
    try:
        get_training_chat_template(tokenizer)
    except ValueError:
        raise BadInputError(
            f"sft.assistant_only_loss=true, but the chat template in {model_dir} has no "
            "{% generation %} markers and TRL has no training version of it: add the markers "
            "around the assistant turn, or set sft.assistant_only_loss=false"
        ) from None


def train_model(model_dir: Path, attn_implementation: str) -> PreTrainedModel:
    """Any causal LM saved in HF format, in float32 (mixed precision is the trainer's job)."""
    return load_hf_model(model_dir, dtype="float32", attn_implementation=attn_implementation)


def local_data(data: RawFiles | None, out_dir: Path) -> Path | None:
    """The user's one data file as a local path (a remote file is copied into ``out_dir``).

    Raises:
        BadInputError: more than one file was given.
    """
    if data is None:
        return None
    if len(data) != 1:
        raise BadInputError(f"post-training reads one data file, got {len(data)}: {list(data)}")
    fs, path = filesystem(data[0])
    if isinstance(fs, LocalFileSystem):
        return Path(path)
    target = Path(out_dir) / "data" / Path(path).name
    target.parent.mkdir(parents=True, exist_ok=True)
    fs.get_file(path, str(target))
    return target


def quickstart_or_file(
    cfg: Any,
    out_dir: Path,
    data_path: Path | None,
    filename: str,
    make: Callable[[Path, int, int], Path],
) -> Path:
    """The local data file: ``data_path`` if given, else quickstart data ``make`` generates into
    ``out_dir/filename`` (``cfg.num_quickstart_examples`` of them, from ``cfg.seed``), else
    ``cfg.data``."""
    if data_path is not None:
        return Path(data_path)
    if cfg.data == "quickstart":
        path = Path(out_dir) / filename
        return make(path, cfg.num_quickstart_examples, cfg.seed)
    return Path(cfg.data)


def prompt_length(tokenizer: PreTrainedTokenizerBase, prompt: list[Message]) -> int:
    """Tokens of a prompt rendered with the chat template and the generation prompt."""
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def first_prompt(messages: list[Message]) -> list[Message]:
    """The messages before the first assistant turn."""
    index = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:index]


def drop_long_prompts(
    records: list[Record],
    indices: list[int],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    key: str,
) -> tuple[list[Record], list[Record]]:
    """Drop records whose prompt leaves no room for a response within ``max_length``.

    Args:
        records: Normalized SFT examples (``key="messages"``) or pairs (``key="prompt"``).
        indices: Each record's position in the source file, for the rejects.
        tokenizer: Tokenizer with the chat template.
        max_length: Longest tokenized sequence.
        key: Field holding the conversation or prompt.

    Returns:
        ``(kept, rejects)``, rejects with reason ``prompt_too_long``.
    """
    kept, rejects = [], []
    for index, record in zip(indices, records, strict=True):
        prompt = first_prompt(record[key]) if key == "messages" else record[key]
        length = prompt_length(tokenizer, prompt)
        if length >= max_length:
            detail = f"prompt is {length} tokens, max_length is {max_length}"
            rejects.append({"index": index, "reason": "prompt_too_long", "detail": detail})
        else:
            kept.append(record)
    return kept, rejects


def split_heldout(records: list[Record], num_heldout: int, seed: int) -> tuple[list, list]:
    """Shuffle by seed, then hold out ``num_heldout`` records (never all of them)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    num_heldout = min(num_heldout, max(len(records) - 1, 0))
    heldout = [records[i] for i in sorted(order[:num_heldout])]
    train = [records[i] for i in sorted(order[num_heldout:])]
    return train, heldout


def write_rejects(out_dir: Path, rejects: list[Record]) -> dict[str, int]:
    """Write rejects.jsonl and return flat counts: ``num_rejected`` and ``rejected_<reason>``."""
    write_jsonl(Path(out_dir) / REJECTS_FILE, sorted(rejects, key=lambda r: r["index"]))
    counts = Counter(r["reason"] for r in rejects)
    return {"num_rejected": len(rejects), **{f"rejected_{k}": v for k, v in sorted(counts.items())}}


def require_examples(records: list[Record], what: str, source: str, rejects: list[Record]) -> None:
    """Fail before training when nothing usable is left.

    Raises:
        BadInputError: zero usable records, naming the source and the reject reasons.
    """
    if records:
        return
    reasons = dict(Counter(r["reason"] for r in rejects))
    raise BadInputError(
        f"no usable {what} in {source}: {len(rejects)} records rejected {reasons} "
        f"(details in {REJECTS_FILE})"
    )


def export_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path) -> Path:
    """Save model, tokenizer and chat template in HF format, stopping generation at end of turn."""
    out = Path(out)
    model = model.to(torch.float32)
    generation_config = model.generation_config
    generation_config.eos_token_id = stop_token_ids(tokenizer)
    generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    # NOTE: the Trainer turned the KV cache off for training; inference wants it back.
    model.config.use_cache = True
    inference_router(model)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def drop_checkpoints(path: Path) -> None:
    """Remove the Trainer's folder, its checkpoints included, once the model is exported: they
    serve a retry of this output only, and would make the committed output many times larger."""
    shutil.rmtree(path, ignore_errors=True)


def write_metrics(out_dir: Path, metrics: dict[str, Any]) -> None:
    """Write metrics.json (sorted keys) beside the outputs."""
    path = Path(out_dir) / METRICS_FILE
    path.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")


def finish_step(trainer: Trainer, out_dir: Path, metrics: dict[str, Any]) -> None:
    """From the main process: the model into ``hf/``, metrics.json, progress.json (no
    pretraining progress of its own); then drop the checkpoints, last, so a crash before this
    point still resumes."""
    if trainer.is_world_process_zero():
        export_model(trainer.model, trainer.processing_class, hf_dir(out_dir))
        write_metrics(out_dir, metrics)
        write_progress(out_dir, tokens_seen=None, step=None)
        drop_checkpoints(Path(trainer.args.output_dir))


def offline_environment() -> None:
    """Never reach the Hugging Face Hub from a step: every input is a local folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


# NOTE: TRL 1.x still calls transformers' deprecated is_gradient_checkpointing once per run.
warnings.filterwarnings(
    "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
)


def _checkpointing_arg(enabled: bool) -> dict[str, bool]:
    """transformers 5 renamed gradient_checkpointing (a deprecated alias warns on every run)."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    name = (
        "activation_checkpointing"
        if "activation_checkpointing" in fields
        else "gradient_checkpointing"
    )
    return {name: enabled}


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def common_training_args(cfg: Any, out_dir: Path) -> dict[str, Any]:
    """The TrainingArguments the methods share: a checkpoint every ``cfg.checkpoint_interval``
    steps (None: none; the driver resumes from them), no trackers, and the precision
    ``cfg.precision`` names (bf16: mixed precision over float32 weights, on CPU through
    ``use_cpu``, which transformers requires before it runs bf16 autocast without a GPU)."""
    cuda = _has_cuda()
    bf16 = cfg.uses_bf16("cuda" if cuda else "cpu")
    return dict(
        output_dir=str(Path(out_dir) / "trainer"),
        **_optimization_args(cfg),
        bf16=bf16,
        use_cpu=bf16 and not cuda,
        **_checkpointing_arg(cfg.gradient_checkpointing),
        dataloader_pin_memory=_has_cuda(),
        logging_steps=cfg.logging_steps,
        dataloader_num_workers=cfg.dataloader_num_workers,
        **_checkpoint_args(cfg),
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )


def _optimization_args(cfg: Any) -> dict[str, Any]:
    """Learning rate and schedule, steps or epochs, batch sizes and seeds of the step config."""
    return dict(
        learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler_type,
        warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay,
        max_steps=cfg.max_steps if cfg.max_steps is not None else -1,
        num_train_epochs=cfg.num_epochs,
        per_device_train_batch_size=cfg.per_device_batch_size,
        per_device_eval_batch_size=cfg.per_device_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        seed=cfg.seed,
        data_seed=cfg.seed,
    )


def _checkpoint_args(cfg: Any) -> dict[str, Any]:
    """A checkpoint every ``cfg.checkpoint_interval`` steps (None: none), the last two kept."""
    return dict(
        save_strategy="steps" if cfg.checkpoint_interval else "no",
        save_steps=cfg.checkpoint_interval or 500,
        # NOTE: the driver marks a checkpoint complete after transformers rotated the old ones
        # out; keeping two leaves the previous complete one until the new one is marked.
        save_total_limit=2,
    )
