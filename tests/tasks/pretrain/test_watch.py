"""``llmflow watch``: the stages under a store root, read from a real (interrupted) training run."""

from __future__ import annotations

import fcntl
import io
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import make_packed, read_jsonl, run_trainer, tiny_config

from llmflow.flows.cli import main
from llmflow.tasks.framework.store import COMMIT_MARKER, PARTIAL_DIR
from llmflow.tasks.pretrain.alerts import record_alert
from llmflow.tasks.pretrain.watch import find_stages, watch


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A store root as ``llmflow run`` leaves it while stages train and after they commit.

    One real run of 8 steps (a checkpoint every 3) is killed after step 6, as a lost machine
    would be: its folder is a stage in progress (``.partial``). Copies of it stand for a stage
    that stopped, one committed now and one committed two hours ago.
    """
    base = tmp_path_factory.mktemp("watch")
    data = make_packed(base / "train", num_docs=300, seed=0)
    val = make_packed(base / "val", num_docs=60, seed=1)
    root = base / "root"
    running = root / "pretrain" / PARTIAL_DIR / "s1-aaaaaa111111"
    cfg = tiny_config(max_steps=8, eval_interval=3, checkpoint={"interval": 3, "keep_last": 1})
    proc = run_trainer(cfg, data, running, val_dir=val, check=False, faults={"crash_after_step": 6})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    record_alert(running, "throughput", 5, "s1", "tokens/s fell 60% below", cause="data wait")
    shutil.copytree(running, root / "pretrain" / PARTIAL_DIR / "s2-bbbbbb222222")
    for name in ("s0-cccccc333333", "old-dddddd444444"):
        shutil.copytree(running, root / "pretrain" / name)
        (root / "pretrain" / name / COMMIT_MARKER).write_text("now")
    two_hours_ago = time.time() - 7200
    os.utime(root / "pretrain" / "old-dddddd444444" / "metrics.jsonl", (two_hours_ago,) * 2)
    return root


@pytest.fixture
def held(root):
    """The running stage's workdir lock, held as the store holds it while the step runs."""
    lock = root / "pretrain" / PARTIAL_DIR / "s1-aaaaaa111111.lock"
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
        fcntl.flock(f, fcntl.LOCK_UN)


def test_watch_once_shows_each_stage_its_numbers_and_its_alert(root, held, capsys):
    rows = read_jsonl(root / "pretrain" / PARTIAL_DIR / "s1-aaaaaa111111" / "metrics.jsonl")
    last, val = rows[-1], [r for r in rows if "val_loss" in r][-1]

    assert main(["watch", str(root), "--once"]) == 0
    lines = capsys.readouterr().out.splitlines()

    assert lines[0].startswith(f"llmflow watch {root}")
    stage = {line.split()[0]: line for line in lines[2:] if not line.startswith(" ")}
    # running first, then the stopped copy, then the committed one; two hours old: not shown
    assert list(stage) == ["s1", "s2", "s0"]
    s1 = stage["s1"].split()
    assert s1[:3] == ["s1", "aaaaaa", "running"]
    # step 6 of 8: the end step is read from the step-6 checkpoint's trainer state
    assert s1[3] == "6/8" and last["step"] == 6
    assert s1[4] == f"{last['loss']:.4f}" and s1[5] == f"{val['val_loss']:.4f}"
    assert s1[6] == f"{last['tokens_per_s']:,.0f}"
    assert stage["s2"].split()[2] == "stopped" and stage["s0"].split()[2] == "done"
    alert = lines[lines.index(stage["s1"]) + 1]
    assert alert == "    alert [throughput] step 5: tokens/s fell 60% below (cause: data wait)"


def test_find_stages_recent_window_and_status_without_the_lock(root):
    found = {s.label: s for s in find_stages(root, recent_s=3 * 3600)}
    assert found["s1"].status == "stopped"  # nobody holds its lock: the run died
    assert found["old"].status == "done" and found["s0"].status == "done"
    assert "old" not in {s.label for s in find_stages(root, recent_s=3600)}


def test_watch_live_redraws_until_ctrl_c(root, held, monkeypatch):
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", sleep)
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws a live view on a terminal only
    monkeypatch.setenv("COLUMNS", "160")
    out = io.StringIO()
    assert watch(str(root), interval=0.5, out=out) == 0
    assert naps == [0.5, 0.5]
    text = out.getvalue()
    assert "every 0.5 s" in text  # the rest of the title may be cut to the console width
    # the first frame, one redraw in place (cursor up over the frame) and the last on exit
    assert text.count("running") == 3 and "\x1b[1A" in text


def test_watch_says_so_when_nothing_trains_and_rejects_a_remote_root(tmp_path, capsys):
    assert main(["watch", str(tmp_path), "--once"]) == 0
    assert "no running or recent training stage" in capsys.readouterr().out
    assert main(["watch", "s3://bucket/runs", "--once"]) == 2
    assert "watch reads a local store root" in capsys.readouterr().err
