"""SFT and DPO as store steps: model outputs in, hf/ out, raw data hashed, read audit clean."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fsspec
import pytest
from pydantic import BaseModel

from llmflow.tasks.evaluation.models import read_progress
from llmflow.tasks.framework.audit import unhashed_reads
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, RawFiles, step
from llmflow.tasks.framework.store import Store
from llmflow.tasks.posttrain.common import local_data
from llmflow.tasks.posttrain.config import DPOStepConfig, SFTStepConfig
from llmflow.tasks.posttrain.dpo import dpo
from llmflow.tasks.posttrain.formats import write_jsonl
from llmflow.tasks.posttrain.quickstart import quickstart_sft_examples
from llmflow.tasks.posttrain.sft import sft

FAST = dict(max_length=64, per_device_batch_size=4, max_steps=2, num_heldout=4, logging_steps=1)


class ModelFixture(BaseModel):
    source: str


@step("fixture-model")
def fixture_model(cfg: ModelFixture, out: Path) -> Metrics:
    """A model output: a copy of a Hugging Face folder in hf/."""
    shutil.copytree(cfg.source, out / "hf")
    return {}


def _audited(step_obj, store, cfg, inputs):
    reads: set[str] = set()
    result = step_obj.run(store, cfg, "quick", inputs, reads=reads)
    assert unhashed_reads(step_obj.config_type, reads, step_obj.execution) == []
    assert reads >= {"logging_steps", "dataloader_num_workers", "learning_rate"}
    return result


def test_sft_then_dpo_through_the_store(tmp_path, tiny_model_dir, assert_chats):
    store = Store(tmp_path / "runs")
    base = fixture_model.run(store, ModelFixture(source=str(tiny_model_dir)), "tiny").uri
    tuned = _audited(sft, store, SFTStepConfig(**FAST), {"model": base})
    assert tuned.metrics["num_steps"] == 2
    assert_chats(Path(tuned.uri) / "hf")
    aligned = _audited(dpo, store, DPOStepConfig(**FAST), {"model": tuned.uri})
    assert aligned.metrics["heldout_rewards_margins_before"] == 0.0  # reference == SFT model
    out = Path(aligned.uri)
    assert read_progress(out) == {"tokens_seen": None, "step": None}
    assert json.loads((out / "metrics.json").read_text()) == aligned.metrics
    assert_chats(out / "hf")
    assert sft.run(store, SFTStepConfig(**{**FAST, "logging_steps": 5}), "quick", {"model": base}).cached  # fmt: skip


def test_user_data_file_is_hashed_by_content(tmp_path, tiny_model_dir):
    store = Store(tmp_path / "runs")
    base = fixture_model.run(store, ModelFixture(source=str(tiny_model_dir)), "tiny").uri
    data = tmp_path / "chat.jsonl"
    write_jsonl(data, quickstart_sft_examples(16, seed=5))
    cfg = SFTStepConfig(**{**FAST, "max_steps": 1, "data": str(data)})
    first = sft.run(store, cfg, "mine", {"model": base, "data": RawFiles((str(data),))})
    assert first.metrics["num_examples"] == 16
    write_jsonl(data, quickstart_sft_examples(12, seed=6))  # same path, other content
    second = sft.run(store, cfg, "mine", {"model": base, "data": RawFiles((str(data),))})
    assert not second.cached and second.uri != first.uri
    assert second.metrics["num_examples"] == 12


def test_local_data_copies_a_remote_file_and_takes_one_file(tmp_path):
    fs = fsspec.filesystem("memory")
    fs.pipe("/llmflow-posttrain/chat.jsonl", b'{"messages": []}\n')
    try:
        local = local_data(RawFiles(("memory://llmflow-posttrain/chat.jsonl",)), tmp_path)
        assert local == tmp_path / "data" / "chat.jsonl"
        assert local.read_bytes() == b'{"messages": []}\n'
    finally:
        fs.rm("/llmflow-posttrain", recursive=True)
    assert local_data(RawFiles((str(tmp_path / "x.jsonl"),)), tmp_path) == tmp_path / "x.jsonl"
    assert local_data(None, tmp_path) is None
    with pytest.raises(BadInputError, match="one data file, got 2"):
        local_data(RawFiles(("a", "b")), tmp_path)
