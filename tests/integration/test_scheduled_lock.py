"""Two scheduled evaluations started at once, as two machines would (each its own local cache,
one S3 store, one Prefect server): every model output is evaluated exactly once."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from .servers import REPO, S3

pytestmark = pytest.mark.integration

_spec = importlib.util.spec_from_file_location(
    "eval_fixtures", REPO / "tests" / "tasks" / "evaluation" / "eval_fixtures.py"
)
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)

RUN = (
    "import json, sys\n"
    "from llmflow.flows.evaluate_scheduled import ScheduledEvaluationConfig, scheduled_evaluation\n"
    "rows = scheduled_evaluation(ScheduledEvaluationConfig.model_validate_json(sys.argv[1]))\n"
    "print('ROWS ' + json.dumps(rows))\n"
)


def _two_models(root: str) -> list[str]:
    """Two exported tiny models in the store at ``root``."""
    from llmflow.tasks.evaluation.export import ExportConfig, export
    from llmflow.tasks.framework.store import Store

    store = Store(root)
    tokenizer = fx.fixture_tokenizer.run(store, fx.TokenizerFixture(), "tiny").uri
    models = []
    for seed, label in enumerate("ab"):
        checkpoint = fx.fixture_checkpoint.run(store, fx.CheckpointFixture(seed=seed), label).uri
        inputs = {"checkpoint": checkpoint, "tokenizer": tokenizer}
        models.append(export.run(store, ExportConfig(label=label), label, inputs).uri)
    return models


def _start(config_json: str, env: dict[str, str], cache: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RUN, config_json],
        cwd=REPO,
        env={**env, "LLMFLOW_CACHE": str(cache)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _rows(proc: subprocess.Popen) -> list[dict]:
    out, _ = proc.communicate(timeout=540)
    assert proc.returncode == 0, out[-4000:]
    (line,) = [x for x in out.splitlines() if x.startswith("ROWS ")]
    return json.loads(line.removeprefix("ROWS "))


def test_overlapping_runs_evaluate_each_model_once(prefect_server, s3_env: S3, tmp_path):
    from prefect.client.orchestration import get_client

    from llmflow.flows.evaluate_scheduled import (
        ScheduledEvaluationConfig,
        lock_name,
    )
    from llmflow.tasks.evaluation.config import EvalConfig
    from llmflow.tasks.framework.store import Store

    root = f"s3://{s3_env.bucket}/scheduled-{uuid.uuid4().hex[:8]}"
    models = _two_models(root)
    cfg = ScheduledEvaluationConfig(
        root=root, evaluate=EvalConfig(tasks=["cf_arith"], num_items=4, limit=4)
    ).model_dump_json()
    env = {**os.environ, **s3_env.env, "PREFECT_API_URL": prefect_server.url}
    runs = [_start(cfg, env, tmp_path / f"machine-{i}") for i in range(2)]
    rows = [row for proc in runs for row in _rows(proc)]

    evaluated = sorted(r["checkpoint"] for r in rows if r["status"] == "ok" and not r["cached"])
    assert evaluated == sorted(models)  # each once, by one of the two runs
    assert sorted(r["checkpoint"] for r in rows if r["cached"]) == sorted(models)
    assert len(Store(root).list_outputs("evaluate")) == 2
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(lock_name(Store(root).root))
    assert limit.limit == 1 and limit.active_slots == 0  # released after both runs
