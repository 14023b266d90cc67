"""Corruption: a truncated model.safetensors, a flipped byte, a missing DCP file.

Each is found by the checksums recorded when it was written: a resume passes over a corrupt
latest checkpoint for the previous good one (and says so), and ``llmflow verify`` names each
corrupt committed output. Runs that resume finish with the fault-free run's weights, bit for bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.chaos.conftest import file_digests, run_trainer, tiny_train_config

pytestmark = pytest.mark.slow


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Flip the low bit of one byte (the middle one by default) in place."""
    data = bytearray(path.read_bytes())
    index = len(data) // 2 if offset is None else offset
    data[index] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path, keep: float = 0.5) -> None:
    with open(path, "r+b") as f:
        f.truncate(int(path.stat().st_size * keep))


def _ok(proc) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_resume_passes_over_a_corrupt_latest_checkpoint(tmp_path, chaos_train_data):
    cfg = tiny_train_config()  # 8 steps, checkpoints every 2, keep 3
    reference = tmp_path / "reference"
    _ok(run_trainer(cfg, chaos_train_data, reference))
    weights = file_digests(reference / "final", "model.safetensors")

    crashed = tmp_path / "crashed"
    proc = run_trainer(cfg, chaos_train_data, crashed, faults={"crash_after_step": 7})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    step6 = Path("checkpoints/step-000006")
    assert (crashed / step6 / "checksums.json").exists()

    cases = {
        "flipped": lambda run: flip_byte(next((run / step6 / "dcp").glob("*.distcp"))),
        "missing": lambda run: (run / step6 / "dcp" / ".metadata").unlink(),
    }
    for label, corrupt in cases.items():
        run = tmp_path / label
        shutil.copytree(crashed, run)
        corrupt(run)
        out = _ok(run_trainer(cfg, chaos_train_data, run))
        assert f"checkpoint {run / step6} is corrupt: {run / step6}/dcp/" in out, out
        assert f"resuming from {run}/checkpoints/step-000004" in out, out
        assert "resumed from" in out and "at step 4" in out, out
        assert file_digests(run / "final", "model.safetensors") == weights, label

    # A finished run whose final/ weights were truncated: re-run, final/ is rebuilt from step 6.
    finished = tmp_path / "finished"
    shutil.copytree(reference, finished)
    truncate(finished / "final" / "model.safetensors")
    out = _ok(run_trainer(cfg, chaos_train_data, finished))
    assert f"{finished}/final/model.safetensors: truncated:" in out, out
    assert "at step 6" in out, out
    assert file_digests(finished / "final", "model.safetensors") == weights
    # The tensors (and optimizer state) too; DCP's .metadata holds the folder's path, so not it.
    shards = "dcp/*.distcp"
    assert file_digests(finished / "final", shards) == file_digests(reference / "final", shards)
