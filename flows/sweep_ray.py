"""The sweep on Ray Tune (``backend: ray_tune``): the same trials, scheduled where a Ray cluster is.

Each Tune trial is a trial of ``flows/sweep.py``: the same chain of pretrain segments
(``segment_runs``), run through the same step (``SEGMENT``) under the same label, so a trial of a
given learning rate trains (or finds in the store) exactly the segments the Optuna backend would.
A segment runs in the Tune worker with the in-process executor (no Prefect task, no ``gpu`` slot:
Ray's resources schedule the trials; a trial asks for the trainer's GPUs when the cluster has
GPUs). After each segment the trial calls ``tune.report`` with its validation loss; Optuna's
sampler (``OptunaSearch``, seeded from ``space.sampler``) proposes the parameters and
``ASHAScheduler`` (``time_attr="segment"``) stops the weak trials at each rung (a Hyperband
pruner is ASHA with Optuna's bracket count; a grid runs every point once through Tune's
``BasicVariantGenerator``).

The experiment lives under ``{root}/sweeps/{study}/ray/{study}``. A repeated or interrupted
sweep restores it (``Tuner.restore``): finished trials are kept, unfinished ones start again and
find their finished segments in the store, failed ones stay failed. The results then go through
``publish``, as an Optuna study in memory, so ``best.yaml``, ``trials.json``, the plots and the
Prefect artifacts are the Optuna backend's.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from prefect import flow

from llmflow.tasks.framework.errors import BadInputError

try:
    import ray
    from ray import tune
    from ray.tune import Callback
    from ray.tune.stopper import Stopper
except ImportError as err:  # the optional extra
    raise BadInputError(
        "backend: ray_tune needs Ray Tune: pip install 'llmflow[ray,sweep]'"
    ) from err

from llmflow.flows.sweep import (
    SEGMENT,
    SweepFailed,
    SweepResult,
    publish,
    sweep_folder,
    sweep_inputs,
    too_many_failures,
)
from llmflow.tasks.config import PipelineConfig
from llmflow.tasks.framework.backend import RayBackend
from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.ray_cluster import RayClusterUnreachable
from llmflow.tasks.framework.store import Store
from llmflow.tasks.scaling.space import SweepSpace
from llmflow.tasks.scaling.trial import run_trial, segment_runs, trial_train_config

log = logging.getLogger("llmflow.sweep")

METRIC = "val_loss"
EXPERIMENTS = "ray"
"""The folder under the sweep folder that holds Tune's experiment (named after the study)."""


def experiment_path(config: PipelineConfig, space: SweepSpace) -> Path:
    """Tune's experiment folder: ``{root}/sweeps/{study}/ray/{study}``."""
    return sweep_folder(config, space) / EXPERIMENTS / space.study


def train_trial(
    params: dict[str, Any],
    *,
    config: PipelineConfig,
    space: SweepSpace,
    root: str,
    data: str,
    validation: str,
) -> None:
    """One Tune trial: train its segments in order, reporting each validation loss to Tune.

    The scheduler stops a trial inside ``tune.report`` (between segments); an error fails the
    trial, as a crashed trial fails in the Optuna backend.
    """
    executor = Executor(root)
    label = f"{config.name}-sweep"  # trial_task's label: the Optuna backend's segment addresses
    trained: list = []

    def train_segment(run, previous):
        inputs = {"data": data, "validation": validation, "init": previous}
        result = executor.call(SEGMENT, run, label, {k: v for k, v in inputs.items() if v})
        trained.append(result)
        return result

    def report(k: int, value: float) -> bool:
        if not math.isfinite(value):
            raise FloatingPointError(f"validation loss is {value} after segment {k}")
        tune.report(
            {
                METRIC: value,
                "segment": k,
                "uri": trained[-1].uri,
                "cached": bool(trained[-1].cached),
                "cached_segments": sum(bool(r.cached) for r in trained),
                "tokens": sum(int(r.metrics.get("tokens_seen", 0)) for r in trained),
            }
        )
        return False  # a stopped trial never returns from tune.report

    train = trial_train_config(config, params, space.max_steps)
    run_trial(segment_runs(config, train, space.segments), train_segment, report)


def connect(space: SweepSpace) -> RayBackend:
    """The run's Ray: ``space.ray_address`` joined, or a local instance on 127.0.0.1 with
    ``concurrency`` CPUs started (`backend.RayBackend`, as the data stages start theirs);
    closing it shuts down a Ray it started and leaves one it joined.

    An address that does not answer is a ``BadInputError`` naming ``ray_address``, in seconds.
    """
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    try:
        return RayBackend(space.ray_address or "local", num_cpus=space.concurrency, **quiet)
    except (RayClusterUnreachable, ConnectionError) as err:
        raise BadInputError(f"ray_address {space.ray_address!r}: {err}") from None


def trial_resources(config: PipelineConfig) -> dict[str, float]:
    """A CPU per trial, and the trainer's GPUs where the cluster has GPUs (a local launcher)."""
    launch = config.pretrain
    gpus = ray.cluster_resources().get("GPU", 0)
    wanted = launch.num_processes if gpus and launch.launcher == "local" else 0
    return {"cpu": 1, "gpu": wanted}


def search(space: SweepSpace) -> tuple[Any, dict[str, Any] | None, int]:
    """(search algorithm, param_space, num_samples): Optuna's sampler, or Tune's grid."""
    from ray.tune.search.optuna import OptunaSearch  # imports optuna

    if space.sampler.name == "grid":  # every point once (the space checked trials == points)
        grid = {path: tune.grid_search(list(p.choices or [])) for path, p in space.params.items()}
        return None, grid, 1
    searcher = OptunaSearch(
        {path: p.distribution() for path, p in space.params.items()},
        metric=METRIC,
        mode="min",
        sampler=space.sampler.build(space.params),
    )
    return searcher, None, space.trials


