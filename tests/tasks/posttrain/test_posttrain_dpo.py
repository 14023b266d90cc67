"""DPO through TRL: tokenization and margins against TRL, before/after metrics, export."""

from __future__ import annotations

import gzip
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import RawFiles
from llmflow.tasks.posttrain.common import split_heldout
from llmflow.tasks.posttrain.config import DPOStepConfig, SFTStepConfig
from llmflow.tasks.posttrain.dpo import (
    build_dpo_trainer,
    dpo,
    heldout_rows,
    preference_accuracy,
    prepare_pairs,
    response_logps,
    tokenize_pair,
)
from llmflow.tasks.posttrain.formats import load_preference_pairs, read_records, write_jsonl
from llmflow.tasks.posttrain.quickstart import quickstart_preference_pairs
from llmflow.tasks.posttrain.sft import sft

FAST = dict(max_length=64, per_device_batch_size=4, max_steps=2, num_heldout=4, logging_steps=1)


def test_pairs_tokenize_like_trl(tiny_model_dir, tokenizer, tmp_path):
    pairs = quickstart_preference_pairs(6, seed=1)
    trainer = build_dpo_trainer(DPOStepConfig(**FAST), tiny_model_dir, tmp_path, pairs, [])
    for pair, row in zip(pairs, trainer.train_dataset, strict=True):
        ours = tokenize_pair(tokenizer, pair)
        assert {k: row[k] for k in ours} == ours
        assert tokenizer.decode(ours["chosen_ids"]) == pair["chosen"][0]["content"] + "<|im_end|>\n"


@pytest.mark.parametrize(
    "model_fixture,sft_weight",
    [("tiny_model_dir", 0.0), ("tiny_smollm3_dir", 0.0), ("tiny_model_dir", 0.7)],
)
def test_reported_margins_and_loss_equal_trl(request, tmp_path, model_fixture, sft_weight):
    """Our log-probs give TRL's eval rewards, margins and sigmoid DPO loss on the same batch;
    with ``sft_weight`` the loss adds that weight times the chosen responses' token-mean NLL."""
    pairs = quickstart_preference_pairs(8, seed=2)
    cfg = DPOStepConfig(
        **{**FAST, "per_device_batch_size": 8, "beta": 0.3, "sft_weight": sft_weight}
    )
    model_dir = request.getfixturevalue(model_fixture)
    trainer = build_dpo_trainer(cfg, model_dir, tmp_path, pairs, pairs)
    torch.manual_seed(0)
    with torch.no_grad():  # move the policy away from the reference so margins are nonzero
        for param in trainer.model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    trl = trainer.evaluate()
    policy = response_logps(trainer.model, trainer.processing_class, pairs, cfg.max_length)
    ref = response_logps(trainer.ref_model, trainer.processing_class, pairs, cfg.max_length)
    chosen_rewards = cfg.beta * (policy["chosen"] - ref["chosen"])
    rejected_rewards = cfg.beta * (policy["rejected"] - ref["rejected"])
    margins = chosen_rewards - rejected_rewards
    assert margins.abs().max() > 1e-3
    expected = {
        "eval_logps/chosen": policy["chosen"].mean(),
        "eval_logps/rejected": policy["rejected"].mean(),
        "eval_rewards/chosen": chosen_rewards.mean(),
        "eval_rewards/margins": margins.mean(),
        "eval_rewards/accuracies": (margins > 0).float().mean(),
        "eval_loss": -F.logsigmoid(margins).mean()
        + sft_weight * -policy["chosen"].sum() / policy["chosen_tokens"].sum(),
    }
    for key, value in expected.items():
        assert trl[key] == pytest.approx(value.item(), rel=1e-4, abs=1e-5), key


