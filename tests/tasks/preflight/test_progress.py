"""Preflight says what it is doing while it runs: each check as it starts and ends, and each
rehearsal step (``<run> run: step i/n loss x, seconds``) as the trainer reports it, through the
``llmflow.preflight`` logger that the CLI's console shows."""

from __future__ import annotations

import logging
import re

import pytest

from llmflow.tasks.config import CONFIGS
from llmflow.tasks.preflight import PreflightOptions, preflight
from llmflow.tasks.preflight.rehearsal import RehearsalLauncher

# 135M's layout at a width and vocabulary that train in seconds on 2 CPU cores
TINY = (
    "pretrain.train.model.overrides={vocab_size: 512, hidden_size: 32, num_layers: 2, "
    "num_heads: 2, num_kv_heads: 1, intermediate_size: 64}"
)


def _step_lines(text: str, run: str) -> list[tuple[int, int]]:
    found = re.findall(
        rf"preflight: {run} run: step (\d+)/(\d+) loss \S+, \d+\.\d s \(\d+\.\d s since start\)",
        text,
    )
    return [(int(i), int(n)) for i, n in found]


def test_each_trainer_step_line_becomes_a_progress_line(caplog):
    lines = []
    launch = RehearsalLauncher(2, 60, lines.append)
    with caplog.at_level(logging.INFO, logger="llmflow.preflight"):
        launch.start("straight", 4)
        for text in ("loading the model", "step 1 loss 10.8312 tok/s 12", "step 2 loss 10.8007"):
            launch._line(text)
    assert len(lines) == 3  # every raw line still reaches the caller's log
    assert "preflight: straight run: starting the trainer on 2 ranks, 4 steps" in caplog.text
    assert _step_lines(caplog.text, "straight") == [(1, 4), (2, 4)]
    assert "loss 10.8312," in caplog.text


def test_a_check_logs_its_start_and_its_verdict(caplog):
    options = PreflightOptions(train=False, check_data=False)
    with caplog.at_level(logging.INFO, logger="llmflow.preflight"):
        report = preflight(str(CONFIGS / "smollm3-135m.yaml"), [], options)
    for check in report.checks:
        assert f"preflight: {check.check} ..." in caplog.text
        assert re.search(rf"preflight: {re.escape(check.check)}: go \(\d+\.\d s\)", caplog.text)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_preflight_logs_a_progress_line_per_rehearsal_step(tmp_path, caplog):
    """The smallest rehearsal (one rank, 2 steps, a tiny width): every step of the straight run,
    the resumed one and the runtime baseline has its line, as it happens."""
    options = PreflightOptions(processes=1, seq_len=32, micro_batch_size=1, steps=2,
                               check_data=False, layouts="none", timeout_s=600)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="llmflow.preflight"):
        report = preflight(str(CONFIGS / "smollm3-135m.yaml"), [TINY], options, tmp_path)
    rows = {c.check: c for c in report.checks}
    assert rows["train 2 steps"].go and rows["checkpoint, resume"].go, report.table()
    assert _step_lines(caplog.text, "straight") == [(1, 2), (2, 2)]
    assert _step_lines(caplog.text, "resumed") == [(2, 2)]  # from step 1's checkpoint
    assert _step_lines(caplog.text, "tiny") == [(1, 2), (2, 2)]
    assert caplog.text.index("step 1/2") < caplog.text.index("preflight: train 2 steps: go")


def test_a_peak_no_higher_than_the_runtimes_is_reported_not_divided_by(monkeypatch, tmp_path):
    """A model too small to rise above the runtime's own RSS: the memory row says it cannot be
    measured here (it raised ZeroDivisionError, failing the whole rehearsal)."""
    from llmflow.tasks.config import load_config
    from llmflow.tasks.preflight import rehearsal
    from llmflow.tasks.preflight.report import Report

    monkeypatch.setattr(rehearsal, "peak_memory_gb", lambda folder: 0.35)
    monkeypatch.setattr(rehearsal, "runtime_baseline_gb", lambda *a: 0.35)
    report = Report("smollm3-135m")
    config = load_config(str(CONFIGS / "smollm3-135m.yaml"), [])
    rehearsal.memory_vs_plan(report, config, None, tmp_path, None, seq_len=32, micro=1, ranks=1)
    row = {c.check: c for c in report.checks}["memory vs plan"]
    assert row.go and "not measurable here" in row.detail, row
    assert report.numbers["memory"]["error"] is None
