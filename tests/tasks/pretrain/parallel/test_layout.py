"""The trainer's parallel layout: refused before anything starts, and checkpoints that move
between layouts (tp=2 -> dp_shard=2 and -> one process) continuing the uninterrupted run."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from llmflow.tasks.framework.errors import ConfigError

HELPERS = Path(__file__).resolve().parents[1] / "conftest.py"


def _helpers():
    spec = importlib.util.spec_from_file_location("pretrain_test_helpers", HELPERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("world_size", "parallel", "model", "named"),
    [
        (2, {"tp": 3}, {}, "pretrain.train.parallel"),  # 3 does not divide 2 processes
        (4, {"tp": 4}, {}, "num_kv_heads=2"),  # 4 ranks, but 2 KV heads
        (2, {"tp": 2}, {"intermediate_size": 66 + 1}, "intermediate_size=67"),
        (2, {"tp": 2}, {"qk_norm": True}, "qk_norm"),
    ],
)
def test_layout_refused_before_anything_starts(
    tmp_path, monkeypatch, world_size, parallel, model, named
):
    """Through ``train.run`` as torchrun starts it (WORLD_SIZE set): the error names the field,
    in well under a second, before the process group (which would wait for the other ranks)."""
    from llmflow.tasks.pretrain.train import run

    helpers = _helpers()
    data = helpers.make_packed(tmp_path / "data", num_docs=20)
    cfg = helpers.tiny_config(
        model={"preset": "debug", "overrides": {**helpers.TINY_MODEL, **model}}, parallel=parallel
    )
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="pretrain.train.parallel") as err:
        run(cfg, data, tmp_path / "out")
    assert time.perf_counter() - started < 1.0
    assert named in str(err.value)
    assert not dist.is_initialized()
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
