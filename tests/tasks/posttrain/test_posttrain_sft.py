"""SFT through TRL: assistant-only labels, packing without cross-example attention, export."""

from __future__ import annotations

import json
import re

import pytest
import torch

from llmflow.tasks.evaluation.models import read_progress
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import RawFiles
from llmflow.tasks.posttrain.config import SFTStepConfig
from llmflow.tasks.posttrain.formats import load_sft_examples, write_jsonl
from llmflow.tasks.posttrain.quickstart import quickstart_sft_examples
from llmflow.tasks.posttrain.sft import build_sft_trainer, sft
from llmflow.tasks.tokenizer.train import CHAT_TEMPLATE

FAST = dict(max_length=64, per_device_batch_size=4, max_steps=3, num_heldout=4, logging_steps=1)


def _raw(path) -> RawFiles:
    return RawFiles((str(path),))


ASSISTANT_SPAN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


def _expected_labels(tokenizer, messages):
    """Labels by hand: token ids inside assistant content (+ its <|im_end|>), else -100."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = [m.span(1) for m in ASSISTANT_SPAN.finditer(text)]
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = []
    for token_id, (start, end) in zip(
        encoding["input_ids"], encoding["offset_mapping"], strict=True
    ):
        inside = any(s <= start and end <= e for s, e in spans)
        labels.append(token_id if inside else -100)
    return encoding["input_ids"], labels


def test_labels_mask_system_and_user_tokens_exactly(tiny_model_dir, tokenizer, tmp_path):
    examples = quickstart_sft_examples(12, seed=1)
    examples.append(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Who are you?"},
                {"role": "assistant", "content": "A helper."},
                {"role": "user", "content": "And?"},
                {"role": "assistant", "content": "Nothing more."},
            ]
        }
    )
    cfg = SFTStepConfig(**{**FAST, "packing": False, "max_length": 128})
    trainer = build_sft_trainer(cfg, tiny_model_dir, tmp_path, examples, [])
    assert any(m["role"] == "system" for e in examples for m in e["messages"])
    for example, row in zip(examples, trainer.train_dataset, strict=True):
        input_ids, labels = _expected_labels(tokenizer, example["messages"])
        assert row["input_ids"] == input_ids
        assert row["labels"] == labels
        assert any(label != -100 for label in labels)


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "tiny_smollm3_dir"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_row_has_no_cross_example_attention(
    request, tmp_path, attn_implementation, model_fixture
):
    model_dir = request.getfixturevalue(model_fixture)
    cfg = SFTStepConfig(**{**FAST, "max_length": 128, "attn_implementation": attn_implementation})
    trainer = build_sft_trainer(cfg, model_dir, tmp_path, quickstart_sft_examples(16, 2), [])
    row = trainer.train_dataset[0]
    lengths = row["seq_lengths"]
    assert len(lengths) > 1, "the row must hold several conversations"
    batch = trainer.data_collator([row])
    assert "attention_mask" not in batch  # padding-free: boundaries come from position_ids
    model = trainer.model.eval()
    assert model.config.use_cache is False  # the Trainer sets it; see the NOTE in sft.py
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    ids = batch["input_ids"]
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        alone, start = [], 0
        for length in lengths:
            alone.append(model(input_ids=ids[:, start : start + length]).logits[0])
            start += length
        alone = torch.cat(alone)
        # Negative control: with a KV cache, transformers skips packed-sequence detection.
        leaky = model(**inputs, use_cache=True).logits[0]
    torch.testing.assert_close(packed[: len(alone)], alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(leaky[: len(alone)], alone, atol=1e-3)


def test_sft_quickstart_trains_and_exports_a_chat_model(tiny_model_output, tmp_path, assert_chats):
    cfg = SFTStepConfig(**{**FAST, "max_steps": 6, "learning_rate": 3e-3})
    metrics = sft(cfg, tiny_model_output, tmp_path)
    assert metrics["num_steps"] == 6
    assert metrics["num_rejected"] == 0
    assert metrics["heldout_loss_after"] < metrics["heldout_loss_before"]
    assert json.loads((tmp_path / "metrics.json").read_text()) == metrics
    assert (tmp_path / "rejects.jsonl").read_text() == ""
    assert read_progress(tmp_path) == {"tokens_seen": None, "step": None}
    assert_chats(tmp_path / "hf")


def test_sft_rejects_long_prompts_and_bad_records(tiny_model_output, tmp_path):
    records = quickstart_sft_examples(8, seed=3) + [
        {"messages": [{"role": "user", "content": "Q"}]},
        {
            "messages": [
                {"role": "user", "content": "long " * 200},
                {"role": "assistant", "content": "ok"},
            ]
        },
    ]
    data = tmp_path / "data.jsonl"
    write_jsonl(data, records)
    out = tmp_path / "out"
    out.mkdir()
    metrics = sft(SFTStepConfig(**{**FAST, "max_steps": 1}), tiny_model_output, out, _raw(data))
    assert metrics["num_examples"] == 8
    assert metrics["rejected_no_assistant_turn"] == 1
    assert metrics["rejected_prompt_too_long"] == 1
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["index"], r["reason"]) for r in rejects] == [
        (8, "no_assistant_turn"),
        (9, "prompt_too_long"),
    ]


def test_zero_usable_examples_fails_before_training(tiny_model_output, tmp_path):
    data = tmp_path / "bad.jsonl"
    write_jsonl(data, [{"messages": [{"role": "user", "content": "Q"}]}, {"text": "x"}])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BadInputError, match=r"no usable SFT examples .*no_assistant_turn"):
        sft(SFTStepConfig(**FAST), tiny_model_output, out, _raw(data))
    assert not (out / "hf").exists()
    assert len((out / "rejects.jsonl").read_text().splitlines()) == 2


def test_sft_on_real_sharegpt_file(tiny_model_output, tmp_path, shared_data):
    data = shared_data / "sft" / "fastchat_dummy_conversation.json"
    cfg = SFTStepConfig(max_length=128, per_device_batch_size=2, max_steps=2, num_heldout=2)
    metrics = sft(cfg, tiny_model_output, tmp_path, _raw(data))
    assert metrics["num_steps"] == 2
    assert metrics["num_examples"] + metrics["num_rejected"] == 500
    assert (tmp_path / "hf" / "config.json").exists()


def test_real_sharegpt_conversations_map_and_mask_exactly(
    tiny_model_dir, tokenizer, shared_data, tmp_path
):
    """ShareGPT turns become user/assistant messages word for word, and SFT labels cover
    exactly the assistant tokens (a hand computation from character spans)."""
    path = shared_data / "sft" / "fastchat_dummy_conversation.json"
    raw = json.loads(path.read_text())[:8]
    roles = {"human": "user", "gpt": "assistant"}
    by_hand = [
        {
            "messages": [
                {"role": roles[t["from"]], "content": t["value"]} for t in r["conversations"]
            ]
        }
        for r in raw
    ]
    examples, rejects = load_sft_examples(path)
    assert examples[:8] == by_hand and not rejects
    cfg = SFTStepConfig(**{**FAST, "packing": False, "max_length": 512})
    trainer = build_sft_trainer(cfg, tiny_model_dir, tmp_path, by_hand, [])
    for example, row in zip(by_hand, trainer.train_dataset, strict=True):
        input_ids, labels = _expected_labels(tokenizer, example["messages"])
        assert row["input_ids"] == input_ids
        assert row["labels"] == labels
        assert sum(label != -100 for label in labels) >= 2  # two assistant turns


def test_fixture_template_matches_the_project_tokenizer(tokenizer):
    """The tests' chat template renders and masks exactly like the project tokenizer's."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "And 1 + 1?"},
        {"role": "assistant", "content": "1 + 1 = 2."},
    ]
    ours = {}
    for template in (None, CHAT_TEMPLATE):
        for prompt_only in (False, True):
            rendered = tokenizer.apply_chat_template(
                messages[:-1] if prompt_only else messages,
                chat_template=template,
                add_generation_prompt=prompt_only,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            if template is None:
                ours[prompt_only] = rendered
            else:
                assert rendered["input_ids"] == ours[prompt_only]["input_ids"]
                assert rendered["assistant_masks"] == ours[prompt_only]["assistant_masks"]
                assert 1 in rendered["assistant_masks"]


def test_sft_prints_pipeline_progress_not_transformers_dicts(tiny_model_output, tmp_path, capfd):
    """The console shows the pipeline's lines (``sft: step i/n loss ...``) through the
    ``llmflow`` logger, as the CLI's handler does; transformers' printed metric dicts go to
    ``train_log.jsonl`` in the output instead."""
    import logging
    import sys

    handler = logging.StreamHandler(sys.stderr)  # the console handler the CLI has
    llmflow_logger = logging.getLogger("llmflow")
    level = llmflow_logger.level
    llmflow_logger.addHandler(handler)
    llmflow_logger.setLevel(logging.INFO)
    try:
        sft(SFTStepConfig(**{**FAST, "max_steps": 4, "logging_steps": 2}), tiny_model_output,
            tmp_path)  # fmt: skip
    finally:
        llmflow_logger.removeHandler(handler)
        llmflow_logger.setLevel(level)
    out, err = capfd.readouterr()
    console = out + err
    assert "{'loss':" not in console and "{'eval_loss':" not in console, console[-2000:]
    for step in (2, 4):
        assert re.search(rf"^sft: step {step}/4 loss \d+\.\d{{4}} .*\(\d+\.\d s\)$", console,
                         re.MULTILINE), console[-2000:]  # fmt: skip
    assert re.search(r"^sft done: 4 steps, train_loss \d+\.\d{4}; held-out loss", console,
                     re.MULTILINE), console[-2000:]  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [2, 4]
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 4]  # before and after
