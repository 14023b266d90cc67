"""The Optuna sweep: space checks before any trial, crashed trials, cached trials, kill -9 resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import BaseModel

from llmflow.tasks.config import load_config
from llmflow.tasks.dataprep.pack import write_packed
from llmflow.tasks.framework.errors import BadInputError, ConfigError
from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.scaling.space import SweepSpace, check_space

VOCAB, SEQ = 128, 32
TINY = {
    "pretrain.train.model.overrides.hidden_size": 32,
    "pretrain.train.model.overrides.num_layers": 1,
    "pretrain.train.model.overrides.num_heads": 2,
    "pretrain.train.model.overrides.num_kv_heads": 1,
    "pretrain.train.model.overrides.intermediate_size": 64,
    "pretrain.train.model.overrides.max_seq_len": 64,
    "pretrain.train.batch.micro_batch_size": 4,
    "pretrain.train.schedule.warmup_steps": 2,
    "pretrain.train.eval_batches": 2,
    "pretrain.train.tracker.tensorboard": False,
    "pretrain.train.progress_bar": False,
    **{f"pretrain.stages.{i}.mixture.seq_len": SEQ for i in range(3)},
}


class ChainSpec(BaseModel):
    num_docs: int
    seed: int


@step("test-chain")
def chain_data(cfg: ChainSpec, out: Path) -> Metrics:
    """Packed documents of a noisy affine token chain: learnable, so the LR matters."""
    rng = np.random.default_rng(cfg.seed)
    docs = []
    for _ in range(cfg.num_docs):
        tokens = [int(rng.integers(1, VOCAB))]
        for _ in range(int(rng.integers(8, 60)) - 1):
            noisy = rng.random() < 0.1
            tokens.append(int(rng.integers(1, VOCAB)) if noisy else (tokens[-1] * 5 + 3) % 127 + 1)
        docs.append(np.array(tokens + [0]))
    lengths = np.array([len(d) for d in docs])
    write_packed(
        [(np.concatenate(docs), lengths)], out, seq_len=SEQ, vocab_size=VOCAB, eos_id=0, pad_id=0,
        seed=cfg.seed, rows_per_shard=64,
    )  # fmt: skip
    return {}


def tiny_config(root: Path, *extra: str):
    return load_config(None, [f"root={root}", *(f"{k}={v}" for k, v in TINY.items()), *extra])


def packed_inputs(root: Path) -> tuple[str, str]:
    graph = Graph()
    train = graph.add(chain_data, ChainSpec(num_docs=200, seed=0), "train")
    val = graph.add(chain_data, ChainSpec(num_docs=40, seed=1), "val")
    outcome = Executor(str(root)).run(graph)
    return outcome[train].uri, outcome[val].uri


def space(**changes) -> SweepSpace:
    base = {
        "study": "tiny",
        "trials": 2,
        "max_steps": 8,
        "segments": 2,
        "sampler": {"name": "tpe", "seed": 0, "n_startup_trials": 2},
        "pruner": {"name": "asha", "min_resource": 1, "reduction_factor": 2},
        "params": {
            "pretrain.train.optimizer.lr": {"type": "float", "low": 1e-3, "high": 3e-2, "log": True}
        },
    }
    return SweepSpace.model_validate({**base, **changes})


# --------------------------------------------------------------------------------- bad input
def test_unknown_field_fails_before_any_trial_naming_it(tmp_path):
    from llmflow.flows.sweep import run_sweep

    bad = space(params={"pretrain.train.optimizer.lrate": {"type": "float", "low": 1, "high": 2}})
    with pytest.raises(ConfigError, match=r"pretrain\.train\.optimizer\.lrate.*unknown field"):
        run_sweep(tiny_config(tmp_path), bad, "unused", "unused")
    assert not (tmp_path / "sweeps").exists()  # no study, no trial


def test_rejected_value_fails_naming_field_and_value(tmp_path):
    bad = space(params={"pretrain.train.optimizer.lr": {"type": "float", "low": -1, "high": 1}})
    with pytest.raises(ConfigError, match=r"optimizer\.lr.*-1"):
        check_space(tiny_config(tmp_path), bad)
    choice = {"type": "categorical", "choices": ["cosine", "cosinus"]}
    with pytest.raises(ConfigError, match=r"schedule\.name.*'cosinus'"):
        check_space(tiny_config(tmp_path), space(params={"pretrain.train.schedule.name": choice}))


def test_field_outside_the_trainer_is_refused(tmp_path):
    bad = space(params={"sft.max_steps": {"type": "int", "low": 1, "high": 5}})
    with pytest.raises(BadInputError, match="sft.max_steps"):
        check_space(tiny_config(tmp_path), bad)


LR, MUON_LR = "pretrain.train.optimizer.lr", "pretrain.train.optimizer.muon_lr"


def optimizer_config(root: Path, name: str):
    """The tiny recipe with ``name``'s optimizer at lr 3e-3 (and Muon's group at 0.02)."""
    lrs = ["pretrain.train.optimizer.lr=0.003", "pretrain.train.optimizer.muon_lr=0.02"]
    return tiny_config(root, f"pretrain.train.optimizer.name={name}", *lrs)


def test_default_lr_space_follows_the_recipes_optimizer(tmp_path):
    from llmflow.tasks.scaling.space import lr_params

    adamw = lr_params(optimizer_config(tmp_path, "adamw"))
    muon = lr_params(optimizer_config(tmp_path, "muon"))
    # AdamW has one learning rate; Muon two: its own (hidden matrices) and AdamW's for the rest
    assert list(adamw) == [LR] and list(muon) == [MUON_LR, LR]
    assert muon != adamw
    # log ranges around the recipe's own values: AdamW [lr/3, 30 lr], Muon [muon_lr/4, 4 muon_lr]
    assert (adamw[LR].low, adamw[LR].high, adamw[LR].log) == (0.001, 0.09, True)
    assert (muon[MUON_LR].low, muon[MUON_LR].high, muon[MUON_LR].log) == (0.005, 0.08, True)
    assert muon[LR] == adamw[LR]
    # a grid: log-spaced choices, 3 significant digits, the recipe's value in the middle
    grid = lr_params(optimizer_config(tmp_path, "muon"), points=3)
    assert grid[MUON_LR].choices == [0.005, 0.02, 0.08]
    assert grid[LR].choices == [0.001, 0.00949, 0.09]


def test_space_file_learning_rates_follows_each_recipe(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"study": "x", "max_steps": 8, "params": "learning_rates"}))
    spec = SweepSpace.load(path)
    for name, paths in (("adamw", [LR]), ("muon", [MUON_LR, LR])):
        cfg = optimizer_config(tmp_path, name)
        check_space(cfg, spec)
        assert list(spec.for_recipe(cfg).params) == paths
    grid = {"study": "x", "max_steps": 8, "params": "learning_rates", "sampler": {"name": "grid"}}
    path.write_text(yaml.safe_dump(grid))
    with pytest.raises(ConfigError, match="sampler grid needs categorical"):
        SweepSpace.load(path)


def test_quickstart_lr_space_searches_muons_learning_rates():
    folder = Path(__file__).parents[2] / "configs"
    quickstart = load_config(folder / "quickstart.yaml")
    assert quickstart.pretrain.train.optimizer.name == "muon"
    params = SweepSpace.load(folder / "sweeps" / "lr.yaml").for_recipe(quickstart).params
    muon_lr = quickstart.pretrain.train.optimizer.muon_lr
    assert params[MUON_LR].low < muon_lr < params[MUON_LR].high
    assert params[LR].low < quickstart.pretrain.train.optimizer.lr < params[LR].high


def test_muon_lr_on_an_adamw_recipe_is_refused(tmp_path):
    bad = space(params={MUON_LR: {"type": "float", "low": 0.01, "high": 0.05}})
    with pytest.raises(BadInputError, match=r"optimizer\.muon_lr.*optimizer is adamw"):
        check_space(optimizer_config(tmp_path, "adamw"), bad)
    check_space(optimizer_config(tmp_path, "muon"), bad)
    name = {"type": "categorical", "choices": ["adamw", "muon"]}  # trials that pick Muon read it
    both = space(params={**bad.params, "pretrain.train.optimizer.name": name})
    check_space(optimizer_config(tmp_path, "adamw"), both)


def test_space_file_errors_name_the_field(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"study": "x", "max_steps": 10, "segments": 3, "params": {}}))
    with pytest.raises(ConfigError, match="not a multiple of segments"):
        SweepSpace.load(path)


# --------------------------------------------------------------------------------- flows
def test_crashing_trials_are_recorded_and_the_sweep_stops(prefect_harness, tmp_path):
    import optuna

    from llmflow.flows.sweep import SweepFailed, run_sweep, storage_url

    data, val = packed_inputs(tmp_path)
    vocab = {"pretrain.train.model.overrides.vocab_size": {"type": "categorical", "choices": [64]}}
    bad = space(study="crash", trials=4, max_failure_share=0.25, params=vocab)
    cfg = tiny_config(tmp_path)
    with pytest.raises(SweepFailed, match="2 of 4 trials failed"):
        run_sweep(cfg, bad, data, val)
    study = optuna.load_study(study_name="crash", storage=storage_url(cfg, bad))
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]  # stopped after the 2nd
    assert all("vocab_size=64" in t.user_attrs["error"] for t in study.trials)


def test_tiny_sweep_reports_segments_and_a_repeat_reuses_every_trial(prefect_harness, tmp_path):
    from llmflow.flows.sweep import run_sweep

    data, val = packed_inputs(tmp_path)
    cfg = tiny_config(tmp_path)
    first = run_sweep(cfg, space(study="a"), data, val)
    assert len(first.rows) == 2 and first.rows[0]["segments"] >= 1
    best_row = min(r["val_loss"] for r in first.rows if r["state"] == "complete")
    assert first.best_value == pytest.approx(best_row, abs=1e-5)
    assert (Path(first.folder) / "best.yaml").exists()
    for plot in ("history", "intermediate"):
        assert (Path(first.folder) / f"{plot}.png").stat().st_size > 1000
    best = yaml.safe_load((Path(first.folder) / "best.yaml").read_text())
    assert (
        best["pretrain"]["train"]["optimizer"]["lr"]
        == first.best_params["pretrain.train.optimizer.lr"]
    )
    # Same sampler seed, new study: the same parameters, every segment found in the store.
    again = run_sweep(cfg, space(study="b"), data, val)
    assert [r["pretrain.train.optimizer.lr"] for r in again.rows] == [
        r["pretrain.train.optimizer.lr"] for r in first.rows
    ]
    import optuna

    from llmflow.flows.sweep import storage_url

    study = optuna.load_study(study_name="b", storage=storage_url(cfg, space(study="b")))
    assert all(t.user_attrs["cached_segments"] == len(t.intermediate_values) for t in study.trials)
    assert [r["val_loss"] for r in again.rows] == [r["val_loss"] for r in first.rows]


@pytest.mark.slow
def test_learning_rates_space_trains_a_muon_recipe_at_the_sampled_rates(prefect_harness, tmp_path):
    from llmflow.flows.sweep import run_sweep
    from llmflow.tasks.pretrain.config import TrainConfig

    data, val = packed_inputs(tmp_path)
    cfg = optimizer_config(tmp_path, "muon")
    spec = space(study="muon", trials=1, max_steps=4, segments=1, params="learning_rates")
    result = run_sweep(cfg, spec, data, val)
    (row,) = result.rows
    assert 0.005 <= row[MUON_LR] <= 0.08 and 0.001 <= row[LR] <= 0.09
    best = yaml.safe_load((Path(result.folder) / "best.yaml").read_text())["pretrain"]["train"]
    assert (best["optimizer"]["muon_lr"], best["optimizer"]["lr"]) == (row[MUON_LR], row[LR])
    (segment,) = (tmp_path / "pretrain").glob("*-sweep-*")  # what the trial really trained
    trained = TrainConfig.load(segment / "train_config.json").optimizer
    assert (trained.name, trained.muon_lr, trained.lr) == ("muon", row[MUON_LR], row[LR])


DRIVER = """
import sys
from llmflow.flows.sweep import run_sweep
from llmflow.tasks.scaling.space import SweepSpace
sys.path.insert(0, {tests!r})
from test_sweep import tiny_config, space
from pathlib import Path
run_sweep(tiny_config(Path({root!r})), space(**{changes!r}), {data!r}, {val!r})
"""


def _orphans(marker: str) -> list[int]:
    """PIDs of this test's trainer processes (their command lines name the test's folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if proc.name.isdigit() and "pretrain.train" in cmdline and marker in cmdline:
            found.append(int(proc.name))
    return found


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sweep_killed_with_sigkill_resumes_and_finishes(prefect_harness, tmp_path):
    import optuna

    from llmflow.flows.sweep import run_sweep, storage_url

    data, val = packed_inputs(tmp_path)
    changes = {"study": "killed", "trials": 2, "max_steps": 8, "segments": 2, "grace_s": 3}
    changes["pruner"] = {"name": "none"}
    script = DRIVER.format(
        tests=str(Path(__file__).parent), root=str(tmp_path), changes=changes, data=data, val=val
    )
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-driver")}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=env)
    segments = tmp_path / "pretrain"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if any((p / "_COMMITTED").exists() for p in segments.glob("*-sweep-*")):
            break  # the first trial's first segment is done: kill mid-trial
        time.sleep(0.2)
    assert proc.poll() is None, "the sweep ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    for pid in _orphans(str(tmp_path)):  # the trainer runs in its own session: end it too
        os.kill(pid, signal.SIGKILL)
    cfg, spec = tiny_config(tmp_path), space(**changes)
    study = optuna.load_study(study_name="killed", storage=storage_url(cfg, spec))
    assert [t.state.name for t in study.trials] == ["RUNNING"]

    result = run_sweep(cfg, spec, data, val)
    study = optuna.load_study(study_name="killed", storage=storage_url(cfg, spec))
    states = [t.state.name for t in study.trials]
    assert states.count("COMPLETE") == 2 and states[0] == "FAIL"  # the killed trial, re-queued
    retried = [t for t in study.trials if "failed_trial" in t.system_attrs]
    assert len(retried) == 1 and retried[0].state.name == "COMPLETE"
    assert retried[0].params == study.trials[0].params
    assert retried[0].user_attrs["cached_segments"] == 1  # its first segment came from the store
    assert len(result.rows) == 3 and result.best_value == study.best_value
