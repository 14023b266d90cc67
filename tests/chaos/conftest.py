"""Shared fixtures of the chaos suite: tiny packed data, a tiny trainer config, tree comparison."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

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


@pytest.fixture(autouse=True)
def _single_thread(monkeypatch):
    """One BLAS thread per process: the machine's cores are shared and results stay exact."""
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


def make_packed(out_dir: Path, num_docs: int = 120, seed: int = 0) -> Path:
    """Write a small packed dataset (the trainer's input) of learnable token chains."""
    from llmflow.tasks.dataprep.pack import write_packed

    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        length = int(rng.integers(8, 60))
        tokens = np.empty(length, np.int64)
        tokens[0] = rng.integers(1, VOCAB)
        for i in range(1, length):
            tokens[i] = (tokens[i - 1] * 5 + 3) % (VOCAB - 1) + 1
        tokens[-1] = 0
        docs.append(tokens)
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths = np.array([len(d) for d in docs])
    write_packed(
        [(np.concatenate(docs), lengths)],
        out_dir,
        seq_len=SEQ_LEN,
        vocab_size=VOCAB,
        eos_id=0,
        pad_id=0,
        seed=seed,
        rows_per_shard=64,
    )
    return out_dir


@pytest.fixture(scope="session")
def chaos_train_data(tmp_path_factory) -> Path:
    """A packed training set shared by the chaos tests (read-only)."""
    return make_packed(tmp_path_factory.mktemp("chaos-data") / "train")


def tiny_train_config(**changes):
    """A pretrain TrainConfig for the tiny model (debug preset); keyword args replace fields."""
    from llmflow.tasks.pretrain.config import TrainConfig

    base = {
        "model": {"preset": "debug", "overrides": TINY_MODEL},
        "optimizer": {"lr": 3e-3},
        "schedule": {"name": "cosine", "warmup_steps": 2},
        "batch": {"micro_batch_size": 4, "grad_accum_steps": 1},
        "max_steps": 8,
        "checkpoint": {"interval": 2, "keep_last": 3},
        "log_interval": 1,
        "tracker": {"tensorboard": False},
        "progress_bar": False,
    }
    base.update(changes)
    return TrainConfig.model_validate(base)


def file_digests(root: Path, pattern: str = "**/*") -> dict[str, str]:
    """sha256 of every file under ``root`` matching ``pattern``, keyed by relative path."""
    root = Path(root)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.glob(pattern))
        if p.is_file()
    }


def run_trainer(cfg, data_dir: Path, out_dir: Path, *, faults=None, timeout: float = 300, **popen):
    """Run the trainer as its own process (as production does); return the CompletedProcess.

    ``faults`` (a dict) turns on the trainer's fault injector through ``LLMFLOW_FAULTS``; extra
    keyword arguments go to ``subprocess.run`` (e.g. ``preexec_fn`` to set a resource limit).
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
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(ENV, None)
    if faults:
        env[ENV] = json.dumps(faults)
    return subprocess.run(
        local_launcher(1).command(train_arguments(config_path, data_dir, out_dir)),
        cwd=out_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, chaos_train_data) -> Path:
    """A fault-free run of ``tiny_train_config()`` on the shared data (read-only: copy it)."""
    out = tmp_path_factory.mktemp("chaos-reference") / "run"
    proc = run_trainer(tiny_train_config(), chaos_train_data, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out
