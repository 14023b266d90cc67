"""Post-training a model made elsewhere: SFT, DPO (APO) and merge from a tiny random Qwen2 (saved
Hub-layout in a mirror, with Qwen2.5's released chat template), the card naming the base; a
base model without a chat template, and a template TRL cannot mask, handled before compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.flows.hub_models import build_tokenizer, qwen_chat_template, save_hub_model

COMMIT = "c" * 40
MESSAGES = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
]


def test_qwen_template_gets_trl_training_masks_on_the_assistant_turn_only(tmp_path):
    from trl.chat_template_utils import get_training_chat_template

    from llmflow.tasks.posttrain.common import check_assistant_masks

    tokenizer = build_tokenizer(qwen_chat_template())
    check_assistant_masks(tokenizer, tmp_path)  # no markers of its own, but TRL patches it
    out = tokenizer.apply_chat_template(
        MESSAGES,
        chat_template=get_training_chat_template(tokenizer),
        return_assistant_tokens_mask=True,
        return_dict=True,
    )
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(masked) == "\n2 + 3 = 5.<|im_end|>\n"


def test_a_template_trl_cannot_mask_fails_before_the_data_is_read(tmp_path):
    from llmflow.tasks.framework.errors import BadInputError
    from llmflow.tasks.posttrain.config import SFTStepConfig
    from llmflow.tasks.posttrain.sft import prepare_sft_examples

    tokenizer = build_tokenizer("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(BadInputError, match="sft.assistant_only_loss=true.*no {% generation %}"):
        prepare_sft_examples(SFTStepConfig(), tmp_path, tmp_path / "never-read.jsonl")


def test_a_base_model_without_a_chat_template_gets_chatml(tmp_path):
    from llmflow.tasks.posttrain.common import chat_tokenizer
    from llmflow.tasks.tokenizer.train import CHAT_TEMPLATE

    build_tokenizer(None).save_pretrained(tmp_path)
    tokenizer = chat_tokenizer(tmp_path)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n2 + 3 = 5.<|im_end|>\n")
    assert tokenizer.pad_token == "<|endoftext|>"


@pytest.mark.slow  # SFT, DPO, merge and an lm-eval run of a 2-layer Qwen2 on CPU: ~2 min
def test_sft_dpo_and_merge_from_a_tiny_qwen2_card_names_the_base(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    from llmflow.tasks.evaluation.card import CardConfig, model_card
    from llmflow.tasks.evaluation.config import EvalConfig
    from llmflow.tasks.evaluation.external import external_model, pin_model
    from llmflow.tasks.evaluation.harness import evaluate
    from llmflow.tasks.framework.executor import Executor
    from llmflow.tasks.framework.graph import Graph, Raw
    from llmflow.tasks.posttrain.config import DPOStepConfig, SFTStepConfig
    from llmflow.tasks.posttrain.dpo import dpo
    from llmflow.tasks.posttrain.merge import MergeStepConfig, merge
    from llmflow.tasks.posttrain.sft import sft

    mirror = tmp_path / "mirror"
    save_hub_model(mirror, "acme/tiny-qwen", "qwen2", commit=COMMIT)
    monkeypatch.setenv("LLMFLOW_HUB_MIRROR", str(mirror))
    source, files = pin_model("hf://models/acme/tiny-qwen")
    small = dict(num_quickstart_examples=48, num_heldout=8, per_device_batch_size=4, max_steps=6)
    graph = Graph()
    base = graph.add(external_model, source, "tiny-qwen", files=Raw(files))
    tuned = graph.add(sft, SFTStepConfig(learning_rate=3e-3, **small), "t", model=base)
    apo = DPOStepConfig(loss_type="apo_zero", learning_rate=1e-3, **small)  # SmolLM3's APO
    aligned = graph.add(dpo, apo, "t", model=tuned)
    merged = graph.add(merge, MergeStepConfig(), "t", models=[aligned, base])
    scores = graph.add(
        evaluate, EvalConfig(tasks=["cf_arith"], num_items=8, limit=8), "t", model=aligned
    )
    card = graph.add(
        model_card, CardConfig(model_name="t-dpo"), "t", model=aligned, evaluation=scores
    )
    outcome = Executor(str(tmp_path / "runs")).run(graph)

    sft_metrics = outcome[tuned].metrics
    assert sft_metrics["heldout_loss_after"] < sft_metrics["heldout_loss_before"]
    dpo_metrics = outcome[aligned].metrics
    # APO-zero's loss 1 - sigmoid(b*dc) + sigmoid(b*dr) is exactly 1 while policy == reference
    assert dpo_metrics["heldout_loss_before"] == pytest.approx(1.0, abs=1e-6)
    assert dpo_metrics["heldout_loss_after"] < dpo_metrics["heldout_loss_before"]
    dpo_dir = Path(outcome[aligned].uri) / "hf"
    assert isinstance(AutoModelForCausalLM.from_pretrained(dpo_dir), Qwen2ForCausalLM)
    # the merge is 0.9 DPO + 0.1 the released base, tensor by tensor
    merged_w = load_file(Path(outcome[merged].uri) / "hf" / "model.safetensors")
    dpo_w = load_file(dpo_dir / "model.safetensors")
    base_w = load_file(mirror / "acme" / "tiny-qwen" / "model.safetensors")
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.embed_tokens.weight"):
        expected = 0.9 * dpo_w[name] + 0.1 * base_w[name]
        torch.testing.assert_close(merged_w[name], expected, rtol=1e-5, atol=1e-6)
    # the card names the pinned base: the Hub metadata its repo id, the text its commit
    text = (Path(outcome[card].uri) / "hf" / "README.md").read_text()
    assert "base_model: acme/tiny-qwen" in text
    assert f"trained with llmflow from `hf://models/acme/tiny-qwen@{COMMIT}`" in text
    assert "| sft | t |" in text and "| dpo | t |" in text  # its post-training runs
    source_file = Path(outcome[base].uri) / "source.json"
    assert json.loads(source_file.read_text())["commit"] == COMMIT


@pytest.mark.slow  # the recipe's data steps, import, export, SFT, DPO, evaluations: minutes
def test_the_recipe_post_trains_an_init_model_directly_and_the_card_names_it(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    from llmflow.flows.recipe import recipe
    from llmflow.tasks.config import load_config
    from llmflow.tasks.framework.executor import Executor
    from tests.flows.test_recipe import TINY

    mirror = tmp_path / "mirror"
    save_hub_model(mirror, "acme/tiny-qwen", "qwen2", commit=COMMIT)
    monkeypatch.setenv("LLMFLOW_HUB_MIRROR", str(mirror))
    small = [o for o in TINY if not o.startswith(("pretrain.", "extend.", "tokenizer."))]
    config = load_config(
        "configs/continue-pretrain.yaml",
        [f"root={tmp_path / 'runs'}", "init=hf://models/acme/tiny-qwen", "pretrain.stages=[]",
         "until=dpo", "dpo.loss_type=apo_zero", "safety.data_root=null", *small],
    )  # fmt: skip
    graph = recipe(config)
    assert not graph.find(step="pretrain") and not graph.find(step="import-model")
    assert graph.find(step="sft")[0].inputs["model"] is graph.find(step="external-model")[0]
    (card,) = [n for n in graph.find(step="card") if n.name.endswith("-dpo")]
    outcome = Executor(str(tmp_path / "runs")).run(graph.closure([card]))
    (aligned,) = graph.find(step="dpo")
    dpo_dir = Path(outcome[aligned].uri) / "hf"
    assert isinstance(AutoModelForCausalLM.from_pretrained(dpo_dir), Qwen2ForCausalLM)
    text = (Path(outcome[card].uri) / "hf" / "README.md").read_text()
    assert "base_model: acme/tiny-qwen" in text
    assert f"trained with llmflow from `hf://models/acme/tiny-qwen@{COMMIT}`" in text
