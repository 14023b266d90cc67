"""Detectors: the throughput detector on rows by hand, then each fault planted for real in the
trainer (slow reads, a stalled read, a corrupted block, a resume), clean runs, and the per-layer
statistics at fsdp=2, pp=2 and tp=2 against one process."""

from __future__ import annotations

import json
import math

import pytest
from conftest import read_jsonl, run_trainer, tiny_config

from llmflow.tasks.pretrain.alerts import read_alerts
from llmflow.tasks.pretrain.config import MonitorConfig
from llmflow.tasks.pretrain.detectors import ThroughputDetector


# ----------------------------------------------------------------- the throughput detector
def _row(step, data=0.05, compute=0.9, checkpoint=0.0, validation=0.0):
    """A metric row of 1,000 tokens whose step took data + compute + 0.05 s (optimizer)."""
    step_s = data + compute + 0.05
    return {"step": step, "tokens_per_s": 1000 / step_s, "time_step_s": step_s,
            "time_data_s": data, "time_compute_s": compute, "time_optimizer_s": 0.05,
            "time_checkpoint_s": checkpoint, "time_validation_s": validation,
            "data_share": data / step_s}  # fmt: skip


def _detector(tmp_path, **changes):
    return ThroughputDetector(MonitorConfig(**changes), tmp_path, "stage")


def _feed(detector, rows):
    return [a for a in (detector.observe(r) for r in rows) if a is not None]


@pytest.mark.parametrize(
    ("slow", "cause"),
    [({"data": 2.0}, "data wait"), ({"compute": 3.0}, "compute"), ({"checkpoint": 3.0},
     "checkpoint")],
)  # fmt: skip
def test_a_sustained_drop_alerts_once_with_its_cause(tmp_path, slow, cause):
    detector = _detector(tmp_path)
    normal = [_row(s) for s in range(1, 11)]
    low = [_row(s, **slow) for s in range(11, 17)]
    alerts = _feed(detector, normal + low)
    assert [(a["kind"], a["step"], a["cause"]) for a in alerts] == [("throughput", 13, cause)]
    assert alerts[0]["details"]["since_step"] == 11
    assert read_alerts(tmp_path) == alerts


def test_quiet_through_warmup_single_slow_rows_and_validation(tmp_path):
    detector = _detector(tmp_path)
    rows = [_row(1, compute=9.0), _row(2, compute=9.0)]  # warm-up: first rows are slow
    for step in range(3, 40):  # a slow checkpoint save every 4th row, validation every 6th
        rows.append(_row(step, checkpoint=5.0 if step % 4 == 0 else 0.0,
                         validation=5.0 if step % 6 == 0 else 0.0))  # fmt: skip
    rows += [_row(40, data=3.0), _row(41, data=3.0), _row(42)]  # two slow rows: noise
    assert _feed(detector, rows) == []


def test_state_restored_alerts_as_uninterrupted(tmp_path):
    rows = [_row(s) for s in range(1, 13)] + [_row(s, data=2.0) for s in range(13, 17)]
    whole = _feed(_detector(tmp_path / "a"), rows)
    first = _detector(tmp_path / "b")
    _feed(first, rows[:10])
    resumed = _detector(tmp_path / "b")
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    resumed.quiet = 0  # warm-up rows after a resume are covered by the trainer runs below
    again = _feed(resumed, rows[10:])
    assert [(a["step"], a["cause"]) for a in again] == [(a["step"], a["cause"]) for a in whole]
    fresh = _detector(tmp_path / "c")  # without the state the window is empty: no alert
    fresh.quiet = 0
    assert _feed(fresh, rows[10:]) == []


# ----------------------------------------------------------------- faults planted for real
STALL_STEP, CORRUPT_STEP, SLOW_STEP, STEPS = 4, 16, 22, 26
FAULTS = {
    "stall_read_at_step": STALL_STEP, "stall_s": 1.5,
    "scale_weights_at_step": CORRUPT_STEP, "scale_layer": 1, "weight_scale": 10.0,
    "slow_reads_from_step": SLOW_STEP, "read_delay_s": 0.25,
}  # fmt: skip


def _faulted_config():
    """The tiny model learning fast enough (constant LR 1e-2) that a corrupted block spikes."""
    return tiny_config(
        max_steps=STEPS,
        optimizer={"lr": 1e-2},
        schedule={"name": "constant", "warmup_steps": 2},
        guard={"policy": "rewind", "window": 8, "min_history": 4, "zscore": 5.0},
        monitor={"layer_stats_every": 1, "stall_s": 0.5},
    )


@pytest.fixture(scope="module")
def faulted(tmp_path_factory, train_data):
    """One run with every fault, one after another: a read stalled 1.5 s at step 4, layers.1's
    weights x10 at step 16, every read 0.25 s slower (over 10x a step) from step 22."""
    out = tmp_path_factory.mktemp("faulted") / "run"
    run_trainer(_faulted_config(), train_data, out, faults=FAULTS)
    return out


