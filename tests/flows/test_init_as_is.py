"""``init`` with ``pretrain.stages: []``: the pinned model is post-trained, merged, evaluated and
carded as transformers loads it, not through our importer (which has no sliding-window attention;
a Qwen3-MoE it imports when a stage trains it). Tiny random ``Qwen3MoeForCausalLM`` and ``MistralForCausalLM`` in a
Hub-layout mirror (``tests/flows/foreign_models.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmflow.flows.recipe import recipe
from llmflow.tasks.config import load_config
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.ingest.hub import MIRROR_ENV
from tests.flows.foreign_models import KINDS, save_foreign_model
from tests.flows.test_recipe import TINY

COMMIT = "c" * 40
CONFIG = "configs/continue-pretrain.yaml"
SMALL = [o for o in TINY if not o.startswith(("pretrain.", "extend.", "tokenizer."))]


def _overrides(root: Path, repo: str, *extra: str) -> list[str]:
    return [f"root={root}", f"init=hf://models/{repo}", "pretrain.stages=[]", "until=merge",
            "dpo.loss_type=apo_zero", "grpo.enabled=false", "safety.data_root=null", *SMALL, *extra]  # fmt: skip


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    monkeypatch.setenv(MIRROR_ENV, str(tmp_path / "mirror"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "mirror"


@pytest.mark.parametrize("kind", KINDS)
def test_without_stages_the_pinned_folder_feeds_posttraining_evaluation_merge_and_card(
    mirror, tmp_path, kind
):
    folder = save_foreign_model(mirror, f"acme/tiny-{kind}", kind, COMMIT)
    config = load_config(CONFIG, _overrides(tmp_path / "runs", f"acme/tiny-{kind}"))
    graph = recipe(config)
    steps = {n.step.name for n in graph.nodes}
    assert not steps & {"import-model", "export", "pretrain"}
    (base,) = graph.find(step="external-model")
    assert base.config.pinned == f"hf://models/acme/tiny-{kind}@{COMMIT}"
    assert base.config.revision.startswith("local-")  # the mirror folder's fingerprint
    files = sorted(Path(f).relative_to(folder).as_posix() for f in base.inputs["files"].files)
    assert files == sorted(p.name for p in folder.iterdir() if p.is_file())  # no .cache
    assert "model.safetensors" in files and "chat_template.jinja" in files

    (tuned,) = graph.find(step="sft")
    (merged,) = graph.find(step="merge")
    assert tuned.inputs["model"] is base
    assert merged.inputs["models"] == [graph.find(step="dpo")[0], base]
    by_label = {n.name.removeprefix(f"{config.name}-"): n for n in graph.find(step="evaluate")}
    assert by_label["base"].inputs["model"] is base
    cards = {n.name.removeprefix(f"{config.name}-"): n for n in graph.find(step="card")}
    assert cards["base"].inputs["model"] is base
    assert sorted(cards) == ["base", "dpo", "merged", "sft"]
    # held-out perplexity documents are tokenized with the model's own tokenizer
    (tokenizer,) = graph.find(step="import-tokenizer")
    assert tokenizer.inputs["model"] is base


def test_with_a_stage_an_moe_init_is_imported_and_pretrained(mirror, tmp_path):
    """Qwen3-MoE imports (tests/model/test_hf_moe.py trains one); Mistral is refused before
    anything is written."""
    save_foreign_model(mirror, "acme/tiny-moe", "qwen3-moe", COMMIT)
    root = tmp_path / "runs"
    overrides = [o for o in _overrides(root, "acme/tiny-moe") if o != "pretrain.stages=[]"]
    graph = recipe(load_config(CONFIG, overrides))
    (stage,) = graph.find(step="pretrain")
    assert stage.inputs["init"] is graph.find(step="import-model")[0]
    model = stage.config.train.model_config_obj()
    assert (model.hf_model_type, model.num_experts, model.num_experts_per_tok) == (
        "qwen3_moe",
        4,
        2,
    )
    save_foreign_model(mirror, "acme/tiny-mistral", "mistral", COMMIT)
    overrides = [o for o in _overrides(root, "acme/tiny-mistral") if o != "pretrain.stages=[]"]
    with pytest.raises(BadInputError, match=r"MistralForCausalLM'\] is not supported"):
        recipe(load_config(CONFIG, overrides))
    assert not root.exists()


def test_the_import_tokenizer_reads_ids_from_the_pinned_folder(mirror, tmp_path):
    from transformers import AutoTokenizer

    from llmflow.tasks.evaluation.external import external_model, pin_model
    from llmflow.tasks.ingest.import_model import ImportTokenizerConfig, import_tokenizer

    folder = save_foreign_model(mirror, "acme/tiny-mistral", "mistral", COMMIT)
    source, files = pin_model("hf://models/acme/tiny-mistral", "init")
    model_out, tok_out = tmp_path / "model", tmp_path / "tok"
    model_out.mkdir(), tok_out.mkdir()
    external_model(source, out=model_out, files=list(files))
    meta = import_tokenizer(ImportTokenizerConfig(), model=model_out, out=tok_out)
    hf = AutoTokenizer.from_pretrained(folder)
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    # Mistral has no pad: a spare embedding row if there is one, else eos
    pad = len(hf) if len(hf) < rows else hf.eos_token_id
    assert meta == {"vocab_size": rows, "tokenizer_vocab_size": len(hf),
                    "eos_id": hf.eos_token_id, "pad_id": pad, "bos_id": hf.bos_token_id}  # fmt: skip
    assert (tok_out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()


@pytest.mark.slow  # per model: the recipe's data steps, SFT, DPO, merge, 4 lm-eval runs: minutes
@pytest.mark.parametrize("kind", KINDS)
def test_the_recipe_post_trains_merges_and_evaluates_an_init_model_as_it_is(mirror, tmp_path, kind):
    import torch
    import transformers

    from llmflow.tasks.framework.executor import Executor

    folder = save_foreign_model(mirror, f"acme/tiny-{kind}", kind, COMMIT)
    cls = {"qwen3-moe": "Qwen3MoeForCausalLM", "mistral": "MistralForCausalLM"}[kind]
    extra = ["sft.learning_rate=0.003", "sft.max_steps=6", "dpo.learning_rate=0.001",
             "dpo.sft_weight=0"]  # fmt: skip
    config = load_config(CONFIG, _overrides(tmp_path / "runs", f"acme/tiny-{kind}", *extra))
    graph = recipe(config)
    cards = {n.name.removeprefix(f"{config.name}-"): n for n in graph.find(step="card")}
    outcome = Executor(str(tmp_path / "runs")).run(graph.closure(list(cards.values())))
    out = {s: Path(outcome[graph.find(step=s)[0]].uri)
           for s in ("external-model", "sft", "dpo", "merge")}  # fmt: skip

    sft_metrics = outcome[graph.find(step="sft")[0]].metrics
    assert sft_metrics["heldout_loss_after"] < sft_metrics["heldout_loss_before"]
    dpo_metrics = outcome[graph.find(step="dpo")[0]].metrics
    # APO-zero's loss 1 - sigmoid(b*dc) + sigmoid(b*dr) is exactly 1 while policy == reference;
    # an MoE adds TRL's load-balancing term, 0.001 x an aux loss of at most experts x top-k = 8
    assert dpo_metrics["heldout_rewards_margins_before"] == 0.0
    slack = 0.008 if kind == "qwen3-moe" else 1e-6
    assert 1.0 - 1e-6 <= dpo_metrics["heldout_loss_before"] <= 1.0 + slack
    assert dpo_metrics["heldout_loss_after"] < dpo_metrics["heldout_loss_before"]
    loaded = {}
    for step in ("sft", "dpo", "merge"):  # the released class, not a conversion of ours
        loaded[step] = transformers.AutoModelForCausalLM.from_pretrained(out[step] / "hf")
        assert type(loaded[step]) is getattr(transformers, cls)
    # the merge is 0.9 DPO + 0.1 the released base, tensor by tensor, experts included (as
    # transformers holds them: mergekit writes an MoE's experts fused, the base has them apart)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    tuned, merged = loaded["dpo"].state_dict(), loaded["merge"].state_dict()
    assert set(merged) == set(base) and len(base) > 10
    for name in base:
        torch.testing.assert_close(merged[name], 0.9 * tuned[name] + 0.1 * base[name])
    assert any(not torch.equal(tuned[n], base[n]) for n in base)  # post-training moved it
    # every model was evaluated: the base as it is, from the pinned folder's copy
    for label in ("base", "sft", "dpo", "merged"):
        evaluation = Path(outcome[cards[label].inputs["evaluation"]].uri)
        results = json.loads((evaluation / "results.json").read_text())
        assert results["model_dir"] == str(Path(outcome[cards[label].inputs["model"]].uri) / "hf")
        assert results["n_samples"]["cf_arith"]["effective"] == 4  # evaluate.num_items
        assert results["metrics"]["cf_arith"]["acc"] in (0.0, 0.25, 0.5, 0.75, 1.0)
        assert results["metrics"]["ppl_prose"]["bits_per_byte"] > 0
    copied = out["external-model"] / "hf"
    assert (copied / "model.safetensors").read_bytes() == (
        folder / "model.safetensors"
    ).read_bytes()
    # the cards name the pinned base: the Hub metadata its repo id, the text its commit
    for label, origin in [("base", "The causal language model"),
                          ("dpo", "A causal language model trained with llmflow from"),
                          ("merged", "A causal language model trained with llmflow from")]:  # fmt: skip
        text = (Path(outcome[cards[label]].uri) / "hf" / "README.md").read_text()
        assert f"base_model: acme/tiny-{kind}" in text
        assert f"{origin} `hf://models/acme/tiny-{kind}@{COMMIT}`" in text


def _generate(model, tokenizer) -> list[int]:
    import torch

    batch = tokenizer(["What is 2 + 3?", "Paris is"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    return out.tolist()


def test_router_logits_a_trainer_turned_on_are_off_when_loaded_and_exported(tmp_path):
    """TRL's trainers turn ``output_router_logits`` on in an MoE's config (its load-balancing
    loss); with it on, generate() with an attention mask fails in transformers."""
    import transformers

    from llmflow.tasks.evaluation.models import load_hf_model
    from llmflow.tasks.posttrain.common import export_model

    folder = save_foreign_model(tmp_path, "acme/moe", "qwen3-moe", COMMIT)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    want = _generate(transformers.AutoModelForCausalLM.from_pretrained(folder), tokenizer)
    trained = transformers.AutoModelForCausalLM.from_pretrained(folder)
    trained.config.output_router_logits = True  # as SFTTrainer leaves it
    with pytest.raises(RuntimeError, match="must match the size"):  # transformers' failure
        _generate(trained, tokenizer)
    trained.save_pretrained(tmp_path / "saved")
    assert _generate(load_hf_model(tmp_path / "saved"), tokenizer) == want
    export_model(trained, tokenizer, tmp_path / "exported")
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["output_router_logits"] is False
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert _generate(exported, tokenizer) == want
