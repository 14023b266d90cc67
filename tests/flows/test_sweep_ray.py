"""The sweep on Ray Tune (``backend: ray_tune``) on a real local Ray instance on 127.0.0.1: its
trials are the Optuna backend's cached segments, ASHA stops trials by the rule, a repeat trains
nothing; and the spaces and addresses Tune cannot take fail before any trial, naming the field."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from llmflow.tasks.framework.errors import BadInputError, ConfigError
from llmflow.tasks.framework.store import Store
from llmflow.tasks.scaling.space import SweepSpace

sys.path.insert(0, str(Path(__file__).parent))
from test_sweep import packed_inputs, space, tiny_config  # noqa: E402

LR = "pretrain.train.optimizer.lr"
# A loopback-only Ray: no usage stats, and no binding of the machine's network address.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture
def local_ray(monkeypatch):
    """The environment of a loopback-only Ray; Ray is shut down after the test, whatever happens."""
    for key, value in RAY_ENV.items():
        monkeypatch.setenv(key, value)
    try:
        yield
    finally:
        import ray

        ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"sampler": {"name": "grid"}, "trials": 3}, r"trials=3 must equal the grid's 2 points"),
        ({"storage": "sqlite:////tmp/x.db"}, r"storage='sqlite:////tmp/x.db'"),
        ({"pruner": {"name": "asha", "min_resource": 3}}, r"pruner\.min_resource=3"),
        ({"backend": "optuna", "ray_address": "127.0.0.1:6379"}, r"ray_address='127\.0\.0\.1"),
    ],
)
def test_space_tune_cannot_take_fails_naming_the_field(tmp_path, changes, field):
    grid = {LR: {"type": "categorical", "choices": [1e-3, 1e-2]}}
    base = {"backend": "ray_tune", "params": grid} if "sampler" in changes else {}
    with pytest.raises(ValidationError, match=field):
        space(**{"backend": "ray_tune", **base, **changes})
    path = tmp_path / "space.yaml"  # the same from a file: a ConfigError naming it
    path.write_text(
        yaml.safe_dump({**space().model_dump(), **base, "backend": "ray_tune", **changes})
    )
    with pytest.raises(ConfigError, match=field):
        SweepSpace.load(path)


def test_unreachable_ray_address_fails_before_any_trial_naming_it(tmp_path):
    from llmflow.flows.sweep import run_sweep

    address = f"127.0.0.1:{free_port()}"
    bad = space(backend="ray_tune", ray_address=address)
    with pytest.raises(BadInputError, match=rf"ray_address '{address}'.*no Ray cluster answers"):
        run_sweep(tiny_config(tmp_path), bad, "unused", "unused")
    assert not (tmp_path / "sweeps").exists()  # no experiment, no trial
    import ray

    assert not ray.is_initialized()


def test_pruners_and_grid_map_onto_tune():
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search.optuna import OptunaSearch

    from llmflow.flows.sweep_ray import scheduler, search

    asha = scheduler(space(backend="ray_tune", segments=4))
    assert isinstance(asha, ASHAScheduler)
    assert (asha._max_t, len(asha._brackets), asha._reduction_factor) == (4, 1, 2)
    assert [milestone for milestone, _ in asha._brackets[0]._rungs] == [4, 2, 1]
    # Optuna's Hyperband on 9 segments, min 1, factor 3: floor(log3(9)) + 1 = 3 brackets
    hyper = {"name": "hyperband", "min_resource": 1, "reduction_factor": 3}
    band = scheduler(space(backend="ray_tune", max_steps=18, segments=9, pruner=hyper))
    assert len(band._brackets) == 3
    assert isinstance(scheduler(space(backend="ray_tune", pruner={"name": "none"})), FIFOScheduler)
    searcher, param_space, samples = search(space(backend="ray_tune", trials=5))
    assert isinstance(searcher, OptunaSearch) and param_space is None and samples == 5
    choices = {"type": "categorical", "choices": [1e-3, 1e-2, 3e-2]}
    spec = space(backend="ray_tune", trials=3, sampler={"name": "grid"}, params={LR: choices})
    searcher, param_space, samples = search(spec)
    assert searcher is None and param_space == {LR: {"grid_search": [1e-3, 1e-2, 3e-2]}}
    assert samples == 1


def test_example_space_is_the_optuna_lr_search_on_tune():
    folder = Path(__file__).parents[2] / "configs" / "sweeps"
    ray_space, optuna_space = (SweepSpace.load(folder / n) for n in ("lr_ray.yaml", "lr.yaml"))
    assert (ray_space.backend, ray_space.ray_address) == ("ray_tune", None)
    same = ("params", "sampler", "pruner", "max_steps", "segments", "trials")
    assert {k: getattr(ray_space, k) for k in same} == {k: getattr(optuna_space, k) for k in same}


# --------------------------------------------------------------------------------- on Ray
def tune_reports(config, spec) -> list[list[dict]]:
    """Each Tune trial's reports (result.json lines), in the order the trials started."""
    from llmflow.flows.sweep_ray import experiment_path

    folders = sorted(
        (p for p in experiment_path(config, spec).iterdir() if (p / "result.json").exists()),
        key=lambda p: int(p.name.split("_")[3]),  # train_trial_<id>_<index>_...
    )
    return [
        [json.loads(line) for line in (p / "result.json").read_text().splitlines()] for p in folders
    ]


