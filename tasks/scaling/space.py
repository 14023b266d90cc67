"""A hyperparameter search space over the pipeline config, checked before any trial runs.

A space is YAML: the study's name and size, how a trial is cut into segments (the points where
it reports validation loss and may be pruned), the sampler, the pruner, and one entry per
dotted config path (the same paths ``llmflow run --set`` takes)::

    study: lr
    trials: 8
    max_steps: 120          # steps of a full trial
    segments: 4             # report (and maybe prune) every 30 steps
    params:
      pretrain.train.optimizer.lr: {type: float, low: 1.0e-4, high: 3.0e-2, log: true}
      pretrain.train.schedule.name: {type: categorical, choices: [cosine, wsd]}

Every path and every bound (or choice) is applied to the real config before the sweep starts,
so an unknown field or a value the config rejects fails naming the field, before any training.

``params: learning_rates`` searches the learning rates of the recipe's own optimizer, each on a
log range around the recipe's value (``lr_params``): AdamW has one (``optimizer.lr``); Muon has
its own for the hidden matrices (``optimizer.muon_lr``) and AdamW's for the embeddings, norms and
head (``optimizer.lr``). Muon's update has a fixed spectral norm whatever the gradient's scale,
so its useful learning rates are not AdamW's, and a search over ``optimizer.lr`` alone would move
only the AdamW groups of a Muon recipe.

``backend`` picks who schedules the trials: ``optuna`` (the default: one process drives an Optuna
study) or ``ray_tune`` (Ray Tune on a Ray cluster, ``flows/sweep_ray.py``). Neither it nor
``ray_address`` reaches a trial's config: the same parameters train the same cached segments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmflow.tasks.config import PipelineConfig, apply_overrides, format_validation_error
from llmflow.tasks.framework.errors import BadInputError, ConfigError
from llmflow.tasks.pretrain.config import TrainConfig

TUNABLE_PREFIX = "pretrain.train."
"""A trial is one pretraining run: only the trainer's fields change what it computes."""

LEARNING_RATES = "learning_rates"
"""``params: learning_rates``: the recipe optimizer's learning rates (``lr_params``)."""
LR_RANGES = {"lr": (1 / 3, 30.0), "muon_lr": (1 / 4, 4.0)}
"""Default search range of each learning rate, as factors of the recipe's own value. AdamW's
spans two decades, mostly above the value (small models train best well above a large model's
LR): [1e-3, 9e-2] around 3e-3. Muon's orthogonalised update has a fixed spectral norm, so its
useful range is narrower: [0.005, 0.08] around 0.02 (modded-nanogpt trains at 0.05)."""
MUON_ONLY = ("muon_lr", "muon_momentum", "muon_weight_decay", "muon_adjust_lr")
"""OptimizerConfig fields that only a Muon recipe reads."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Param(_Strict):
    """One dimension of the space: a float or int range (log-scaled or not) or a set of choices."""

    type: Literal["float", "int", "categorical"] = Field(description="Kind of dimension.")
    low: float | None = Field(None, description="Lower bound (float, int).")
    high: float | None = Field(None, description="Upper bound (float, int).")
    log: bool = Field(False, description="Sample on a log scale (float, int).")
    choices: list[Any] | None = Field(None, description="Values (categorical).")

    @model_validator(mode="after")
    def _complete(self) -> Param:
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("a categorical parameter needs a non-empty 'choices' list")
        elif self.low is None or self.high is None or not self.low < self.high:
            raise ValueError(
                f"a {self.type} parameter needs low < high, got {self.low}, {self.high}"
            )
        return self

    def extremes(self) -> list[Any]:
        """The values to try against the config before sampling: bounds or every choice."""
        if self.type == "categorical":
            return list(self.choices or [])
        if self.type == "int":
            return [int(self.low), int(self.high)]
        return [self.low, self.high]

    def distribution(self) -> Any:
        """This dimension as an Optuna distribution (what ``suggest`` asks for)."""
        from optuna.distributions import (
            CategoricalDistribution,
            FloatDistribution,
            IntDistribution,
        )

        if self.type == "categorical":
            return CategoricalDistribution(self.choices)
        if self.type == "int":
            return IntDistribution(int(self.low), int(self.high), log=self.log)
        return FloatDistribution(self.low, self.high, log=self.log)

    def suggest(self, trial: Any, name: str) -> Any:
        """Ask an Optuna trial for this parameter's value."""
        if self.type == "categorical":
            return trial.suggest_categorical(name, self.choices)
        if self.type == "int":
            return trial.suggest_int(name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(name, self.low, self.high, log=self.log)


class SamplerSpec(_Strict):
    """Optuna's sampler: TPE (default), random search, or the full grid of categorical choices."""

    name: Literal["tpe", "random", "grid"] = "tpe"
    seed: int = Field(0, description="Seed of the sampler.")
    n_startup_trials: int = Field(3, ge=0, description="TPE: random trials before modelling.")

    def build(self, params: dict[str, Param]) -> Any:
        import optuna

        if self.name == "grid":
            grid = {path: p.choices for path, p in params.items()}
            return optuna.samplers.GridSampler(grid, seed=self.seed)
        if self.name == "random":
            return optuna.samplers.RandomSampler(seed=self.seed)
        return optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=self.n_startup_trials)