def scheduler(space: SweepSpace) -> Any:
    """ASHA on segments; Hyperband as ASHA with Optuna's brackets; none as FIFO."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    pruner = space.pruner
    if pruner.name == "none":
        return FIFOScheduler()
    brackets = 1
    if pruner.name == "hyperband":  # Optuna: floor(log_rf(max / min)) + 1
        ratio = space.segments / pruner.min_resource
        brackets = int(math.floor(math.log(ratio, pruner.reduction_factor) + 1e-9)) + 1
    return ASHAScheduler(
        time_attr="segment",
        metric=METRIC,
        mode="min",
        max_t=space.segments,
        grace_period=pruner.min_resource,
        reduction_factor=pruner.reduction_factor,
        brackets=brackets,
    )


class FailureLimit(Callback, Stopper):
    """Stops the experiment once more than ``max_failure_share`` of the trials failed."""

    def __init__(self, limit: float):
        self.limit = limit
        self.failed = 0

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self.failed += 1

    def __call__(self, trial_id, result) -> bool:
        return False

    def stop_all(self) -> bool:
        return self.failed > self.limit


def tuner(config: PipelineConfig, space: SweepSpace, data: str, validation: str):
    """A new Tuner for the study, or the stored experiment restored (``Tuner.restore``)."""
    trainable = tune.with_resources(
        tune.with_parameters(
            train_trial,
            config=config,
            space=space,
            root=Store(config.root).root,  # absolute: a trial's working directory is Tune's
            data=data,
            validation=validation,
        ),
        trial_resources(config),
    )
    path = experiment_path(config, space)
    if tune.Tuner.can_restore(path):
        log.info("restoring Ray Tune experiment %s", path)
        return tune.Tuner.restore(str(path), trainable, resume_unfinished=True)
    algorithm, param_space, samples = search(space)
    limit = FailureLimit(space.max_failure_share * space.trials)
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            search_alg=algorithm,
            scheduler=scheduler(space),
            num_samples=samples,
            max_concurrent_trials=space.concurrency,
        ),
        run_config=tune.RunConfig(
            storage_path=str(path.parent),
            name=space.study,
            stop=limit,
            callbacks=[limit],
            failure_config=tune.FailureConfig(max_failures=0),
            verbose=0,
        ),
    )


def _start_order(result) -> int:
    """The trial's index in Tune's experiment (its folder is ``train_trial_<id>_<index>_...``):
    the order the trials were created."""
    parts = Path(result.path).name.removeprefix(f"{train_trial.__name__}_").split("_")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 1 << 30


def as_study(grid, space: SweepSpace):
    """Tune's results as an in-memory Optuna study, one trial per Tune trial, in start order.

    A trial that reported every segment is complete; one the scheduler stopped is pruned; one
    that raised is failed, with its error.
    """
    import optuna
    from optuna.trial import TrialState, create_trial

    study = optuna.create_study(study_name=space.study, direction="minimize")
    distributions = {path: p.distribution() for path, p in space.params.items()}
    for result in sorted(grid, key=_start_order):
        frame = result.metrics_dataframe
        rows = [] if frame is None or METRIC not in frame else frame.to_dict("records")
        reports = {int(r["segment"]): float(r[METRIC]) for r in rows}
        last = rows[-1] if rows else {}
        attrs: dict[str, Any] = {
            "tokens": int(last.get("tokens", 0)),
            "cached_segments": int(last.get("cached_segments", 0)),
        }
        if last.get("uri"):
            attrs["uri"] = last["uri"]
        value, state = None, TrialState.PRUNED
        if result.error is not None:
            state = TrialState.FAIL
            attrs["error"] = f"{type(result.error).__name__}: {result.error}"[:2000]
        elif reports and max(reports) == space.segments:
            state, value = TrialState.COMPLETE, reports[space.segments]
        study.add_trial(
            create_trial(
                state=state,
                value=value,
                params={path: result.config[path] for path in space.params},
                distributions=distributions,
                intermediate_values=reports,
                user_attrs=attrs,
            )
        )
    return study


def check_failures(study, space: SweepSpace) -> None:
    """SweepFailed when more than ``max_failure_share`` failed, or no trial completed."""
    error = too_many_failures(study, space)
    if error:
        raise error
    trials = study.get_trials(deepcopy=False)
    if not any(t.state.name == "COMPLETE" for t in trials):
        raise SweepFailed(f"no trial of study {space.study} completed ({len(trials)} trials)")


@flow(name="llmflow-sweep-ray", log_prints=True)
def tune_sweep(
    config: PipelineConfig,
    space: SweepSpace,
    data: str | None = None,
    validation: str | None = None,
) -> SweepResult:
    """Run (or restore) the Tune experiment on the connected Ray cluster, then publish it."""
    if data is None or validation is None:
        data, validation = sweep_inputs(config)
    grid = tuner(config, space, data, validation).fit()
    study = as_study(grid, space)
    check_failures(study, space)
    return publish(study, space, sweep_folder(config, space), config)


def run_tune_sweep(
    config: PipelineConfig,
    space: SweepSpace,
    data: str | None = None,
    validation: str | None = None,
) -> SweepResult:
    """The sweep on Ray Tune: connect (or start a local Ray), run the flow, leave Ray as found."""
    with connect(space):
        return tune_sweep(config, space, data, validation)
