"""Pipeline-parallel checkpoints the trainer loads back at pp > 1: a second curriculum stage
initialised from the first (AdamW and Muon), and a kill -9 resumed at pp=2 and pp=4.

Before flattened optimizer state, each stage wrote its param groups under the same positional
keys and DCP kept one rank's: the other stage's first optimizer step after any load raised
``KeyError: 'betas'`` (AdamW) or ``'momentum'`` (Muon). Tiny models, gloo on CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tasks/pretrain/conftest.py

from conftest import (  # noqa: E402
    TINY_MODEL,
    losses_by_step,
    make_packed,
    read_jsonl,
    run_trainer,
    tiny_config,
)

pytestmark = pytest.mark.slow
DEADLINE_S = 300


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_packed(tmp_path_factory.mktemp("pp_ckpt") / "train", num_docs=300, seed=0)


@pytest.fixture(scope="module")
def data2(tmp_path_factory) -> Path:
    return make_packed(tmp_path_factory.mktemp("pp_ckpt") / "train2", num_docs=120, seed=1)


def _config(pp: int, optimizer: str = "adamw", layers: int = 2, **changes):
    model = {"preset": "debug", "overrides": {**TINY_MODEL, "num_layers": layers}}
    base = dict(
        model=model,
        optimizer={"name": optimizer, "lr": 3e-3, "muon_lr": 0.02},
        batch={"micro_batch_size": 2, "grad_accum_steps": max(pp, 2)},  # a micro-batch a stage
        checkpoint={"interval": 3, "keep_last": 2},
        eval_interval=100,
    )
    if pp > 1:
        base["parallel"] = {"pp": pp}
    return tiny_config(**{**base, **changes})


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_pp2_curriculum_second_stage_continues_the_first(tmp_path, data, data2, optimizer):
    """Stage 2 initialises from stage 1's final/ (weights, optimizer, step) at pp=2 and trains
    as the same 2-stage curriculum in one process does (within float differences)."""
    runs = {}
    for name, pp, processes in (("one", 1, 1), ("pp2", 2, 2)):
        first, second = tmp_path / name / "s1", tmp_path / name / "s2"
        cfg = _config(pp, optimizer, max_steps=4)
        run_trainer(cfg, data, first, num_processes=processes, timeout=DEADLINE_S)
        proc = run_trainer(
            cfg.model_copy(update={"max_steps": 3}),
            data2,
            second,
            init_from=first,
            num_processes=processes,
            timeout=DEADLINE_S,
        )
        assert "initialised from" in proc.stdout
        runs[name] = losses_by_step(second)
    assert sorted(runs["pp2"]) == [5, 6, 7]
    for step, expected in runs["one"].items():
        assert abs(runs["pp2"][step] - expected) <= 1e-4 * expected, (step, runs)


@pytest.mark.parametrize(("pp", "layers"), [(2, 2), (4, 4)])
def test_pp_killed_resumes_bitwise(tmp_path, data, pp, layers):
    """kill -9 after step 5 (checkpoint at step 3): the rerun resumes at pp from step 3 and ends
    on the uninterrupted run's weights, bit for bit."""
    cfg = _config(pp, layers=layers, max_steps=7)
    full, killed = tmp_path / "full", tmp_path / "killed"
    run_trainer(cfg, data, full, num_processes=pp, timeout=DEADLINE_S)
    proc = run_trainer(
        cfg, data, killed, num_processes=pp, check=False, faults={"sigkill_after_step": 5},
        timeout=DEADLINE_S,
    )  # fmt: skip
    assert proc.returncode != 0 and "SIGKILL after step 5" in proc.stdout + proc.stderr
    assert not (killed / "final").exists()
    proc = run_trainer(cfg, data, killed, num_processes=pp, timeout=DEADLINE_S)
    assert "resumed from" in proc.stdout and "step 3" in proc.stdout
    assert losses_by_step(killed) == losses_by_step(full)
    expected, got = _weights(full), _weights(killed)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_pp2_guard_rewind_reloads_both_stages(tmp_path, data, optimizer):
    """The guard's rewind loads a checkpoint back as a resume does: at pp=2, a loss spike at
    step 5 rewinds both stages to step 3 and the run trains on as one process's rewind does
    (before flattened optimizer state, the next step raised KeyError in the other stage)."""
    guard = {"policy": "rewind", "window": 8, "min_history": 4, "zscore": 5.0}
    faults = {"scale_loss_at_steps": [5], "loss_scale": 100.0}
    runs = {}
    for name, pp in (("one", 1), ("pp2", 2)):
        out = tmp_path / name
        cfg = _config(pp, optimizer, max_steps=7, guard=guard)
        run_trainer(cfg, data, out, num_processes=pp, faults=faults, timeout=DEADLINE_S)
        events = read_jsonl(out / "events.jsonl")
        assert [(e["kind"], e["rewound_to"]) for e in events] == [("spike", 3)], events
        runs[name] = losses_by_step(out)
    assert sorted(runs["pp2"]) == list(range(1, 8))
    for step, expected in runs["one"].items():
        assert abs(runs["pp2"][step] - expected) <= 1e-4 * expected, (step, runs)