class PrunerSpec(_Strict):
    """Optuna's pruner: asynchronous successive halving (ASHA), Hyperband, or none.

    Resources are segments: a trial reports its validation loss after segment 1, 2, ...
    """

    name: Literal["asha", "hyperband", "none"] = "asha"
    min_resource: int = Field(1, ge=1, description="Segments before the first pruning decision.")
    reduction_factor: int = Field(3, ge=2, description="Keep the best 1/this at each rung.")

    def build(self, segments: int) -> Any:
        import optuna

        if self.name == "none":
            return optuna.pruners.NopPruner()
        if self.name == "hyperband":
            return optuna.pruners.HyperbandPruner(
                min_resource=self.min_resource,
                max_resource=segments,
                reduction_factor=self.reduction_factor,
            )
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=self.min_resource, reduction_factor=self.reduction_factor
        )


class SweepSpace(_Strict):
    """The study, the trial length, the search strategy and the parameters."""

    study: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Study name (in the database).")
    trials: int = Field(8, gt=0, description="Finished trials (complete, pruned or failed).")
    concurrency: int = Field(1, ge=1, description="Trials training at once.")
    max_steps: int = Field(gt=0, description="Optimizer steps of a full (unpruned) trial.")
    segments: int = Field(4, ge=1, description="Equal segments of a trial; each reports.")
    max_failure_share: float = Field(
        0.5, ge=0, le=1, description="Stop once more than this share of `trials` has failed."
    )
    storage: str | None = Field(
        None, description="Optuna storage URL (postgresql://...); default: SQLite under the root."
    )
    grace_s: int = Field(
        30,
        ge=1,
        description="Seconds without a heartbeat after which a running trial counts as "
        "interrupted (a killed sweep); a resumed sweep re-runs it with the same parameters.",
    )
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)
    params: dict[str, Param] | Literal["learning_rates"] = Field(
        description="Dotted config path -> dimension, or `learning_rates`: the recipe "
        "optimizer's learning rates, each on a log range around the recipe's value."
    )
    backend: Literal["optuna", "ray_tune"] = Field(
        "optuna",
        description="Who schedules the trials: an Optuna study driven by this process, or Ray "
        "Tune (OptunaSearch + ASHA) on a Ray cluster. Not part of any trial's address.",
    )
    ray_address: str | None = Field(
        None,
        description="ray_tune: the cluster to join (HOST:PORT of its head, or auto); None "
        "starts a local Ray instance on 127.0.0.1 with `concurrency` CPUs.",
    )

    @model_validator(mode="after")
    def _divisible(self) -> SweepSpace:
        if self.max_steps % self.segments:
            raise ValueError(
                f"max_steps={self.max_steps} is not a multiple of segments={self.segments}"
            )
        if not self.params:
            raise ValueError("params is empty: name at least one config field to search")
        return self

    @model_validator(mode="after")
    def _grid_is_categorical(self) -> SweepSpace:
        if self.sampler.name == "grid":
            if self.params == LEARNING_RATES:
                raise ValueError(
                    "sampler grid needs categorical params; params: learning_rates gives ranges "
                    "(list the grid's learning rates as choices)"
                )
            ranges = [k for k, p in self.params.items() if p.type != "categorical"]
            if ranges:
                raise ValueError(f"sampler grid needs categorical params; {ranges} are ranges")
        return self

    @model_validator(mode="after")
    def _backend_fits(self) -> SweepSpace:
        if self.backend == "optuna":
            if self.ray_address is not None:
                raise ValueError(
                    f"ray_address={self.ray_address!r} needs backend: ray_tune (backend is optuna)"
                )
            return self
        if self.storage is not None:
            raise ValueError(
                f"storage={self.storage!r} is an Optuna database; backend ray_tune keeps its "
                "experiment under the sweep folder (remove storage)"
            )
        if self.pruner.name != "none" and self.pruner.min_resource > self.segments:
            raise ValueError(
                f"pruner.min_resource={self.pruner.min_resource} exceeds segments="
                f"{self.segments} (Ray Tune's grace period must fit in a trial)"
            )
        if self.sampler.name == "grid":
            size = 1
            for param in self.params.values():
                size *= len(param.choices or [])
            if self.trials != size:
                raise ValueError(
                    f"sampler grid with backend ray_tune runs every grid point once: "
                    f"trials={self.trials} must equal the grid's {size} points"
                )
        return self

    @property
    def segment_steps(self) -> int:
        return self.max_steps // self.segments

    def for_recipe(self, config: PipelineConfig) -> SweepSpace:
        """This space with ``params: learning_rates`` made the recipe's own (``lr_params``)."""
        if self.params != LEARNING_RATES:
            return self
        return self.model_copy(update={"params": lr_params(config)})

    @classmethod
    def load(cls, path: str | Path) -> SweepSpace:
        """Read a space from YAML; a malformed file is a ConfigError naming the field."""
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"search space file not found: {path}")
        try:
            return cls.model_validate(yaml.safe_load(path.read_text()) or {})
        except ValidationError as err:
            raise ConfigError(f"{path}: " + format_validation_error(err)) from None


