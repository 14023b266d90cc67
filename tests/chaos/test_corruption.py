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


def test_resume_passes_over_corrupt_latest_checkpoints(tmp_path, chaos_train_data, reference_run):
    cfg = tiny_train_config()  # 8 steps, checkpoints every 2, keep 3
    weights = file_digests(reference_run / "final", "model.safetensors")

    run = tmp_path / "crashed"
    proc = run_trainer(cfg, chaos_train_data, run, faults={"crash_after_step": 7})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    step2, step4, step6 = (run / "checkpoints" / f"step-00000{k}" for k in (2, 4, 6))
    assert all((s / "checksums.json").exists() for s in (step2, step4, step6))
    flipped = next((step6 / "dcp").glob("*.distcp"))
    flip_byte(flipped)  # the latest: a flipped byte in its tensors
    (step4 / "dcp" / ".metadata").unlink()  # the one before: a missing DCP file

    out = _ok(run_trainer(cfg, chaos_train_data, run))
    assert f"checkpoint {step6} is corrupt: {flipped}: content changed" in out, out
    assert f"checkpoint {step4} is corrupt: {step4}/dcp/.metadata: missing" in out, out
    assert f"resuming from {step2}" in out and "at step 2" in out, out
    assert file_digests(run / "final", "model.safetensors") == weights

    # A finished run whose final/ weights were truncated: re-run, final/ is rebuilt from step 6.
    finished = tmp_path / "finished"
    shutil.copytree(reference_run, finished)
    truncate(finished / "final" / "model.safetensors")
    out = _ok(run_trainer(cfg, chaos_train_data, finished))
    assert f"{finished}/final/model.safetensors: truncated:" in out, out
    assert "at step 6" in out, out
    assert file_digests(finished / "final", "model.safetensors") == weights
    # The tensors (and optimizer state) too; DCP's .metadata holds the folder's path, so not it.
    shards = "dcp/*.distcp"
    assert file_digests(finished / "final", shards) == file_digests(reference_run / "final", shards)


def test_verify_names_each_corrupt_committed_output_and_a_rebuild_matches(
    tmp_path, monkeypatch, capsys
):
    from llmflow.flows.cli import main
    from llmflow.tasks.framework.executor import Executor
    from llmflow.tasks.pretrain.faults import ENV
    from tests.chaos.test_preemption import _graph

    monkeypatch.delenv(ENV, raising=False)
    root = tmp_path / "store"
    graph, stage = _graph()
    outcome = Executor(str(root)).run(graph)
    run = Path(outcome[stage].uri)
    data = next(Path(root, "chaos-packed").glob("train-*"))
    before = {
        "weights": file_digests(run, "final/model.safetensors"),
        "shards": file_digests(data, "shard_*.bin"),
    }
    assert main(["verify", str(root)]) == 0
    capsys.readouterr()

    truncate(run / "final" / "model.safetensors")
    flip_byte(data / "shard_00001.bin")
    missing = next((run / "final" / "dcp").glob("*.distcp"))
    missing.unlink()

    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"CORRUPT    {run}\n" in out and f"CORRUPT    {data}\n" in out
    assert f"{run}/final/model.safetensors: truncated:" in out
    assert f"{missing}: missing (recorded" in out
    assert f"{data}/shard_00001.bin: content changed: sha256" in out
    assert "2 committed outputs: 0 ok, 2 corrupt, 0 unchecked" in out

    # The fix verify points to: remove what it named; the re-run rebuilds it bit for bit.
    for bad in (run, data):
        shutil.rmtree(bad)
    outcome = Executor(str(root)).run(graph)
    assert file_digests(Path(outcome[stage].uri), "final/model.safetensors") == before["weights"]
    assert file_digests(data, "shard_*.bin") == before["shards"]
    assert main(["verify", str(root)]) == 0
