"""``init:`` from a bf16 checkpoint (as every released model is): the import keeps the dtype in
the model's config, pretraining holds float32 master weights, and the export is bf16 again
(weights and config.json), loading in transformers as bf16 with our logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from llmflow.flows.recipe import recipe
from llmflow.tasks.ingest.import_model import ImportModelConfig, import_model
from tests.flows.test_init_model import REPO, _config, _run
from tests.flows.tiny_llama import build_llama, build_tokenizer
from tests.model.test_hf_bf16 import U


@pytest.fixture
def bf16_mirror(tmp_path, monkeypatch):
    """The tiny Llama of ``test_init_model``, saved in bfloat16."""
    from llmflow.tasks.ingest.hub import MIRROR_ENV

    folder = tmp_path / "mirror" / REPO
    tokenizer = build_tokenizer()
    build_llama(len(tokenizer)).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    monkeypatch.setenv(MIRROR_ENV, str(tmp_path / "mirror"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


def _dtypes(path: Path) -> set[str]:
    with safe_open(path, framework="pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


def test_the_source_dtype_reaches_the_pretraining_config(bf16_mirror, tmp_path):
    """The stage trains the imported architecture with ``hf_dtype='bfloat16'``, and the
    imported checkpoint (bf16 weights) says the same, so the trainer accepts it as its init."""
    graph = recipe(_config(tmp_path / "runs"))
    (stage,) = graph.find(step="pretrain")
    model = stage.config.train.model_config_obj()
    assert model.hf_dtype == "bfloat16"
    assert stage.config.train.precision == "auto"  # the compute precision is another setting
    out = tmp_path / "imported"
    out.mkdir()
    metrics = import_model(ImportModelConfig(model=f"hf://models/{REPO}"), out=out)
    assert metrics["dtype"] == "bfloat16"
    saved = json.loads((out / "final" / "model_config.json").read_text())
    assert saved["hf_dtype"] == "bfloat16" and saved == json.loads(json.dumps(model.to_dict()))
    assert _dtypes(out / "final" / "model.safetensors") == {"BF16"}


@pytest.mark.slow
def test_continued_pretraining_of_a_bf16_model_exports_bf16(bf16_mirror, tmp_path):
    """12 float32 steps on CPU from the bf16 weights, then the export: bf16 weights and config,
    transformers loads it as bf16, and its logits are our model's in bf16 (tolerance: see
    ``tests/model/test_hf_bf16.py``)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from llmflow.model.hf import import_hf, load_model
    from llmflow.model.transformer import Transformer

    root = tmp_path / "runs"
    graph = recipe(_config(root))
    exported = _run(graph, root, "export")
    final = next((root / "pretrain").glob("*/final"))
    assert _dtypes(final / "model.safetensors") == {"F32"}  # the trainer's master weights

    hf = exported / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert (config["dtype"], config["torch_dtype"]) == ("bfloat16", "bfloat16")
    assert _dtypes(hf / "model.safetensors") == {"BF16"}
    theirs = AutoModelForCausalLM.from_pretrained(hf).eval()
    assert type(theirs) is LlamaForCausalLM and theirs.dtype == torch.bfloat16
    trained = load_model(final)
    source = LlamaForCausalLM.from_pretrained(bf16_mirror, dtype=torch.float32)
    moved = (trained.embed.weight - source.model.embed_tokens.weight).abs().max()
    assert moved > 1e-3  # it trained
    # the export is the trained weights rounded to bf16, and gives our bf16 logits
    assert torch.equal(theirs.model.embed_tokens.weight, trained.embed.weight.to(torch.bfloat16))
    cfg, state = import_hf(hf)
    ours = Transformer(cfg).to(torch.bfloat16).eval()
    ours.load_state_dict(state)
    ids = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours(ids).float(), theirs(ids).logits.float()
    diff = (got - want).abs().max().item()
    print(f"bf16 export after training: max|ours - theirs| {diff:.3e} of {want.abs().max():.2f}")
    assert diff <= 16 * U * want.abs().max()
