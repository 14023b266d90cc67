"""Fixtures for the trainer tests: tiny packed datasets and a tiny model config."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from llmflow.tasks.dataprep.pack import write_packed

VOCAB = 128
SEQ_LEN = 32

TINY_MODEL = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 64,
    "max_seq_len": 64,
}


def make_packed(out_dir: Path, num_docs: int = 200, seed: int = 0, vocab: int = VOCAB) -> Path:
    """Write a packed dataset of learnable documents (a noisy affine token chain)."""
    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = []
    for _ in range(num_docs):
        length = int(rng.integers(8, 60))
        tokens = np.empty(length, np.int64)
        tokens[0] = rng.integers(1, vocab)
        for i in range(1, length):
            noisy = rng.random() < 0.1
            tokens[i] = (
                rng.integers(1, vocab) if noisy else (tokens[i - 1] * 5 + 3) % (vocab - 1) + 1
            )
        tokens[-1] = 0  # eos
        docs.append(tokens)
    lengths = np.array([len(d) for d in docs])
    write_packed(
        [(np.concatenate(docs), lengths)],
        out_dir,
        seq_len=SEQ_LEN,
        vocab_size=vocab,
        eos_id=0,
        pad_id=0,
        seed=seed,
        rows_per_shard=64,
    )
    return out_dir


@pytest.fixture(autouse=True)
def _offline_env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


@pytest.fixture(scope="session")
def train_data(tmp_path_factory) -> Path:
    return make_packed(tmp_path_factory.mktemp("data") / "train", num_docs=300, seed=0)


@pytest.fixture(scope="session")
def val_data(tmp_path_factory) -> Path:
    return make_packed(tmp_path_factory.mktemp("data") / "val", num_docs=60, seed=1)


def tiny_config(**changes):
    """A TrainConfig for the tiny model; keyword args replace top-level sections or fields."""
    from llmflow.tasks.pretrain.config import TrainConfig

    base = {
        "model": {"preset": "debug", "overrides": TINY_MODEL},
        "optimizer": {"lr": 3e-3},
        "schedule": {"name": "cosine", "warmup_steps": 2},
        "batch": {"micro_batch_size": 4, "grad_accum_steps": 1},
        "max_steps": 12,
        "checkpoint": {"interval": 4, "keep_last": 2},
        "log_interval": 1,
        "eval_interval": 6,
        "eval_batches": 2,
        "tracker": {"tensorboard": False},
        "progress_bar": False,
    }
    base.update(changes)
    return TrainConfig.model_validate(base)


def run_trainer(
    cfg,
    data_dir,
    out_dir,
    *,
    val_dir=None,
    init_from=None,
    num_processes=1,
    check=True,
    timeout=300,
    faults=None,
    script=None,
):
    """Run the trainer as its own process (as production does); return the CompletedProcess.

    ``faults`` (a dict) turns on the fault-injection component through ``LLMFLOW_FAULTS``;
    ``script`` (a path) runs in place of the trainer's module (the trainer with a test component).
    """
    import json
    import subprocess

    from llmflow.tasks.pretrain.faults import ENV
    from llmflow.tasks.pretrain.launch import train_arguments
    from llmflow.tasks.pretrain.launchers import local_launcher

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "train_config.json"
    cfg.save(config_path)
    args = train_arguments(config_path, data_dir, out_dir, val_dir, init_from)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(ENV, None)
    if faults:
        env[ENV] = json.dumps(faults)
    command = local_launcher(num_processes).command(args)
    if script is not None:
        at = len(command) - len(args) - 2  # "-m <trainer module>" just before the arguments
        command[at : at + 2] = [str(script)]
    proc = subprocess.run(
        command,
        cwd=out_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def losses_by_step(out_dir: Path) -> dict[int, float]:
    """Map step -> loss from metrics.jsonl (the last row wins for replayed steps)."""
    return {row["step"]: row["loss"] for row in read_jsonl(Path(out_dir) / "metrics.jsonl")}
