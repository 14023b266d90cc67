"""``pretrain.stages: []`` (post-train an imported model directly): ``llmflow plan`` and
``preflight`` say there is no pretraining stage and report what still applies.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmflow.flows.cli import main
from llmflow.tasks.ingest.hub import MIRROR_ENV
from llmflow.tasks.preflight import PreflightOptions, preflight
from tests.flows.tiny_llama import save_tiny_llama

REPO = "test/tiny-llama"
CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "continue-pretrain.yaml")
NO_STAGES = [f"init=hf://models/{REPO}", "pretrain.stages=[]"]


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    folder = tmp_path / "mirror"
    save_tiny_llama(folder / REPO)
    monkeypatch.setenv(MIRROR_ENV, str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


def _transformers_parameters(folder: Path) -> int:
    from transformers import LlamaForCausalLM

    return sum(p.numel() for p in LlamaForCausalLM.from_pretrained(folder).parameters())


def test_plan_without_stages_says_so_and_counts_the_init_model(mirror, tmp_path, capsys):
    sets = [a for o in [f"root={tmp_path}", *NO_STAGES] for a in ("--set", o)]
    assert main(["plan", CONFIG, *sets]) == 0
    out = capsys.readouterr().out
    assert "no pretraining stage (pretrain.stages is empty)" in out
    count = _transformers_parameters(mirror / REPO)
    assert f"{count:,} parameters" in out, out
    assert "steps" not in out and "fits" not in out  # nothing to train: no steps, no memory plan


def test_plan_without_stages_still_plans_the_context_extension(mirror, tmp_path, capsys):
    extension = "extend.stages=[{seq_len: 512, rope_theta: 40000, num_tokens: 4000, lr: 0.001}]"
    sets = [a for o in [f"root={tmp_path}", *NO_STAGES, extension] for a in ("--set", o)]
    assert main(["plan", CONFIG, *sets]) == 0
    out = capsys.readouterr().out
    assert "no pretraining stage" in out and "extension ctx512" in out and "fits" in out


def test_preflight_without_stages_skips_the_training_rehearsal_with_a_line(mirror, tmp_path):
    options = PreflightOptions(processes=1, steps=2)
    report = preflight(CONFIG, [f"root={tmp_path}", *NO_STAGES], options)
    rows = {c.check: c for c in report.checks}
    assert report.go, report.table()
    assert "no pretraining stage" in rows["plan"].detail
    assert rows["training rehearsal"].detail.startswith("skipped: pretrain.stages is empty")
    assert not any(name.startswith(("train ", "meta build", "memory vs plan")) for name in rows)
    assert f"init hf://models/{REPO}@" in rows["config"].detail
