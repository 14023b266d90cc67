"""The pretrain step in-process: a tiny graph of two stages through the executor and the store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY_MODEL, make_packed, tiny_config
from pydantic import BaseModel

from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.framework.store import Store
from llmflow.tasks.pretrain.faults import ENV
from llmflow.tasks.pretrain.launch import TrainingFailed
from llmflow.tasks.pretrain.step import StageRun, pretrain


class PackedSpec(BaseModel):
    num_docs: int
    seed: int


@step("test-packed")
def packed(cfg: PackedSpec, out: Path) -> Metrics:
    """A packed dataset for the tests (the mixture step's output format)."""
    make_packed(out, num_docs=cfg.num_docs, seed=cfg.seed)
    return {}


def _stage(max_steps: int, log_interval: int = 1) -> StageRun:
    """A stage whose model takes its vocabulary from the data (no vocab_size override)."""
    overrides = {k: v for k, v in TINY_MODEL.items() if k != "vocab_size"}
    train = tiny_config(
        model={"preset": "debug", "overrides": overrides},
        max_steps=max_steps,
        checkpoint={"interval": 2, "keep_last": 1},
        log_interval=log_interval,
    )
    return StageRun(train=train)


def _curriculum(log_interval: int = 1) -> tuple[Graph, list]:
    graph = Graph()
    train = graph.add(packed, PackedSpec(num_docs=300, seed=0), "train")
    val = graph.add(packed, PackedSpec(num_docs=60, seed=1), "val")
    first = graph.add(pretrain, _stage(4, log_interval), "s1", data=train, validation=val)
    second = graph.add(
        pretrain, _stage(3, log_interval), "s2", data=train, validation=val, init=first
    )
    return graph, [first, second]


@pytest.fixture
def synced(monkeypatch) -> list[str]:
    """Labels of the outputs whose partial state was mirrored (one per checkpoint notice)."""
    calls: list[str] = []
    monkeypatch.setattr(
        Store, "sync_partial", lambda self, step, name, digest, work: calls.append(name)
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv(ENV, raising=False)
    return calls


def test_two_stages_audit_clean_count_tokens_and_mirror_each_checkpoint(tmp_path, synced):
    graph, (first, second) = _curriculum()
    executor = Executor(str(tmp_path), audit=True)
    outcome = executor.run(graph)

    assert executor.unhashed_reads(graph) == {}
    assert {"num_processes", "train.log_interval"} <= executor.reads["pretrain"]
    one, two = outcome[first], outcome[second]
    assert (one.metrics["steps"], two.metrics["steps"]) == (4, 7)
    assert two.metrics["tokens_seen"] == 3 * 4 * 32
    # Tokens over the curriculum: stage 2 adds its own to stage 1's, read from stage 1's files.
    assert two.metrics["total_tokens_seen"] == one.metrics["tokens_seen"] + 3 * 4 * 32
    summary = json.loads((Path(two.uri) / "summary.json").read_text())
    assert summary["total_tokens_seen"] == two.metrics["total_tokens_seen"]
    config = json.loads((Path(one.uri) / "final" / "model_config.json").read_text())
    assert config["vocab_size"] == 128  # from the packed data's meta.json
    # Stage 1 checkpoints at step 2 and final/, stage 2 at step 6 and final/: each announced once.
    assert synced == ["s1", "s1", "s2", "s2"]

    again = Executor(str(tmp_path)).run(_curriculum(log_interval=3)[0])
    assert all(r.cached for r in again.rows()), "log_interval is execution-only"


def test_a_crashed_stage_resumes_from_its_checkpoint_when_run_again(tmp_path, synced, monkeypatch):
    graph = Graph()
    data = graph.add(packed, PackedSpec(num_docs=300, seed=0), "train")
    stage = graph.add(pretrain, _stage(4), "s1", data=data)
    monkeypatch.setenv(ENV, json.dumps({"crash_after_step": 3}))
    with pytest.raises(TrainingFailed, match="exited with code 3"):
        Executor(str(tmp_path)).run(graph)
    assert synced == ["s1"]  # the step-2 checkpoint was mirrored before the crash

    monkeypatch.delenv(ENV)
    result = Executor(str(tmp_path)).run(graph)[stage]
    assert result.metrics["steps"] == 4 and result.metrics["stage_steps"] == 4
    rows = [json.loads(r) for r in (Path(result.uri) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # step 3 replayed once, not duplicated
    assert synced == ["s1", "s1"]  # only final/ is new: step 2's notice is not repeated