def test_response_logps_by_hand(tiny_model_dir, tokenizer):
    pair = quickstart_preference_pairs(1, seed=3)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ours = response_logps(model, tokenizer, [pair], max_length=128)
    ids = tokenize_pair(tokenizer, pair)
    for side in ("chosen", "rejected"):
        full = ids["prompt_ids"] + ids[f"{side}_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([full])).logits[0]
        expected = sum(
            torch.log_softmax(logits[t - 1], -1)[full[t]].item()
            for t in range(len(ids["prompt_ids"]), len(full))
        )
        assert ours[side].item() == pytest.approx(expected, rel=1e-5)
        assert ours[f"{side}_tokens"].item() == len(ids[f"{side}_ids"])
    metrics = preference_accuracy(tiny_model_dir, [pair], max_length=128)
    assert metrics["preference_accuracy"] == float(ours["chosen"] > ours["rejected"])


def test_dpo_quickstart_fast(tiny_model_output, tmp_path, assert_chats, capfd):
    """A few steps from the tiny model: metrics before/after, rejects, HF export that chats;
    transformers' metric dicts reach train_log.jsonl, not the console."""
    cfg = DPOStepConfig(**{**FAST, "max_steps": 6, "learning_rate": 3e-3, "num_heldout": 24})
    metrics = dpo(cfg, tiny_model_output, tmp_path)
    console = "".join(capfd.readouterr())
    assert "{'loss':" not in console and "{'eval_loss':" not in console, console[-2000:]
    logged = (tmp_path / "train_log.jsonl").read_text().splitlines()
    assert sum('"rewards/margins"' in line for line in logged) >= cfg.max_steps
    # policy == reference before training: every implicit reward margin is exactly zero
    assert metrics["heldout_rewards_margins_before"] == 0.0
    assert metrics["heldout_rewards_accuracies_before"] == 0.0
    assert metrics["heldout_loss_before"] == pytest.approx(0.6931, abs=1e-4)
    assert metrics["num_steps"] == 6 and metrics["num_rejected"] == 0
    assert metrics["heldout_rewards_margins_after"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hf",
        "metrics.json",
        "progress.json",
        "quickstart_preferences.jsonl",
        "rejects.jsonl",
        "train_log.jsonl",
    ]
    assert (
        metrics["heldout_preference_accuracy_after"] > metrics["heldout_preference_accuracy_before"]
    )
    assert json.loads((tmp_path / "metrics.json").read_text()) == metrics
    before, after = heldout_rows(metrics)
    assert before["when"] == "before" and after["when"] == "after"
    assert before["rewards_margins"] == 0.0 and set(before) == set(after)
    assert after["preference_accuracy"] == metrics["heldout_preference_accuracy_after"]
    assert_chats(tmp_path / "hf")


@pytest.mark.slow
def test_sft_then_dpo_raises_heldout_preference_accuracy(tiny_model_output, tmp_path):
    """The quickstart recipe: SFT on noisy arithmetic chat, then DPO on preference pairs."""
    sft_out, dpo_out = tmp_path / "sft", tmp_path / "dpo"
    sft_out.mkdir(), dpo_out.mkdir()
    # A random-init model: toy-model learning rates (the class defaults suit real models).
    sft(SFTStepConfig(learning_rate=3e-3), tiny_model_output, sft_out)
    metrics = dpo(DPOStepConfig(learning_rate=2e-3), sft_out, dpo_out)
    before = metrics["heldout_preference_accuracy_before"]
    after = metrics["heldout_preference_accuracy_after"]
    assert after >= before + 0.2, (before, after)
    assert metrics["heldout_rewards_accuracies_after"] > 0.5
    assert metrics["heldout_rewards_margins_after"] > 0


def test_dpo_rejects_and_zero_usable_pairs(tiny_model_output, tmp_path):
    bad = [
        {"prompt": "Q", "chosen": "same", "rejected": "same"},
        {"prompt": "Q", "chosen": "", "rejected": "no"},
        {"prompt": "long " * 100, "chosen": "a", "rejected": "b"},
    ]
    data = tmp_path / "bad.jsonl"
    write_jsonl(data, bad)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BadInputError, match=r"no usable preference pairs .*chosen_equals_rejected"):
        dpo(DPOStepConfig(**FAST), tiny_model_output, out, RawFiles((str(data),)))
    assert not (out / "hf").exists()
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["index"], r["reason"]) for r in rejects] == [
        (0, "chosen_equals_rejected"),
        (1, "empty_response"),
        (2, "prompt_too_long"),
    ]


