"""Hyperparameter sweep: Optuna (TPE + ASHA/Hyperband pruning) over cached pretraining trials.

Each trial is a chain of pretrain segments (``tasks/scaling/trial.py``), each a cached step of
the store: a repeated sweep, or one resumed after a crash, finds the segments it already trained.
After each segment the trial reports its validation loss to Optuna and the pruner decides whether
the next segment starts. The study lives in a real database (SQLite under the root by default, or
any SQLAlchemy URL such as ``postgresql://``); trials heartbeat into it, so after a ``kill -9`` a
new sweep fails the stale trials and re-runs them with the same parameters (their finished
segments come back cached), then finishes the study.

Concurrency: up to ``space.concurrency`` trials run at once (Prefect tasks on a thread pool), and
each segment holds a slot of the ``gpu`` global concurrency limit while it trains (where one
exists), so sweeps share GPUs with every other flow.

The flow ends with the best config (``best.yaml``), a table of trials and Optuna's plots
(history, parameter importance, parallel coordinates) as PNG files under the sweep folder, all
published as Prefect artifacts.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import re
import threading
import warnings
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from llmflow.flows.recipe import recipe
from llmflow.tasks.config import PipelineConfig, dump_config
from llmflow.tasks.framework.executor import PrefectExecutor
from llmflow.tasks.framework.store import Store
from llmflow.tasks.pretrain.step import pretrain
from llmflow.tasks.scaling.space import SweepSpace, check_space, with_params
from llmflow.tasks.scaling.trial import TrialOutcome, run_trial, segment_runs, trial_train_config

log = logging.getLogger("llmflow.sweep")
# NOTE: heartbeats are documented with Study.optimize; the ask/tell loop here records them itself.
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
warnings.filterwarnings(
    "ignore", message=r".*experimental", module=r"(optuna|llmflow\.flows\.sweep)"
)

SEGMENT = dataclasses.replace(pretrain, retries=0)
"""The pretrain step without retries: a sweep records a crashed trial and moves on."""


class SweepFailed(RuntimeError):
    """More trials failed than the space allows; the trials table says why each failed."""


@dataclasses.dataclass
class SweepResult:
    """The best trial, every trial's row, and where the plots and best config were written."""

    best_params: dict[str, Any]
    best_value: float
    rows: list[dict[str, Any]]
    folder: str
    tokens: int


def sweep_folder(config: PipelineConfig, space: SweepSpace) -> Path:
    """Where a study's database, best config and plots are written: ``{root}/sweeps/{study}``
    for a local root; for a remote root (which needs ``storage:``) a local folder under the
    cache, which ``publish`` uploads to ``sweep_uri``."""
    store = Store(config.root)
    if store.is_local:
        return Path(store.root) / "sweeps" / space.study
    if not space.storage:
        raise ValueError(
            f"root={config.root!r} is remote: a sweep keeps its Optuna study next to a local "
            "root, so give the space a database URL (storage: sqlite:///... or postgresql://...)"
        )
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", store.root)
    return store.cache_dir / "sweeps" / slug / space.study


def sweep_uri(config: PipelineConfig, space: SweepSpace) -> str:
    """Where the published best config, trials and plots live, under the recipe's root."""
    return f"{Store(config.root).root}/sweeps/{space.study}"


def storage_url(config: PipelineConfig, space: SweepSpace) -> str:
    if space.storage:
        return space.storage
    folder = sweep_folder(config, space)
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'study.db'}"


def _storage(config: PipelineConfig, space: SweepSpace):
    """The study's RDB storage, with heartbeats that re-queue stale trials (3 retries)."""
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    url = storage_url(config, space)
    # NOTE: the driver, each trial and its heartbeat write to one SQLite file; wait for the
    # lock (60 s) rather than fail on a busy machine.
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
    return RDBStorage(
        url,
        engine_kwargs=engine,
        heartbeat_interval=heartbeat_s(space),
        grace_period=space.grace_s,
        heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=3),
    )


