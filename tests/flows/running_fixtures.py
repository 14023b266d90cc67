"""Helpers of the running-evaluation tests and benchmark: quickstart-shaped stage-1 runs (the
quickstart's trainer settings, shrunk) on text packed with a tiny local tokenizer, so the lm-eval
suite can score the converted checkpoints."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "eval_fixtures", REPO / "tests" / "tasks" / "evaluation" / "eval_fixtures.py"
)
eval_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eval_fixtures)

SEQ_LEN = 64
STEPS = 16
INTERVAL = 4


def write_tokenizer(out_dir: Path) -> Path:
    eval_fixtures.make_tokenizer().save_pretrained(out_dir)
    return out_dir


def _documents(num_docs: int, seed: int) -> list[str]:
    """Short arithmetic drills and the fixture's prose: learnable text."""
    rng = np.random.default_rng(seed)
    prose = eval_fixtures.TEXT.split("\n")
    docs = []
    for _ in range(num_docs):
        if rng.random() < 0.6:
            a, b = int(rng.integers(0, 20)), int(rng.integers(0, 20))
            docs.append(f"Question: What is {a} + {b}?\nAnswer: {a + b}\n")
        else:
            docs.append(" ".join(rng.choice(prose, size=3)))
    return docs


def write_packed_text(out_dir: Path, num_docs: int, seed: int) -> Path:
    """``num_docs`` documents tokenized with the tiny tokenizer, packed into SEQ_LEN rows."""
    from llmflow.tasks.dataprep.pack import write_packed

    tok = eval_fixtures.make_tokenizer()
    eos = tok.eos_token_id
    docs = [np.array(tok(d)["input_ids"] + [eos], np.int64) for d in _documents(num_docs, seed)]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_packed(
        [(np.concatenate(docs), np.array([len(d) for d in docs]))],
        out_dir,
        seq_len=SEQ_LEN,
        vocab_size=len(tok),
        eos_id=eos,
        pad_id=tok.pad_token_id,
        seed=seed,
        rows_per_shard=64,
    )
    return out_dir


def stage1_config(seed: int = 0, lr_scale: float = 1.0, keep_last: int = 2, steps: int = STEPS):
    """The quickstart's pretrain.train section (debug model, Muon, its LR), shrunk."""
    from llmflow.tasks.pretrain.config import TrainConfig

    train = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())["pretrain"]["train"]
    tok = eval_fixtures.make_tokenizer()
    train["model"]["overrides"] = {
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    train["optimizer"]["lr"] *= lr_scale
    train.update(
        seed=seed,
        max_steps=steps,
        schedule={**train["schedule"], "warmup_steps": 2},
        checkpoint={"interval": INTERVAL, "keep_last": keep_last},
        eval_interval=1000,
        log_interval=INTERVAL,
        tracker={"tensorboard": False},
        progress_bar=False,
    )
    return TrainConfig.model_validate(train)


def start_trainer(cfg, data_dir: Path, out_dir: Path, threads: int = 1) -> subprocess.Popen:
    """The trainer in its own process (as the pretrain step runs it), not waited for."""
    from llmflow.tasks.pretrain.faults import ENV
    from llmflow.tasks.pretrain.launch import train_arguments
    from llmflow.tasks.pretrain.launchers import local_launcher

    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "train_config.json"
    cfg.save(config_path)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop(ENV, None)
    command = local_launcher(1).command(train_arguments(config_path, data_dir, out_dir))
    return subprocess.Popen(
        command, cwd=out_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def train(cfg, data_dir: Path, out_dir: Path, timeout: float = 300) -> Path:
    proc = start_trainer(cfg, data_dir, out_dir)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out_dir


def read_alerts(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / "events.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r.get("event") == "alert"]


if __name__ == "__main__":  # pragma: no cover - a manual look at one run
    root = Path(sys.argv[1])
    data = write_packed_text(root / "train", 600, 0)
    train(stage1_config(), data, root / "run")