def test_dpo_on_real_hh_rlhf_transcripts(tiny_model_output, tmp_path, shared_data):
    records = read_records(shared_data / "dpo" / "hh_rlhf_harmless_base_test.jsonl.gz")[:40]
    data = tmp_path / "hh.jsonl.gz"
    with gzip.open(data, "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in records))
    out = tmp_path / "out"
    out.mkdir()
    cfg = DPOStepConfig(max_length=256, per_device_batch_size=2, max_steps=2, num_heldout=4)
    metrics = dpo(cfg, tiny_model_output, out, RawFiles((str(data),)))
    assert metrics["num_steps"] == 2
    assert metrics["num_pairs"] + metrics["num_rejected"] == 40
    assert metrics["num_pairs"] >= 8
    assert (out / "hf" / "config.json").exists()
    # Before training the policy is the reference: every margin 0, TRL's loss exactly ln 2.
    assert metrics["heldout_rewards_margins_before"] == 0.0
    assert metrics["heldout_loss_before"] == pytest.approx(math.log(2), abs=1e-6)
    # The policy's held-out preference accuracy, by hand from per-token log-probs.
    pairs, _ = prepare_pairs(cfg, tiny_model_output / "hf", data)
    _, heldout = split_heldout(pairs, cfg.num_heldout, cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_output / "hf")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_output / "hf").eval()
    margins = [_margin_by_hand(model, tokenize_pair(tokenizer, p), cfg.max_length) for p in heldout]
    wins = sum(m > 0 for m in margins) / len(margins)
    assert metrics["heldout_preference_accuracy_before"] == pytest.approx(wins)
    assert metrics["heldout_logp_margin_before"] == pytest.approx(
        sum(margins) / len(margins), rel=1e-4
    )


def _margin_by_hand(model, ids: dict[str, list[int]], max_length: int) -> float:
    """Summed log P(chosen | prompt) minus summed log P(rejected | prompt), token by token, on
    sequences cut to their first ``max_length`` tokens (as TRL's collator cuts them)."""
    totals = {}
    for side in ("chosen", "rejected"):
        full = (ids["prompt_ids"] + ids[f"{side}_ids"])[:max_length]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([full])).logits[0].double(), -1)
        totals[side] = sum(
            logprobs[t - 1, full[t]].item() for t in range(len(ids["prompt_ids"]), len(full))
        )
    return totals["chosen"] - totals["rejected"]


def test_real_hh_rlhf_transcripts_split_at_the_last_assistant_turn(shared_data):
    """Prompt, chosen and rejected of real hh-rlhf records, against a split by hand."""
    path = shared_data / "dpo" / "hh_rlhf_harmless_base_test.jsonl.gz"
    records = read_records(path)[:20]
    pairs, rejects = load_preference_pairs(path)
    assert not any(r["index"] < 20 for r in rejects)
    for record, pair in zip(records, pairs, strict=False):
        head, chosen = record["chosen"].rsplit("\n\nAssistant:", 1)
        assert pair["chosen"] == [{"role": "assistant", "content": chosen.strip()}]
        rejected = record["rejected"].rsplit("\n\nAssistant:", 1)[1]
        assert pair["rejected"] == [{"role": "assistant", "content": rejected.strip()}]
        turns = re.split(r"\n\n(Human|Assistant): ", head)[1:]
        roles = {"Human": "user", "Assistant": "assistant"}
        assert pair["prompt"] == [
            {"role": roles[who], "content": text.strip()}
            for who, text in zip(turns[::2], turns[1::2], strict=True)
        ]