def asha_stops(first_losses: list[float], factor: int) -> list[bool]:
    """ASHA's rule at the first rung, trials one at a time: stop a trial whose loss is worse
    than the (1 - 1/factor) quantile of the rewards recorded before it."""
    stops = []
    for i, loss in enumerate(first_losses):
        earlier = [-x for x in first_losses[:i]]
        stops.append(bool(earlier) and -loss < np.nanpercentile(earlier, (1 - 1 / factor) * 100))
    return stops


def segment_dirs(root: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in (root / "pretrain").glob("*-sweep-*")}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tune_sweep_trains_the_optuna_segments_and_a_repeat_trains_nothing(
    prefect_harness, tmp_path, local_ray
):
    import optuna

    from llmflow.flows.sweep import SEGMENT, run_sweep, storage_url
    from llmflow.tasks.scaling.trial import segment_runs, trial_train_config

    data, val = packed_inputs(tmp_path)
    cfg = tiny_config(tmp_path)
    # ASHA, factor 2, 2 segments; with seed 4 TPE's random start samples a high LR then a low
    # one (lower LRs train worse here), so ASHA has a trial to stop
    seed4 = {"name": "tpe", "seed": 4, "n_startup_trials": 2}
    spec = space(study="tune", trials=3, backend="ray_tune", sampler=seed4)
    first = run_sweep(cfg, spec, data, val)

    reports = tune_reports(cfg, spec)
    assert len(first.rows) == len(reports) == 3
    store = Store(str(tmp_path))
    for row, trial in zip(first.rows, reports, strict=True):
        lr = row[LR]
        assert [r["segment"] for r in trial] == list(range(1, len(trial) + 1))
        assert row["val_loss"] == round(trial[-1]["val_loss"], 5)
        # the segments are the Optuna backend's (same step, label and inputs), and each
        # reported loss is the validation loss stored with that segment
        runs = segment_runs(cfg, trial_train_config(cfg, {LR: lr}, spec.max_steps), 2)
        previous = None
        for report, run in zip(trial, runs, strict=False):
            inputs = {"data": data, "validation": val, **({"init": previous} if previous else {})}
            uri = SEGMENT.address(store, run, f"{cfg.name}-sweep", inputs)[0]
            assert report["uri"] == uri
            assert report["val_loss"] == store.read_lineage(uri)["metrics"]["val_loss"]
            previous = uri

    # ASHA (grace 1, factor 2) stopped exactly the trials its rule stops, at segment 1
    stops = asha_stops([trial[0]["val_loss"] for trial in reports], factor=2)
    assert [r["state"] for r in first.rows] == ["pruned" if s else "complete" for s in stops]
    assert [r["segments"] for r in first.rows] == [1 if s else 2 for s in stops]
    assert any(stops), "the seed gave no trial for ASHA to stop: the test proves too little"
    complete = [r["val_loss"] for r in first.rows if r["state"] == "complete"]
    assert first.best_value == pytest.approx(min(complete), abs=1e-5)
    best = yaml.safe_load((Path(first.folder) / "best.yaml").read_text())
    assert best["pretrain"]["train"]["optimizer"]["lr"] == first.best_params[LR]
    assert json.loads((Path(first.folder) / "trials.json").read_text()) == first.rows

    # A repeat restores the finished experiment: nothing trains, the same results
    trained = segment_dirs(tmp_path)
    assert len(trained) == sum(len(t) for t in reports)
    again = run_sweep(cfg, spec, data, val)
    assert again.rows == first.rows and again.best_value == first.best_value
    assert segment_dirs(tmp_path) == trained

    # A new study with the same seed samples the same rates and finds every segment stored
    twin = run_sweep(
        cfg, space(study="tune-b", trials=3, backend="ray_tune", sampler=seed4), data, val
    )
    assert [r[LR] for r in twin.rows] == [r[LR] for r in first.rows]
    twin_reports = tune_reports(
        cfg, space(study="tune-b", trials=3, backend="ray_tune", sampler=seed4)
    )
    assert all(r["cached"] for trial in twin_reports for r in trial)
    assert segment_dirs(tmp_path) == trained

    # The Optuna backend's first trial (same sampler seed) is Tune's first: both segments cached
    optuna_run = run_sweep(cfg, space(study="optuna-twin", trials=1, sampler=seed4), data, val)
    assert optuna_run.rows[0][LR] == first.rows[0][LR]
    study = optuna.load_study(
        study_name="optuna-twin", storage=storage_url(cfg, space(study="optuna-twin"))
    )
    assert study.trials[0].user_attrs["cached_segments"] == 2
    assert segment_dirs(tmp_path) == trained