def open_study(config: PipelineConfig, space: SweepSpace):
    """Create or load the study; stale RUNNING trials (a killed driver) are re-queued."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(
        study_name=space.study,
        storage=_storage(config, space),
        sampler=space.sampler.build(space.params),
        pruner=space.pruner.build(space.segments),
        direction="minimize",
        load_if_exists=True,
    )


def sweep_inputs(config: PipelineConfig) -> tuple[str, str]:
    """The trials' data (the first curriculum stage's mixture) and held-out set, run or cached."""
    graph = recipe(config)
    data, held_out = graph.find(step="mixture")[0], graph.find(step="validation")[0]
    outcome = PrefectExecutor(config.root, runner=config.runner).run(
        graph.closure([data, held_out])
    )
    return outcome[data].uri, outcome[held_out].uri


def heartbeat_s(space: SweepSpace) -> int:
    """Seconds between a running trial's heartbeats: a third of the grace period."""
    return max(1, space.grace_s // 3)


def _heartbeat(study, trial_id: int, stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        study._storage.record_heartbeat(trial_id)


@task(
    name="sweep-trial",
    task_run_name="trial-{number}",
    retries=0,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def trial_task(
    config: PipelineConfig,
    space: SweepSpace,
    number: int,
    trial_id: int,
    params: dict[str, Any],
    data: str,
    validation: str,
) -> TrialOutcome:
    """Train one trial segment by segment, reporting each validation loss to Optuna."""
    import optuna

    study = open_study(config, space)
    trial = optuna.Trial(study, trial_id)
    stop = threading.Event()
    study._storage.record_heartbeat(trial_id)
    beat = threading.Thread(
        target=_heartbeat, args=(study, trial_id, stop, heartbeat_s(space)), daemon=True
    )
    beat.start()
    executor = PrefectExecutor(config.root, runner=config.runner)
    name = f"{config.name}-sweep"

    def train_segment(run, previous):
        inputs = {"data": data, "validation": validation, "init": previous}
        return executor.call(SEGMENT, run, name, {k: v for k, v in inputs.items() if v})

    def report(k: int, value: float) -> bool:
        if not math.isfinite(value):
            raise FloatingPointError(f"validation loss is {value} after segment {k}")
        trial.report(value, k)
        return trial.should_prune()

    try:
        runs = segment_runs(
            config, trial_train_config(config, params, space.max_steps), space.segments
        )
        return run_trial(runs, train_segment, report)
    except Exception as err:  # a crashed trial is a result of the sweep, not its end
        log.warning("trial %d failed: %s", number, err)
        return TrialOutcome("failed", error=f"{type(err).__name__}: {err}"[:2000])
    finally:
        stop.set()


def _tell(study, trial_number: int, *args, **kwargs) -> None:
    """``study.tell``; a grid sampler's "grid exhausted" stop request is not an error here.

    GridSampler calls ``study.stop()`` after the last grid point, which Optuna only allows inside
    ``optimize``; the trial's state is stored before that (``tell`` saves it in a finally), and
    the loop here ends by counting finished trials anyway.
    """
    try:
        study.tell(trial_number, *args, **kwargs)
    except RuntimeError as err:
        if "Study.stop" not in str(err):
            raise


def _finish(study, trial_number: int, outcome: TrialOutcome) -> None:
    """Record a trial's outcome in the study (``tell``), with its tokens and error."""
    import optuna

    frozen = study.trials[trial_number]
    storage = study._storage
    storage.set_trial_user_attr(frozen._trial_id, "tokens", outcome.tokens)
    storage.set_trial_user_attr(frozen._trial_id, "cached_segments", outcome.cached_segments)
    if outcome.uri:
        storage.set_trial_user_attr(frozen._trial_id, "uri", outcome.uri)
    if outcome.state == "failed":
        storage.set_trial_user_attr(frozen._trial_id, "error", outcome.error)
        _tell(study, trial_number, state=optuna.trial.TrialState.FAIL)
    elif outcome.state == "pruned":
        _tell(study, trial_number, state=optuna.trial.TrialState.PRUNED)
    else:
        _tell(study, trial_number, outcome.value)


def _tally(study) -> tuple[int, int]:
    """(finished trials, failed trials): stale-heartbeat failures are re-queued, not counted."""
    from optuna.trial import TrialState

    finished = failed = 0
    for t in study.get_trials(deepcopy=False):
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            finished += 1
        elif t.state == TrialState.FAIL and "error" in t.user_attrs:
            finished += 1
            failed += 1
    return finished, failed


def requeue_interrupted(study, space: SweepSpace) -> int:
    """Wait until trials left RUNNING by a killed sweep miss their heartbeat; re-queue them.

    Their parameters come back as WAITING trials that ``ask`` hands out first, and their
    finished segments are found in the store. Returns how many were re-queued.
    """
    import time

    from optuna.storages import fail_stale_trials
    from optuna.trial import TrialState

    def running() -> int:
        return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))

    before = running()
    deadline = time.monotonic() + space.grace_s + 2 * heartbeat_s(space)
    while running() and time.monotonic() < deadline:
        fail_stale_trials(study)
        time.sleep(0 if not running() else heartbeat_s(space))
    requeued = before - running()
    if requeued:
        log.info("re-queued %d trial(s) interrupted by a previous sweep", requeued)
    return requeued


def _wait_first(futures: list) -> list:
    """The futures that are done, waiting until at least one is."""
    while True:
        done = [f for f in futures if f.state.is_final()]
        if done:
            return done
        futures[0].wait(timeout=0.5)


def drive(config: PipelineConfig, space: SweepSpace, data: str, validation: str, study) -> None:
    """Ask, run and tell trials until the study has ``space.trials`` finished ones."""
    running: dict[Any, int] = {}
    while True:
        finished, _ = _tally(study)
        error = too_many_failures(study, space)
        if error:
            for future in running:
                future.wait()
            raise error
        while len(running) < space.concurrency and finished + len(running) < space.trials:
            trial = study.ask()
            study._storage.record_heartbeat(trial._trial_id)
            params = {path: p.suggest(trial, path) for path, p in space.params.items()}
            future = trial_task.submit(
                config, space, trial.number, trial._trial_id, params, data, validation
            )
            running[future] = trial.number
        if not running:
            return
        for future in _wait_first(list(running)):
            _finish(study, running.pop(future), future.result())


def too_many_failures(study, space: SweepSpace) -> SweepFailed | None:
    """The error to stop with once more than ``max_failure_share`` of the trials failed."""
    _, failed = _tally(study)
    if failed <= space.max_failure_share * space.trials:
        return None
    return SweepFailed(
        f"{failed} of {space.trials} trials failed (more than max_failure_share="
        f"{space.max_failure_share}); last error: {_last_error(study)}"
    )


def _last_error(study) -> str:
    errors = [t.user_attrs["error"] for t in study.trials if "error" in t.user_attrs]
    return errors[-1] if errors else "none"


def trial_rows(study) -> list[dict[str, Any]]:
    """One row per trial: number, state, parameters, last reported loss, tokens, error."""
    rows = []
    for t in study.trials:
        if t.state.name == "WAITING":
            continue
        last = t.value if t.value is not None else _last_report(t)
        rows.append(
            {
                "trial": t.number,
                "state": t.state.name.lower(),
                **{k: v for k, v in t.params.items()},
                "val_loss": None if last is None else round(last, 5),
                "segments": len(t.intermediate_values),
                "tokens": t.user_attrs.get("tokens", 0),
                "error": t.user_attrs.get("error", ""),
            }
        )
    return rows


def _last_report(t) -> float | None:
    values = t.intermediate_values
    return values[max(values)] if values else None


def save_plots(study, folder: Path) -> list[Path]:
    """Optuna's matplotlib plots as PNG: history, intermediate values (the reported validation
    losses of every trial, pruned ones included), parameter importance, parallel coordinates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as vis
    from optuna.exceptions import ExperimentalWarning

    plots = {
        "history": vis.plot_optimization_history,
        "intermediate": vis.plot_intermediate_values,  # every trial's curve, pruned ones too
        "importance": vis.plot_param_importances,
        "parallel": vis.plot_parallel_coordinate,
    }
    completed = [t for t in study.trials if t.state.name == "COMPLETE"]
    written = []
    for name, plot in plots.items():
        if name == "importance" and (len(completed) < 2 or len(study.best_params) < 1):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)
                # one complete trial gives a flat axis, which matplotlib widens with a warning
                warnings.filterwarnings(
                    "ignore", message="Attempting to set identical low and high"
                )
                ax = plot(study)
        except (ValueError, RuntimeError) as err:  # e.g. importance of a constant parameter
            log.info("plot %s skipped: %s", name, err)
            continue
        figure = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
        path = folder / f"{name}.png"
        figure.savefig(path, dpi=90, bbox_inches="tight")
        plt.close(figure)
        written.append(path)
    return written


def publish(study, space: SweepSpace, folder: Path, config: PipelineConfig) -> SweepResult:
    """Write best.yaml, trials.json and the plots; publish them as Prefect artifacts."""
    rows = trial_rows(study)
    best = study.best_trial
    folder.mkdir(parents=True, exist_ok=True)  # with a storage URL nothing else made it
    (folder / "best.yaml").write_text(dump_config(with_params(config, best.params)))
    (folder / "trials.json").write_text(json.dumps(rows, indent=1))
    key = f"sweep-{space.study}".lower().replace("_", "-").replace(".", "-")
    create_table_artifact(rows, key=key, description=f"Trials of study {space.study}")
    images = _plots_markdown(study, folder)
    best_text = "\n".join(f"- `{k}` = {v!r}" for k, v in best.params.items())
    create_markdown_artifact(
        f"## Best trial {best.number}: val_loss {best.value:.4f}\n{best_text}\n\n{images}",
        key=f"{key}-best",
        description=f"Best config and plots of study {space.study} (files under {folder})",
    )
    tokens = sum(int(t.user_attrs.get("tokens", 0)) for t in study.trials)
    where = _upload(config, space, folder)
    return SweepResult(dict(best.params), float(best.value), rows, where, tokens)


def _plots_markdown(study, folder: Path) -> str:
    """The study's plots, saved under `folder`, as Markdown sections with inline PNGs."""
    return "\n\n".join(
        f"### {p.stem}\n![{p.stem}](data:image/png;base64,"
        f"{base64.b64encode(p.read_bytes()).decode()})"
        for p in save_plots(study, folder)
    )


def _upload(config: PipelineConfig, space: SweepSpace, folder: Path) -> str:
    """Where the sweep's files are: `folder`, or beside the run's outputs on an S3 root."""
    store = Store(config.root)
    if store.is_local:
        return str(folder)
    where = sweep_uri(config, space)
    store.fs.put(f"{folder}/", f"{where}/", recursive=True)
    log.info("published the sweep's best config, trials and plots to %s", where)
    return where


@flow(name="llmflow-sweep", log_prints=True)
def sweep(
    config: PipelineConfig,
    space: SweepSpace,
    data: str | None = None,
    validation: str | None = None,
) -> SweepResult:
    """Run (or resume) the study; ``data``/``validation`` default to the recipe's stage 1."""
    space = space.for_recipe(config)  # `params: learning_rates` follows the recipe's optimizer
    check_space(config, space)  # before any trial: unknown fields and rejected values
    if data is None or validation is None:
        data, validation = sweep_inputs(config)
    study = open_study(config, space)
    requeue_interrupted(study, space)
    drive(config, space, data, validation, study)
    return publish(study, space, sweep_folder(config, space), config)


def run_sweep(
    config: PipelineConfig,
    space: SweepSpace,
    data: str | None = None,
    validation: str | None = None,
) -> SweepResult:
    """Check the space (no Prefect yet), then run the flow with ``space.concurrency`` threads
    (or, with ``backend: ray_tune``, the Ray Tune sweep of ``flows/sweep_ray.py``)."""
    space = space.for_recipe(config)
    check_space(config, space)
    if space.backend == "ray_tune":
        from llmflow.flows.sweep_ray import run_tune_sweep

        return run_tune_sweep(config, space, data, validation)
    runner = ThreadPoolTaskRunner(max_workers=space.concurrency)
    return sweep.with_options(task_runner=runner)(config, space, data, validation)
