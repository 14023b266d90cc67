"""Asynchronous checkpoints: training goes on while a checkpoint is written; a kill mid-write
never leaves a checkpoint that looks complete, and the run resumes exactly from the previous one."""

from __future__ import annotations

import pytest
from conftest import losses_by_step, run_trainer, tiny_config

from llmflow.tasks.pretrain import checkpoint as ckpt
from tests.tasks.pretrain.notices import read_notices

KILL = {"slow_storage_after_step": 6, "checkpoint_write_delay_s": 120, "sigkill_after_step": 8}


def _cfg(**changes):
    return tiny_config(max_steps=12, checkpoint={"interval": 4, "keep_last": 2, "async_save": True},
                       **changes)  # fmt: skip


def _kill_then_resume(tmp_path, train_data, num_processes, **changes):
    cfg = _cfg(**changes)
    full = tmp_path / "full"
    run_trainer(cfg, train_data, full, num_processes=num_processes)
    assert [(n["step"], n["final"]) for n in read_notices(full)] == [
        (4, False),
        (8, False),
        (12, True),
    ]
    assert all(n["blocked_s"] >= 0 for n in read_notices(full))

    killed = tmp_path / "killed"
    proc = run_trainer(cfg, train_data, killed, num_processes=num_processes, check=False,
                       faults=KILL)  # fmt: skip
    assert proc.returncode != 0
    assert "SIGKILL after step 8; .tmp-step-000008 in flight" in proc.stdout
    # The write of step 8 never finished: a partial folder, no marker, not a checkpoint.
    partial = killed / "checkpoints" / ".tmp-step-000008"
    assert partial.is_dir() and not ckpt.is_complete(partial)
    assert not (partial / "dcp" / ".metadata").exists()
    assert not (killed / "checkpoints" / "step-000008").exists()
    assert [p.name for p in ckpt.list_checkpoints(killed)] == ["step-000004"]
    assert [n["step"] for n in read_notices(killed)] == [4]

    proc = run_trainer(cfg, train_data, killed, num_processes=num_processes)
    assert "resumed from" in proc.stdout and "step-000004 at step 4" in proc.stdout
    assert losses_by_step(killed) == losses_by_step(full)
    assert not partial.exists()


def test_sigkill_during_async_save_resumes_from_previous_checkpoint(tmp_path, train_data):
    _kill_then_resume(tmp_path, train_data, num_processes=1)


@pytest.mark.slow
def test_async_and_sync_checkpoints_train_identically(tmp_path, train_data):
    sync = tmp_path / "sync"
    run_trainer(tiny_config(max_steps=12, checkpoint={"interval": 4, "keep_last": 2}), train_data,
                sync)  # fmt: skip
    run_trainer(_cfg(), train_data, tmp_path / "async")
    assert losses_by_step(tmp_path / "async") == losses_by_step(sync)
    names = sorted(p.name for p in (tmp_path / "async" / "checkpoints").iterdir())
    assert names == ["step-000004", "step-000008"]


@pytest.mark.slow
def test_sigkill_during_async_save_two_ranks(tmp_path, train_data):
    _kill_then_resume(tmp_path, train_data, num_processes=2, batch={"micro_batch_size": 2})
