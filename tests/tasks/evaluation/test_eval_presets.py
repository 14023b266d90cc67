from pathlib import Path

import pytest
import yaml

from llmflow.tasks.evaluation.config import EvalConfig

PRESETS = sorted((Path(__file__).resolve().parents[3] / "configs" / "eval").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_eval_presets_validate(path):
    EvalConfig(**yaml.safe_load(path.read_text()))


def test_presets_found():
    assert {p.name for p in PRESETS} >= {"bundled.yaml", "real_sets.yaml"}
