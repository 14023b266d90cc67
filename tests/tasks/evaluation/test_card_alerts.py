"""The card lists each training stage's alerts (kind, step, message), or "no alerts"."""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import ModelCard

from llmflow.tasks.evaluation.card import CardConfig, model_card
from llmflow.tasks.pretrain.alerts import record_alert
from llmflow.tasks.pretrain.callbacks import append_jsonl


def _output(root: Path, name: str, step: str, inputs=(), **fields) -> Path:
    out = root / f"{step}-{name}"
    out.mkdir(parents=True)
    inputs = [{"name": key, "uri": str(uri)} for key, uri in inputs]
    record = {"step": step, "name": name, "hash": f"h-{name}", "inputs": inputs, **fields}
    (out / "lineage.json").write_text(json.dumps(record))
    return out


def _card(tmp_path: Path, *stage_alerts: list[tuple[str, int, str]]) -> str:
    """A model exported from one stage per list of (kind, step, message) alerts; its card."""
    root, upstream = tmp_path / "runs", []
    for number, alerts in enumerate(stage_alerts, 1):
        name = f"q-stage{number}"
        started = f"2026-01-01T0{number}:00:00"
        stage = _output(root, name, "pretrain", upstream, started_at=started)
        append_jsonl(stage / "events.jsonl", {"event": "skip", "step": 1})  # a guard row
        for kind, step, message in alerts:
            record_alert(stage, kind, step, name, message, cause="data wait")
        upstream = [("init", stage)]
    export = _output(root, "q", "export", upstream, metrics={"num_parameters": 1000})
    (export / "hf").mkdir()
    (export / "hf" / "config.json").write_text('{"model_type": "llama"}')
    evaluation = tmp_path / "evaluation"
    evaluation.mkdir()
    (evaluation / "results.json").write_text(json.dumps({"metrics": {}}))
    out = tmp_path / "card"
    out.mkdir()
    model_card(CardConfig(model_name="q"), model=export, evaluation=evaluation, out=out)
    return ModelCard.load(out / "hf" / "README.md").text


def test_the_card_lists_each_stages_alerts(tmp_path):
    text = _card(
        tmp_path,
        [("throughput", 40, "tokens/s fell to 0.31x the median"), ("stall", 41, "waited 12 s")],
        [],
    )
    section = text.split("### Alerts during training\n\n", 1)[1].split("###", 1)[0]
    assert "- `q-stage1`: 2 alert(s)\n- `q-stage2`: no alerts" in section
    assert "| stage | kind | step | message |" in section
    assert "| q-stage1 | throughput | 40 | tokens/s fell to 0.31x the median |" in section
    assert "| q-stage1 | stall | 41 | waited 12 s |" in section
    assert "skip" not in section  # a guard row that is no alert


def test_a_clean_run_says_no_alerts(tmp_path):
    text = _card(tmp_path, [])
    assert "### Alerts during training\n\n- `q-stage1`: no alerts\n" in text
