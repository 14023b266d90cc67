"""Post-trained models stop at their chat template's end of turn, whatever token that is.

The fixture tokenizer (``conftest.py``) has ``<|im_end|>``, which hid this: here a Llama-3-style
template ends a turn with ``<|eot_id|>`` while config.json's eos is ``<|end_of_text|>``, and a base
Llama has no template at all and no ``<|im_end|>`` token.
"""

from __future__ import annotations

import json

import torch

from llmflow.tasks.posttrain.common import chat_tokenizer
from llmflow.tasks.posttrain.config import GRPOStepConfig, SFTStepConfig
from llmflow.tasks.posttrain.grpo import build_grpo_trainer, generate
from llmflow.tasks.posttrain.quickstart import quickstart_grpo_prompts
from llmflow.tasks.posttrain.rewards import guarded_rewards
from llmflow.tasks.posttrain.sft import sft
from tests.flows.tiny_llama import EOS, save_tiny_llama, save_tiny_llama3_chat

SFT_FAST = dict(max_length=96, per_device_batch_size=4, max_steps=2, num_heldout=2, logging_steps=1)
GRPO_FAST = dict(
    max_steps=1, per_device_batch_size=4, num_generations=4, max_completion_length=6,
    num_heldout=2, num_quickstart_examples=4, logging_steps=1,
)  # fmt: skip


def _ids(folder, *tokens):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def test_sft_export_of_a_llama3_template_model_stops_at_eot(tmp_path):
    base = tmp_path / "base"
    save_tiny_llama3_chat(base / "hf")
    eot, eos = _ids(base / "hf", "<|eot_id|>", EOS)
    out = tmp_path / "sft"
    out.mkdir()
    sft(SFTStepConfig(**SFT_FAST), base, out)
    config = json.loads((out / "hf" / "generation_config.json").read_text())
    assert config["eos_token_id"] == [eot, eos]  # before: 1 (<|end_of_text|>) alone


def test_grpo_generation_stops_at_a_llama3_templates_eot(tmp_path):
    save_tiny_llama3_chat(tmp_path / "hf")
    eot, eos = _ids(tmp_path / "hf", "<|eot_id|>", EOS)
    cfg = GRPOStepConfig(**GRPO_FAST)
    train, heldout = quickstart_grpo_prompts(4, 2, seed=0)
    rewards = guarded_rewards(cfg.rewards, cfg.max_failure_rate)
    trainer = build_grpo_trainer(cfg, tmp_path / "hf", tmp_path / "out", train, rewards)
    # TRL samples training completions with this config and ends them at these ids
    assert eot in trainer.generation_config.eos_token_id and eot in trainer.eos_token_ids
    # Held-out generation: a model whose every next token is <|eot_id|> answers with it alone.
    model = trainer.model

    def to_eot(module, inputs, logits):
        return logits.index_fill(-1, torch.tensor([eot], device=logits.device), 1e4)

    hook = model.lm_head.register_forward_hook(to_eot)
    try:
        generations = generate(model, trainer.processing_class, heldout, max_new_tokens=6)
    finally:
        hook.remove()
    assert [g["completion_ids"] for g in generations] == [[eot], [eot]]  # before: 6 x eot


def test_a_base_without_template_or_im_end_ends_assistant_turns_with_eos(tmp_path):
    """ChatML spelled out in ordinary tokens has no end-of-turn id to stop at: the assistant
    turn ends with eos instead, inside the assistant mask, and the export stops at eos."""
    base = tmp_path / "base"
    save_tiny_llama(base / "hf")
    (eos,) = _ids(base / "hf", EOS)
    tokenizer = chat_tokenizer(base / "hf")
    assert "<|im_end|>" not in tokenizer.get_vocab()
    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    rendered = tokenizer.apply_chat_template(
        chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    trained = [
        i for i, m in zip(rendered["input_ids"], rendered["assistant_masks"], strict=True) if m
    ]
    assert trained[-1] == eos  # the model is trained to end its turn with eos (before: "|>")
    assert tokenizer.decode(trained) == f"5{EOS}"
    out = tmp_path / "sft"
    out.mkdir()
    sft(SFTStepConfig(**SFT_FAST), base, out)
    config = json.loads((out / "hf" / "generation_config.json").read_text())
    assert config["eos_token_id"] == [eos]


def test_vllm_sampling_gets_the_stop_ids(tmp_path):
    """With use_vllm, TRL hands generation_kwargs to vLLM's SamplingParams (not run here: vLLM
    is not installed); the transformers path reads the model's generation_config instead."""
    from llmflow.tasks.posttrain.grpo import grpo_training_args

    vllm = grpo_training_args(GRPOStepConfig(use_vllm=True), tmp_path, [386, 1])
    assert vllm.generation_kwargs == {"stop_token_ids": [386, 1]}
    assert grpo_training_args(GRPOStepConfig(), tmp_path, [386, 1]).generation_kwargs is None
