"""Typed step summaries: the card reads what the steps record through one model per record, so a
field renamed by the writer or the reader fails here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmflow.tasks.curation.report import stage_entry
from llmflow.tasks.evaluation.card_facts import curation_stages, training_stages
from llmflow.tasks.summaries import CurationReport, CurationStage, PretrainSummary


def test_a_writer_that_renames_a_field_fails_and_a_reader_sees_none_for_an_old_output():
    good = {"tokens_seen": 10, "tokens_per_s": 2.0, "world_size": 1, "steps": 3,
            "stage_steps": 3, "final_loss": 1.5, "val_loss": None, "extra": "kept"}  # fmt: skip
    assert PretrainSummary.written(good) is good  # recorded as given: bytes, address unchanged
    renamed = {("tokens" if k == "tokens_seen" else k): v for k, v in good.items()}
    with pytest.raises(ValueError, match=r"records no \['tokens_seen'\]"):
        PretrainSummary.written(renamed)
    with pytest.raises(ValueError):
        PretrainSummary.written({**good, "steps": "three"})
    old = PretrainSummary.read({"tokens_seen": 10})  # made before the other fields existed
    assert old.tokens_seen == 10 and old.val_loss is None and old.stage_steps is None
    assert PretrainSummary.read({"steps": "garbled"}).steps == "garbled"  # a card never fails


def test_the_curation_writer_records_every_field_the_card_reads(tmp_path):
    by_domain = {"web": {"in": {"docs": 5, "tokens": 50}, "out": {"docs": 3, "tokens": 30},
                         "drop:too_short": {"docs": 2, "tokens": 20}}}  # fmt: skip
    entry = stage_entry("filters", by_domain)
    assert set(CurationStage.model_fields) <= set(entry)
    curate = tmp_path / "curate"
    curate.mkdir()
    (curate / "curation_report.json").write_text(json.dumps({"stages": [entry]}))
    assert CurationReport.read({"stages": [entry]}).stages[0].documents_out == 3
    rows = curation_stages({"curate": [(str(curate), {})]})
    assert rows == [{"stage": "filters", "documents in": 5, "documents out": 3,
                     "removed (top reasons)": "too_short 2"}]  # fmt: skip


def test_the_trainers_summary_records_every_field_the_card_reads(tmp_path):
    """The real trainer's summary.json, then the card's training table from it."""
    code = (
        "import sys; sys.path.insert(0, 'tests/tasks/pretrain');"
        "from conftest import make_packed, run_trainer, tiny_config;"
        f"d = make_packed(__import__('pathlib').Path({str(tmp_path)!r}) / 'data', num_docs=40);"
        f"run_trainer(tiny_config(max_steps=2, checkpoint={{'interval': 2, 'keep_last': 1}}),"
        f" d, {str(tmp_path / 'out')!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, capture_output=True)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(PretrainSummary.model_fields) <= set(summary)
    record = {"name": "s1", "metrics": summary, "config": {"train": {"optimizer": {"lr": 0.1}}}}
    (row,) = training_stages({"pretrain": [("uri", record)]})
    assert row["tokens"] == summary["tokens_seen"] and row["steps"] == 2
    assert row["final loss"] == summary["final_loss"] and row["lr"] == 0.1
