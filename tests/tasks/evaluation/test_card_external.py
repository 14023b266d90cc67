"""The card of a model made elsewhere names its pinned source, found through the lineage."""

from __future__ import annotations

import json
from pathlib import Path

PINNED = "hf://models/HuggingFaceTB/SmolLM3-3B-Base@" + "0" * 40


def _output(root: Path, step: str, inputs: list[Path], config: dict | None = None) -> Path:
    out = root / step
    out.mkdir(parents=True)
    record = {"step": step, "name": "x", "config": config or {},
              "inputs": [{"name": "model", "uri": str(p)} for p in inputs]}  # fmt: skip
    (out / "lineage.json").write_text(json.dumps(record))
    return out


def test_the_base_of_a_dpo_model_from_the_recipes_init_is_the_pinned_source(tmp_path):
    from llmflow.tasks.evaluation.card import external_source, hub_id, training_facts

    imported = _output(tmp_path, "import-model", [], {"model": PINNED})
    (imported / "final").mkdir()
    (imported / "final" / "source.json").write_text(json.dumps({"model": PINNED}))
    stage = _output(tmp_path, "pretrain", [imported])
    exported = _output(tmp_path, "export", [stage])
    dpo = _output(tmp_path, "dpo", [_output(tmp_path, "sft", [exported])])
    assert external_source(dpo) == PINNED
    assert training_facts(dpo)["base_model"] == PINNED
    assert hub_id(PINNED) == "HuggingFaceTB/SmolLM3-3B-Base"
    # a model llmflow trained from scratch has none: its base is its parent, by label
    scratch = _output(tmp_path / "scratch", "export", [])
    assert external_source(scratch) is None


def test_a_folder_source_is_named_with_its_fingerprint(tmp_path):
    from llmflow.tasks.evaluation.card import external_source

    imported = _output(tmp_path, "import-model", [], {"model": "/models/mine"})
    (imported / "final").mkdir()
    source = {"model": "/models/mine", "revision": "local-0123"}
    (imported / "final" / "source.json").write_text(json.dumps(source))
    assert external_source(_output(tmp_path, "export", [imported])) == "/models/mine@local-0123"
    external = _output(tmp_path / "e", "external-model", [], {"pinned": PINNED})
    assert external_source(_output(tmp_path / "e", "sft", [external])) == PINNED
