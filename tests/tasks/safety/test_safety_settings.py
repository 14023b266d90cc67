"""The safety step loads the model as ``evaluate`` does (its dtype and device)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmflow.flows.recipe import safety_config
from llmflow.tasks.config import load_config
from llmflow.tasks.framework.hashing import digest, versioned_fields
from llmflow.tasks.framework.step import RawFiles
from llmflow.tasks.safety.config import SafetyEvalConfig
from llmflow.tasks.safety.data import safety_files
from llmflow.tasks.safety.step import RESULTS, safety
from tests.needs import shared_path
from tests.tasks.evaluation.eval_fixtures import make_tiny_model


def config_hash(cfg: SafetyEvalConfig) -> str:
    return digest(versioned_fields(cfg))


def test_the_recipe_gives_the_safety_step_evaluates_dtype_and_device(tmp_path):
    cfg = load_config(None, [f"root={tmp_path}", "evaluate.dtype=bfloat16", "evaluate.device=cpu"])
    run_as = safety_config(cfg)
    assert (run_as.dtype, run_as.device) == ("bfloat16", "cpu")
    plain = load_config(None, [f"root={tmp_path}"])
    default = safety_config(plain)
    assert config_hash(default) == config_hash(plain.safety.eval)  # float32 keeps its address
    assert config_hash(run_as) != config_hash(default)  # another dtype, other numbers
    assert config_hash(run_as.model_copy(update={"device": None})) == config_hash(run_as)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_safety_step_scores_the_model_in_the_configured_dtype(tmp_path, dtype):
    safety_dir = shared_path("safety")
    make_tiny_model(tmp_path / "model" / "hf")
    cfg = SafetyEvalConfig(crows_limit=4, toxicity=False, dtype=dtype, device="cpu")
    out = tmp_path / "out"
    out.mkdir()
    data = RawFiles(safety_files(safety_dir))
    safety(cfg, model=tmp_path / "model", classifier=Path("unused"), data=data, out=out)
    assert json.loads((out / RESULTS).read_text())["dtype"] == dtype
