"""A sweep trial as a chain of cached pretraining segments (Prefect-free).

A trial of ``max_steps`` is cut into ``segments`` equal pretrain steps, each initialised from the
previous one's final checkpoint (weights, optimizer state and step, so the learning-rate schedule,
defined over the whole trial, continues). After each segment the trial reports the segment's
validation loss; a pruned trial simply does not start the next segment, so nothing has to be
killed. Each segment is content-addressed by its own config and its predecessor's hash only: a
repeated or resumed sweep finds every segment it already trained, whatever was pruned after it.

Segment ``k`` draws its batches with seed ``seed + k`` (a fresh permutation of the data): a new
stage's loader starts at the beginning of its data, and without the shift each segment would
repeat the first segment's batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmflow.tasks.config import PipelineConfig
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.step import StageRun
from llmflow.tasks.scaling.space import with_params


@dataclass
class TrialOutcome:
    """How a trial ended: complete, pruned or failed, with what it reported and trained."""

    state: str
    value: float | None = None
    reports: list[float] = field(default_factory=list)
    tokens: int = 0
    steps: int = 0
    cached_segments: int = 0
    uri: str | None = None
    error: str | None = None


def trial_train_config(
    config: PipelineConfig, params: dict[str, Any], max_steps: int
) -> TrainConfig:
    """The trainer config of a whole trial: the recipe's trainer with ``params`` applied."""
    train = with_params(config, params).pretrain.train
    return train.replaced(
        max_steps=max_steps,
        num_tokens=None,
        schedule={"total_steps": max_steps, "per_stage": False},
    )


def segment_runs(config: PipelineConfig, train: TrainConfig, segments: int) -> list[StageRun]:
    """The pretrain configs of a trial's segments, in order."""
    total = train.max_steps
    steps = total // segments
    runs = []
    for k in range(segments):
        seg = train.replaced(
            max_steps=steps,
            seed=train.seed + k,
            checkpoint={"interval": total, "keep_last": 1},
            eval_interval=steps,
            log_interval=min(train.log_interval, steps),
        )
        runs.append(StageRun(train=seg, **config.pretrain.launch_settings()))
    return runs


def run_trial(
    runs: list[StageRun],
    train_segment: Callable[[StageRun, str | None], Any],
    report: Callable[[int, float], bool],
) -> TrialOutcome:
    """Train the segments in order; after each, ``report(k, val_loss)`` says whether to prune.

    Args:
        runs: The segments' configs (``segment_runs``).
        train_segment: Trains one segment from the previous segment's URI (None first); returns
            the step's ``StepResult``.
        report: Called with the segment number (1-based) and its validation loss after every
            segment; True prunes (after the last segment the trial is complete anyway).
    """
    outcome = TrialOutcome("complete")
    previous = None
    for k, run in enumerate(runs, start=1):
        result = train_segment(run, previous)
        previous = outcome.uri = result.uri
        outcome.cached_segments += bool(result.cached)
        outcome.tokens += int(result.metrics.get("tokens_seen", 0))
        outcome.steps += run.train.max_steps
        value = float(result.metrics["val_loss"])
        outcome.reports.append(value)
        outcome.value = value
        if report(k, value) and k < len(runs):
            outcome.state = "pruned"
            break
    return outcome
