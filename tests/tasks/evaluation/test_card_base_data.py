"""A model whose base was pretrained elsewhere: its contamination shares cover only the data
llmflow trained on, so the card and the leaderboard say the base's own pretraining data is
unknown instead of "0% seen in training"."""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import ModelCard

from llmflow.tasks.evaluation.card import CardConfig, model_card
from llmflow.tasks.evaluation.leaderboard import model_cards

PINNED = "hf://models/HuggingFaceTB/SmolLM2-135M@" + "0" * 40
SHARE = "0.0% (0/120 items)"
REMOVED = "0% (removed before training: 2.5% (3/120 items) matched)"
UNKNOWN = "the base's own pretraining data: unknown"


def _output(root: Path, step: str, inputs: list[tuple[str, Path]], **fields) -> Path:
    out = root / step
    out.mkdir(parents=True)
    record = {"step": step, "name": "x", "config": fields.pop("config", {}),
              "inputs": [{"name": k, "uri": str(p)} for k, p in inputs], **fields}  # fmt: skip
    (out / "lineage.json").write_text(json.dumps(record))
    return out


def _model(out: Path) -> Path:
    (out / "hf").mkdir()
    (out / "hf" / "config.json").write_text('{"model_type": "llama"}')
    return out


def _evaluation(root: Path) -> Path:
    results = {
        "metrics": {"gsm8k_local": {"exact_match": 0.25}, "cf_arith": {"acc": 0.5}},
        "contamination": {"gsm8k_local": {"share": 0.0, "label": SHARE},
                          "cf_arith": {"share": 0.0, "label": REMOVED}},
    }  # fmt: skip
    (root / "evaluation").mkdir(parents=True)
    (root / "evaluation" / "results.json").write_text(json.dumps(results))
    return root / "evaluation"


def _continued(root: Path) -> Path:
    """import-model (a Hub init) -> pretrain on a decontaminated corpus -> export."""
    imported = _output(root, "import-model", [], config={"model": PINNED})
    (imported / "final").mkdir()
    (imported / "final" / "source.json").write_text(json.dumps({"model": PINNED}))
    decont = _output(root, "decontaminate", [], metrics={"documents_removed": 3,
                                                          "documents_contaminated": 3})  # fmt: skip
    stage = _output(root, "pretrain", [("init", imported), ("data", decont)],
                    metrics={"tokens_seen": 24000})  # fmt: skip
    return _model(_output(root, "export", [("checkpoint", stage)]))


def _card_text(root: Path, model: Path) -> str:
    out = root / "card"
    out.mkdir()
    model_card(CardConfig(model_name="m"), model=model, evaluation=_evaluation(root), out=out)
    return ModelCard.load(out / "hf" / "README.md").text


def _rows(text: str) -> dict[str, str]:
    """The evaluation table's rows by task: the whole markdown line."""
    table = text.split("## Evaluation", 1)[1].split("##", 1)[0]
    return {line.split("|")[1].strip(): line for line in table.splitlines() if line[:2] == "| "}


def test_the_card_of_a_continued_pretrained_import_says_the_bases_data_is_unknown(tmp_path):
    text = _card_text(tmp_path, _continued(tmp_path))
    rows = _rows(text)
    assert f"llmflow's data: {SHARE}; {UNKNOWN}" in rows["gsm8k_local"]
    assert f"llmflow's data: {REMOVED}; {UNKNOWN}" in rows["cf_arith"]
    assert f"`{PINNED}` was pretrained elsewhere" in text.split("## Evaluation", 1)[1]
    decont = text.split("### Decontamination", 1)[1].split("###", 1)[0]
    assert "3 training documents matched an evaluation set; 3 removed." in decont
    assert "the base model's own pretraining data is unknown" in decont
    limits = "trained on its base's own pretraining (data unknown) and 24,000 tokens of continued"
    assert limits in text


def test_the_card_of_an_external_model_evaluated_as_it_is_says_so_too(tmp_path):
    external = _model(_output(tmp_path, "external-model", [], config={"pinned": PINNED}))
    sft = _model(_output(tmp_path, "sft", [("model", external)]))
    rows = _rows(_card_text(tmp_path, sft))
    assert f"llmflow's data: {SHARE}; {UNKNOWN}" in rows["gsm8k_local"]


def test_a_model_trained_from_scratch_keeps_its_plain_share(tmp_path):
    decont = _output(tmp_path, "decontaminate", [])
    stage = _output(tmp_path, "pretrain", [("data", decont)])
    model = _model(_output(tmp_path, "export", [("checkpoint", stage)]))
    text = _card_text(tmp_path, model)
    assert f"| {SHARE} |" in _rows(text)["gsm8k_local"]
    assert "unknown" not in text.split("## Evaluation", 1)[1].split("## Bias", 1)[0]


def test_the_leaderboard_says_the_bases_data_is_unknown(tmp_path):
    imported = _continued(tmp_path / "imported")
    scratch = _model(_output(tmp_path / "scratch", "export", []))
    marks = {"gsm8k_local": {"label": SHARE}}
    records = [{"contamination": marks}, {"contamination": marks}]
    rows = model_cards(["imported", "scratch"], records, None, tmp_path, [imported, scratch])
    assert rows[0]["gsm8k_local contamination"] == f"llmflow's data: {SHARE}; {UNKNOWN}"
    assert rows[0]["base"] == PINNED
    assert rows[1]["gsm8k_local contamination"] == SHARE
    assert rows[1]["base"] == "none (trained from scratch)"