def with_params(config: PipelineConfig, params: dict[str, Any]) -> PipelineConfig:
    """The config with each dotted path set; a bad path or value is a ConfigError naming it."""
    overrides = [f"{path}={_yaml_value(value)}" for path, value in params.items()]
    data = apply_overrides(config.model_dump(mode="json"), overrides)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    except (ValueError, TypeError) as err:  # a ModelConfig shape check raised directly
        raise ConfigError(f"invalid config: {err}") from None


def _yaml_value(value: Any) -> str:
    """One value as the YAML text of a ``--set`` override (so 'null', lists and floats parse)."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def learning_rates(train: TrainConfig) -> dict[str, float]:
    """The peak learning rates the recipe's optimizer reads, by ``OptimizerConfig`` field:
    AdamW's ``lr``; Muon's ``muon_lr`` (hidden matrices) and ``lr`` (the AdamW groups)."""
    optimizer = train.optimizer
    rates = {"lr": optimizer.lr}
    return {"muon_lr": optimizer.muon_lr, **rates} if optimizer.name == "muon" else rates


def lr_params(config: PipelineConfig, points: int | None = None) -> dict[str, Param]:
    """The default learning-rate search of a recipe: each of its optimizer's learning rates on a
    log range of ``LR_RANGES`` factors around the recipe's value; with ``points``, a grid of
    that many log-spaced choices each (3 significant digits)."""
    params = {}
    for field, value in learning_rates(config.pretrain.train).items():
        below, above = LR_RANGES[field]
        low, high = _round(value * below), _round(value * above)
        path = f"{TUNABLE_PREFIX}optimizer.{field}"
        if points is None:
            params[path] = Param(type="float", low=low, high=high, log=True)
        else:
            choices = [_round(x) for x in np.geomspace(low, high, points)]
            params[path] = Param(type="categorical", choices=choices)
    return params


def _round(value: float) -> float:
    return float(f"{value:.3g}")


def scaled_learning_rates(train: TrainConfig, factor: float) -> dict[str, float]:
    """``TrainConfig.replaced`` updates that multiply every learning rate of the recipe's
    optimizer by ``factor`` (Muon's and AdamW's together: their ratio is the recipe's)."""
    return {f"optimizer.{k}": v * factor for k, v in learning_rates(train).items()}


def _check_field(path: str, optimizer: str) -> None:
    """A searched field is under the trainer's config and read by the recipe's optimizer."""
    if not path.startswith(TUNABLE_PREFIX):
        raise BadInputError(
            f"search space field {path!r}: a trial is one pretraining run, so only fields "
            f"under {TUNABLE_PREFIX!r} can be searched"
        )
    field = path.removeprefix(f"{TUNABLE_PREFIX}optimizer.")
    if optimizer != "muon" and field in MUON_ONLY:
        raise BadInputError(
            f"search space field {path!r}: the recipe's optimizer is {optimizer}, which has "
            "no Muon group, so every trial would train the same model (search "
            "pretrain.train.optimizer.lr, or params: learning_rates)"
        )


def check_space(config: PipelineConfig, space: SweepSpace) -> None:
    """Fail before any trial on a path outside the trainer, an unknown field, a bad value or a
    field the recipe's optimizer never reads (Muon's on an AdamW recipe)."""
    space = space.for_recipe(config)
    optimizer = config.pretrain.train.optimizer.name
    if f"{TUNABLE_PREFIX}optimizer.name" in space.params:
        optimizer = "muon"  # the trials choose their optimizer: a Muon field may matter
    for path, param in space.params.items():
        _check_field(path, optimizer)
        for value in param.extremes():
            try:
                with_params(config, {path: value})
            except ConfigError as err:
                raise ConfigError(f"search space field {path!r} value {value!r}: {err}") from None
