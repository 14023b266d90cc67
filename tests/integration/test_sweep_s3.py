"""A sweep whose root is on S3 (moto's server on 127.0.0.1) and whose study lives in a database
URL: trials commit to the bucket, and the best config, trials and plots are published there."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from .servers import REPO

pytestmark = pytest.mark.integration

_spec = importlib.util.spec_from_file_location("sweep_helpers", REPO / "tests/flows/test_sweep.py")
sweep_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep_helpers)


def test_sweep_on_an_s3_root_publishes_to_the_bucket(
    prefect_harness, tmp_path, s3_env, monkeypatch
):
    from llmflow.flows.sweep import run_sweep, sweep_folder

    monkeypatch.setenv("LLMFLOW_CACHE", str(tmp_path / "cache"))
    root = f"s3://{s3_env.bucket}/sweep-root"
    data, val = sweep_helpers.packed_inputs(root)  # the trials' inputs are in the bucket too
    cfg = sweep_helpers.tiny_config(tmp_path).model_copy(update={"root": root})
    space = sweep_helpers.space(study="s3", storage=f"sqlite:///{tmp_path / 'study.db'}")
    result = run_sweep(cfg, space, data, val)

    assert result.folder == f"{root}/sweeps/s3"
    best = yaml.safe_load(s3_env.read("sweep-root/sweeps/s3/best.yaml"))
    lr = best["pretrain"]["train"]["optimizer"]["lr"]
    assert lr == result.best_params["pretrain.train.optimizer.lr"]
    trials = json.loads(s3_env.read("sweep-root/sweeps/s3/trials.json"))
    assert trials == json.loads(json.dumps(result.rows))
    assert len(s3_env.read("sweep-root/sweeps/s3/history.png")) > 1000
    assert s3_env.keys("sweep-root/pretrain/")  # the trials' segments are in the bucket
    assert str(sweep_folder(cfg, space)).startswith(str(tmp_path / "cache"))