def _alerts(out, kind):
    return [a for a in read_alerts(out) if a["kind"] == kind]


@pytest.mark.slow
def test_a_stalled_read_alerts_while_it_waits(faulted):
    stalls = _alerts(faulted, "stall")
    assert [(a["step"], a["cause"]) for a in stalls] == [(STALL_STEP, "data wait")]
    assert 0.5 < stalls[0]["details"]["waited_s"] < 1.5  # seen before the read returned


@pytest.mark.slow
def test_a_corrupted_block_is_named_by_the_guard(faulted):
    events = [e for e in read_jsonl(faulted / "events.jsonl") if e["kind"] == "spike"]
    assert [(e["step"], e["cause"], e["layers"][0]) for e in events] == [
        (CORRUPT_STEP, "layers.1", "layers.1")
    ]
    assert events[0]["policy"] == "rewind" and events[0]["event"] == "alert"
    assert events[0]["details"]["layers"][0]["weight_ratio"] == pytest.approx(10.0, rel=0.05)


@pytest.mark.slow
def test_slow_storage_alerts_within_three_log_intervals_naming_data_wait(faulted):
    drops = _alerts(faulted, "throughput")
    # the first slowed step is SLOW_STEP + 1 (log_interval 1): alerted by its third row
    assert [a["cause"] for a in drops] == ["data wait"]
    assert SLOW_STEP + 1 <= drops[0]["step"] <= SLOW_STEP + 3
    rows = {r["step"]: r for r in read_jsonl(faulted / "metrics.jsonl")}
    assert rows[STEPS]["data_share"] > 0.5 > rows[SLOW_STEP - 1]["data_share"]


@pytest.mark.slow
def test_a_resumed_run_alerts_as_the_uninterrupted_one(tmp_path, train_data, faulted):
    out = tmp_path / "run"
    crashed = run_trainer(_faulted_config(), train_data, out, check=False,
                          faults={**FAULTS, "crash_after_step": 20})  # fmt: skip
    assert crashed.returncode == 3
    run_trainer(_faulted_config(), train_data, out, faults=FAULTS)

    def seen(run):
        return [(a["kind"], a["step"], a["cause"]) for a in read_alerts(run)]

    assert seen(out) == seen(faulted)
    assert [k for k, _, _ in seen(out)] == ["stall", "spike", "throughput"]


# ----------------------------------------------------------------- clean runs, per-layer stats
CLEAN = dict(
    batch={"micro_batch_size": 2, "grad_accum_steps": 2},
    schedule={"name": "constant", "warmup_steps": 2},
    monitor={"layer_stats_every": 1},
)


@pytest.fixture(scope="module")
def clean_runs(tmp_path_factory, train_data, val_data):
    """Two clean runs (seeds 0 and 1), validated every 6 steps and saved every 4."""
    runs = []
    for seed in (0, 1):
        out = tmp_path_factory.mktemp(f"clean{seed}") / "run"
        run_trainer(tiny_config(max_steps=20, seed=seed, **CLEAN), train_data, out,
                    val_dir=val_data)  # fmt: skip
        runs.append(out)
    return runs


@pytest.mark.slow
def test_clean_runs_raise_no_alert(clean_runs):
    for out in clean_runs:
        assert read_alerts(out) == []
        row = read_jsonl(out / "metrics.jsonl")[-1]
        split = sum(row[f"time_{p}_s"] for p in ("data", "compute", "optimizer"))
        assert split <= row["time_step_s"] and 0 <= row["data_share"] < 1
        assert set(row["grad_norm_by_layer"]) == {"embed", "layers.0", "layers.1", "lm_head"}


def _layer_rows(out, steps=(1, 2, 3)):
    rows = {r["step"]: r for r in read_jsonl(out / "metrics.jsonl")}
    return {s: (rows[s]["grad_norm_by_layer"], rows[s]["update_ratio_by_layer"]) for s in steps}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "batch"),
    [({}, {"micro_batch_size": 1, "grad_accum_steps": 2}),  # FSDP2 over 2 data-parallel ranks
     ({"pp": 2, "pp_schedule": "1f1b"}, CLEAN["batch"]),
     ({"tp": 2}, CLEAN["batch"])],
    ids=["fsdp2", "pp2", "tp2"],
)  # fmt: skip
def test_layer_stats_at_two_ranks_match_one_process(tmp_path, train_data, clean_runs, layout,
                                                    batch):  # fmt: skip
    cfg = tiny_config(max_steps=3, **{**CLEAN, "batch": batch}, parallel=layout)
    run_trainer(cfg, train_data, tmp_path / "run", num_processes=2, timeout=240)
    expected, got = _layer_rows(clean_runs[0]), _layer_rows(tmp_path / "run")
    for step, (norms, ratios) in expected.items():
        assert set(got[step][0]) == set(norms)
        for layer, value in norms.items():
            assert math.isclose(got[step][0][layer], value, rel_tol=1e-4), (step, layer)
            assert math.isclose(got[step][1][layer], ratios[layer], rel_tol=1e-3), (step, layer)
