"""The shipped eval presets: valid configs whose every task name the suite builds and lm-eval
resolves (a misspelled task would otherwise fail only when a checkpoint is evaluated)."""

import json
from pathlib import Path

import pytest
import yaml
from lm_eval.tasks import TaskManager

from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.suite import build_suite

PRESETS = sorted((Path(__file__).resolve().parents[3] / "configs" / "eval").glob("*.yaml"))


def _real_set_files(root: Path) -> Path:
    """One record of each real set, in the file formats build_suite reads."""
    root.mkdir()
    piqa = {"goal": "Open a jar", "sol1": "Twist the lid.", "sol2": "Eat the lid."}
    (root / "piqa_valid.jsonl").write_text(json.dumps(piqa) + "\n")
    (root / "piqa_valid_labels.lst").write_text("0\n")
    (root / "wikitext2_test.txt").write_text(" = Title = \n\n Some text . \n")
    gsm8k = {"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}
    (root / "gsm8k_test.jsonl").write_text(json.dumps(gsm8k) + "\n")
    return root


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_eval_presets_validate(path, tmp_path, heldout_dir):
    raw = yaml.safe_load(path.read_text())
    if "tasks" in raw and raw.get("data_root") is None and "real" in path.name:
        raw["data_root"] = str(_real_set_files(tmp_path / "eval"))  # the user gives it
    cfg = EvalConfig(**raw)
    assert cfg.model_dump(include=set(raw)) == raw  # every key kept as written, none coerced
    suite = build_suite(cfg, heldout_dir, tmp_path / "suite")
    known = set(TaskManager(include_path=str(suite), include_defaults=False).all_tasks)
    assert set(cfg.tasks) <= known, f"{path.name}: unknown tasks {set(cfg.tasks) - known}"


def test_presets_found():
    assert {p.name for p in PRESETS} >= {"bundled.yaml", "real_sets.yaml"}
