"""Config: presets, dotted overrides, errors that name the field before any compute."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmflow.tasks.config import load_config
from llmflow.tasks.framework.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_preset_loads_and_overrides_apply():
    cfg = load_config(None, ["ingest.max_chars=5000", "sample.seed=7", "name=mine"])
    assert cfg.ingest.max_chars == 5000 and cfg.sample.seed == 7 and cfg.name == "mine"
    cfg = load_config(None, ["pretrain.stages.2.mixture.num_tokens=4096"])
    assert cfg.pretrain.stages[2].mixture.num_tokens == 4096
    with pytest.raises(ConfigError, match="not an index"):
        load_config(None, ["pretrain.stages.7.mixture.num_tokens=4096"])


@pytest.mark.parametrize(
    "override, field",
    [
        ("ingest.max_chars=-5", "ingest.max_chars"),
        ("ingest.maxchars=5", "ingest.maxchars"),
        ("sample.num_shards=many", "sample.num_shards"),
        ("until=nowhere", "until"),
        ("pretrain.stages.0.mixture.weights.prose=-1", "pretrain.stages.0.mixture.weights"),
        ("extend.stages.1.seq_len=128", "extend"),
    ],
)
def test_bad_value_names_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert field in str(err.value)


def test_cli_bad_value_fails_fast_naming_field_and_value():
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "llmflow.flows.cli", "run", "--set", "ingest.max_chars=-5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.perf_counter() - started
    assert out.returncode == 2
    assert "ingest.max_chars" in out.stderr and "-5" in out.stderr
    assert elapsed < 5, elapsed
