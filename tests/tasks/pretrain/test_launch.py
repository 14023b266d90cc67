"""The launcher: commands, streaming, checkpoint notices, deadlines, failures, launch_training()."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_MODEL, VOCAB, losses_by_step, run_trainer, tiny_config

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.pretrain.launch import (
    NoticeWatcher,
    TrainingFailed,
    launch_training,
    run_streaming,
)
from llmflow.tasks.pretrain.launchers import local_launcher
from llmflow.tasks.pretrain.state import RECENT_LOSSES

ARGS = ["--config", "c.json", "--data-dir", "d", "--out-dir", "o"]


def test_local_launcher_commands():
    py = sys.executable
    assert local_launcher(1).command(ARGS) == [py, "-m", "llmflow.tasks.pretrain.train", *ARGS]
    assert local_launcher(2).command(ARGS) == [
        py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "llmflow.tasks.pretrain.train", *ARGS,
    ]  # fmt: skip
    cfg = Path("deployments/accelerate/multi_gpu_fsdp2.yaml")
    assert local_launcher(4, cfg).command(ARGS) == [
        py, "-m", "accelerate.commands.launch", "--config_file", str(cfg),
        "--num_processes", "4", "-m", "llmflow.tasks.pretrain.train", *ARGS,
    ]  # fmt: skip


def test_accelerate_configs_parse():
    import yaml

    folder = Path(__file__).resolve().parents[3] / "deployments" / "accelerate"
    names = {"cpu.yaml", "single_gpu.yaml", "multi_gpu_fsdp2.yaml", "multi_node_fsdp2.yaml"}
    for name in names:
        cfg = yaml.safe_load((folder / name).read_text())
        assert cfg["distributed_type"] in ("NO", "MULTI_GPU"), name
        assert cfg["mixed_precision"] == "no", name


def test_streams_every_line_and_returns_the_tail():
    lines: list[str] = []
    code = "import sys\nfor i in range(5): print('line', i)\nprint('err', file=sys.stderr)"
    tail = run_streaming([sys.executable, "-c", code], on_line=lines.append, tail_lines=3)
    assert lines == [f"line {i}" for i in range(5)] + ["err"]
    assert tail == ["line 3", "line 4", "err"]


def test_non_zero_exit_raises_with_the_last_lines():
    code = "print('about to fail'); raise SystemExit(7)"
    with pytest.raises(TrainingFailed, match="(?s)exited with code 7.*about to fail") as info:
        run_streaming([sys.executable, "-c", code], on_line=lambda _: None)
    assert info.value.returncode == 7


def test_deadline_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\ntime.sleep(60)\n"
    )
    start = time.monotonic()
    with pytest.raises(TrainingFailed, match="(?s)deadline of 3s.*started"):
        run_streaming([sys.executable, "-c", code], on_line=lambda _: None, timeout_s=3)
    assert time.monotonic() - start < 30
    child = int(pid_file.read_text())
    time.sleep(0.5)
    assert not _alive(child), "the grandchild must die with the process group"


def _alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie awaiting its reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_notices_reach_the_callback_while_the_process_runs(tmp_path):
    """A notice appended to the watched file reaches on_notice before the process ends."""
    notices = tmp_path / "checkpoints.jsonl"
    notices.write_text('{"step": 0}\n')  # from an earlier attempt: not announced again
    code = (
        "import json, sys, time\n"
        f"path = {str(notices)!r}\n"
        "for step in (1, 2):\n"
        "    with open(path, 'a') as f:\n"
        "        f.write(json.dumps({'step': step}) + '\\n')\n"
        "    time.sleep(1.5)\n"
        "with open(path, 'a') as f:\n"
        "    f.write('{\"step\": 3')\n"  # a torn line is never parsed
    )
    seen: list[tuple[int, float]] = []
    start = time.monotonic()
    run_streaming(
        [sys.executable, "-c", code],
        on_line=lambda _: None,
        watch=notices,
        on_notice=lambda n: seen.append((n["step"], time.monotonic() - start)),
    )
    assert [step for step, _ in seen] == [1, 2]
    assert seen[0][1] < 2.5, "the first notice must arrive while the process still runs"


def test_watcher_reads_only_complete_new_lines(tmp_path):
    path = tmp_path / "n.jsonl"
    watcher = NoticeWatcher(path)
    assert watcher.poll() == []
    path.write_text('{"a": 1}\n{"a": 2')
    assert watcher.poll() == [{"a": 1}]
    with open(path, "a") as f:
        f.write("}\n")
    assert watcher.poll() == [{"a": 2}] and watcher.poll() == []


def test_launch_training_end_to_end(tmp_path, train_data, val_data, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    lines: list[str] = []
    notices: list[dict] = []
    cfg = tiny_config(
        max_steps=4, tracker={"tensorboard": True}, eval_interval=2, checkpoint={"interval": 2}
    )
    run = tmp_path / "run"
    summary = launch_training(
        cfg, train_data, run, val_dir=val_data, on_line=lines.append, on_checkpoint=notices.append
    )
    assert lines[0].startswith("launching: ")
    assert any(line.startswith("step 4 loss") for line in lines)
    # One notice per complete checkpoint, in order, each naming a folder that is complete.
    assert [(n["step"], n["final"]) for n in notices] == [(2, False), (4, True)]
    assert notices[-1]["path"] == str(run / "final")
    assert summary["steps"] == 4 and summary["tokens_seen"] == 4 * 4 * 32
    assert summary["total_tokens_seen"] == summary["tokens_seen"]  # no earlier stage
    assert summary["tokens_per_s"] > 0
    losses = losses_by_step(run)
    recent = [losses[step] for step in sorted(losses)][-RECENT_LOSSES:]
    assert summary["last_loss"] == losses[4]
    assert summary["final_loss"] == pytest.approx(sum(recent) / len(recent), rel=1e-6)
    # A fresh model predicts about uniformly: the first loss is near ln(vocab); it then falls.
    assert abs(losses[1] - math.log(VOCAB)) < 0.3 and losses[4] < losses[1] - 0.05
    # The launcher changes nothing the trainer computes: a direct run gives the same numbers.
    direct = tmp_path / "direct"
    run_trainer(cfg, train_data, direct, val_dir=val_data)
    expected = json.loads((direct / "summary.json").read_text())
    for key in ("final_loss", "val_loss", "steps", "tokens_seen"):
        assert summary[key] == expected[key], key
    assert losses_by_step(direct) == losses
    assert list((run / "tb").glob("events.out.tfevents.*"))
    for name in ("metrics.jsonl", "summary.json", "final/COMPLETE", "final/model.safetensors"):
        assert (run / name).exists(), name


def test_launch_fails_before_launching_on_bad_input(tmp_path, train_data):
    lines: list[str] = []
    bad = tiny_config(model={"preset": "debug", "overrides": {**TINY_MODEL, "vocab_size": 64}})
    with pytest.raises(BadInputError, match="vocab_size=64 differs"):
        launch_training(bad, train_data, tmp_path / "run", on_line=lines.append)
    assert lines == []
