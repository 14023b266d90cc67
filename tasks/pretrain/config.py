"""Typed configuration of the pretraining step.

One pydantic model, :class:`TrainConfig`, with nested sections. Every check that can fail runs in
a validator, so a bad value is rejected before any compute, naming the field and the value.
Fields marked ``json_schema_extra=UNVERSIONED`` are execution-only: they do not change the
output's content hash (log intervals, progress bars, ...).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_serializer,
    field_validator,
    model_validator,
)

from llmflow.model.config import ModelConfig, preset
from llmflow.tasks.framework.errors import ConfigError
from llmflow.tasks.framework.hashing import OMIT_DEFAULT, UNVERSIONED, versioned_fields  # noqa: F401  (versioned_fields re-exported: the store's hash view)
from llmflow.tasks.pretrain.parallel.config import ParallelConfig

if TYPE_CHECKING:
    import torch


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _model_overrides() -> type[BaseModel]:
    """A pydantic model with every ``ModelConfig`` field, optional (None: the preset's value)."""
    hints = typing.get_type_hints(ModelConfig)
    fields = {
        # NOTE: a field ModelConfig marks as added stays out of the hash while unset.
        f.name: (hints[f.name] | None, Field(None, json_schema_extra=dict(f.metadata) or None))
        for f in dataclasses.fields(ModelConfig)
    }
    return create_model(
        "ModelOverrides",
        __base__=_Section,
        __doc__="ModelConfig fields to replace in the preset (unset ones keep the preset's).",
        **fields,
    )


ModelOverrides = _model_overrides()


class ModelSpec(_Section):
    """Which architecture to train: a preset from ``model.config`` plus field overrides."""

    preset: str = Field("debug", description="Preset name from model.config.preset.")
    overrides: ModelOverrides = Field(
        default_factory=ModelOverrides,
        description="ModelConfig fields to replace, e.g. {'num_layers': 4}.",
    )

    @field_serializer("overrides")
    def _only_set(self, overrides: BaseModel) -> dict[str, Any]:
        return overrides.model_dump(exclude_none=True)

    def build(self) -> ModelConfig:
        """Return the resolved ``model.config.ModelConfig``."""
        return preset(self.preset, **self.overrides.model_dump(exclude_none=True))

    @model_validator(mode="after")
    def _check_buildable(self) -> ModelSpec:
        self.build()  # ModelConfig checks the shape (heads divide the width, ...)
        return self


class OptimizerConfig(_Section):
    """AdamW everywhere, or Muon on 2-D hidden matrices with AdamW for the rest."""

    name: Literal["adamw", "muon"] = Field("adamw", description="Optimizer family.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate of the AdamW groups.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(
        0.1, ge=0, description="AdamW decoupled weight decay (never on embeddings/norms/biases)."
    )
    muon_lr: float = Field(0.02, gt=0, description="Peak learning rate of the Muon group.")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon momentum.")
    muon_weight_decay: float = Field(0.0, ge=0, description="Muon weight decay.")
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = Field(
        "original", description="torch.optim.Muon adjust_lr_fn."
    )
    grad_clip: float = Field(1.0, ge=0, description="Max global grad norm; 0 disables clipping.")
    fused: bool = Field(
        False,
        description="Use the fused AdamW kernel (faster; not bitwise equal to the default).",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"optimizer.betas must lie in [0, 1), got {value}")
        return value


class ScheduleConfig(_Section):
    """Learning-rate schedule, defined over the TOTAL run (all curriculum stages).

    A stage trains the step range [start, start + max_steps), where start is the step of the
    checkpoint it was initialised from; the multiplier at a global step only depends on that
    step, so stage k continues exactly where stage k-1 stopped.
    """

    name: Literal["constant", "cosine", "wsd", "multistep", "linear"] = Field(
        "cosine", description="Schedule shape after warmup."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps from 0.")
    total_steps: int | None = Field(
        None, gt=0, description="Steps of the whole run; None means this stage's last step."
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="Floor as a fraction of peak (cosine, wsd, linear)."
    )
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="WSD: share of total_steps spent decaying at the end."
    )
    decay_shape: Literal["linear", "cosine", "sqrt"] = Field(
        "linear", description="WSD: shape of the final decay ('sqrt' is 1-sqrt)."
    )
    milestones: list[float] = Field(
        default_factory=lambda: [0.8, 0.9],
        description="multistep: fractions of total_steps where the LR is multiplied by gamma.",
    )
    gamma: float = Field(0.316, gt=0, le=1, description="multistep: factor at each milestone.")
    per_stage: bool = Field(
        False,
        description="Restart the schedule at this stage's first step, over this stage's steps "
        "(context extension: each length has its own warmup and decay).",
    )

    @field_validator("milestones")
    @classmethod
    def _milestones_sorted(cls, value: list[float]) -> list[float]:
        if any(not 0 < m < 1 for m in value) or value != sorted(value):
            raise ValueError(f"schedule.milestones must be increasing in (0, 1), got {value}")
        return value


class BatchConfig(_Section):
    """Per-process micro-batch, gradient accumulation and batch-size warmup."""

    micro_batch_size: int = Field(8, gt=0, description="Sequences per process per micro-step.")
    grad_accum_steps: int = Field(1, gt=0, description="Micro-steps per optimizer step.")
    warmup_start_micro_batch: int | None = Field(
        None, gt=0, description="Batch-size warmup: micro-batch at step 0 (None: no warmup)."
    )
    warmup_steps: int = Field(0, ge=0, description="Batch-size warmup: steps to reach full size.")

    @model_validator(mode="after")
    def _warmup_consistent(self) -> BatchConfig:
        start = self.warmup_start_micro_batch
        if start is not None and start > self.micro_batch_size:
            raise ValueError(
                f"batch.warmup_start_micro_batch={start} exceeds "
                f"batch.micro_batch_size={self.micro_batch_size}"
            )
        return self


class CheckpointConfig(_Section):
    """When to write checkpoints and how many to keep."""

    interval: int = Field(100, gt=0, description="Save every this many optimizer steps.")
    keep_last: int = Field(2, gt=0, description="Keep this many step checkpoints (plus final).")
    async_save: bool = Field(
        False,
        description="Write step checkpoints in the background (DCP async_save) while training "
        "goes on; a checkpoint is marked complete only once written.",
        json_schema_extra=UNVERSIONED,
    )
    preempt_grace_s: float = Field(
        30.0,
        gt=0,
        description="On SIGTERM (a preemption, as Kubernetes and Slurm send it) the trainer "
        "finishes its step, saves a checkpoint and exits with code 75 within this many seconds "
        "(Kubernetes' default terminationGracePeriodSeconds is 30); past it, it exits at once "
        "and the retry resumes from the previous checkpoint.",
        json_schema_extra=UNVERSIONED,
    )


class GuardConfig(_Section):
    """Stability guards: NaN/Inf and loss-spike detection, and what to do about them."""

    enabled: bool = Field(True, description="Turn the guards on.")
    policy: Literal["skip", "rewind", "stop"] = Field(
        "skip",
        description="skip the batch, rewind to the last checkpoint with a lower LR, or stop.",
    )
    window: int = Field(50, ge=2, description="Moving window of accepted losses for the z-score.")
    min_history: int = Field(10, ge=2, description="Losses needed before spikes are detected.")
    zscore: float = Field(6.0, gt=0, description="A loss this many std above the mean is a spike.")
    rewind_lr_factor: float = Field(
        0.5, gt=0, le=1, description="LR multiplier applied at each rewind (compounds)."
    )
    max_events: int = Field(
        20, gt=0, description="Abort the run after this many guard events (a diverged run)."
    )


class MonitorConfig(_Section):
    """Health metrics and the detectors that alert on them (execution only: no output moves).

    The defaults stay quiet on a healthy run: an alert needs a large, sustained change.
    """

    layer_stats_every: int = Field(
        50,
        ge=0,
        description="Per-layer gradient norms and update/weight ratios every this many steps "
        "(0: never).",
    )
    throughput_drop: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="Alert when tokens/s falls below (1 - this) x the median of the recent log "
        "rows.",
    )
    throughput_window: int = Field(
        20, ge=3, description="Log rows whose median tokens/s is the reference."
    )
    throughput_min_rows: int = Field(
        5, ge=2, description="Rows the window needs before a drop can alert."
    )
    throughput_sustain: int = Field(
        3, ge=1, description="Consecutive low rows that make a drop (one slow row is noise)."
    )
    warmup_rows: int = Field(
        2, ge=0, description="Log rows ignored after the start, a resume or a rewind."
    )
    stall_s: float = Field(
        300.0, gt=0, description="A batch waited for longer than this many seconds is a stall."
    )
    spike_top_layers: int = Field(
        3, ge=1, description="Layers a spike or NaN event names (largest gradient-norm jump)."
    )
    spike_history: int = Field(
        8, ge=1, description="Per-layer gradient norms kept for the median a jump is measured by."
    )

    @model_validator(mode="after")
    def _window_holds_min_rows(self) -> MonitorConfig:
        if self.throughput_min_rows > self.throughput_window:
            raise ValueError(
                f"monitor.throughput_min_rows={self.throughput_min_rows} exceeds "
                f"monitor.throughput_window={self.throughput_window}"
            )
        return self


class TrackerConfig(_Section):
    """Where metrics go besides metrics.jsonl."""

    tensorboard: bool = Field(True, description="TensorBoard files under out_dir/tb.")
    others: list[Literal["wandb", "mlflow"]] = Field(
        default_factory=list, description="Experiment trackers to log to as well."
    )
    project: str = Field("llmflow", description="Project / experiment name for trackers.")
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow server, e.g. http://127.0.0.1:5000 (None: MLFLOW_TRACKING_URI, else "
        "a file store in the run folder).",
    )
    wandb_mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="W&B mode; offline writes a run folder for `wandb sync`."
    )


class TrainConfig(_Section):
    """Everything the pretraining step needs besides its data and output folders."""

    model: ModelSpec = Field(default_factory=ModelSpec, description="Architecture.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="LR schedule.")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="Batch sizes.")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps in this stage.")
    num_tokens: int | None = Field(
        None, gt=0, description="Tokens to train on in this stage (alternative to max_steps)."
    )
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Saving.")
    guard: GuardConfig = Field(default_factory=GuardConfig, description="Stability guards.")
    seed: int = Field(0, description="Seed of the initialisation and data order.")
    z_loss: float = Field(0.0, ge=0, description="z-loss weight (PaLM); 0 disables.")
    compile: bool = Field(False, description="torch.compile each transformer block.")
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="Recompute blocks in the backward pass: none, every block (full), or every "
        "k-th block (selective). Same losses; less activation memory, more compute.",
        json_schema_extra=UNVERSIONED,
    )
    activation_checkpointing_every_k: int = Field(
        2,
        gt=0,
        description="selective: checkpoint blocks k, 2k, 3k, ... (1-based).",
        json_schema_extra=UNVERSIONED,
    )
    deterministic: bool = Field(
        True,
        description="torch.use_deterministic_algorithms on CPU (bitwise-exact resume).",
        json_schema_extra=UNVERSIONED,
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="Compute precision: bf16 keeps float32 master weights and optimizer state "
        "and computes in bf16 (autocast in one process, FSDP2's bf16 parameters with float32 "
        "gradient reduction when sharded); auto is bf16 on CUDA and fp32 on CPU.",
        json_schema_extra=OMIT_DEFAULT,
    )
    parallel: ParallelConfig = Field(
        ParallelConfig(),
        description="Parallel layout: dp_replicate x dp_shard x tp x cp x pp = world size "
        "(dp_shard -1 takes the rest). The whole mesh enters the hash (left out at the default, "
        "plain FSDP2, so those addresses are unchanged).",
        json_schema_extra=OMIT_DEFAULT,
    )
    eval_batches: int = Field(4, gt=0, description="Validation batches per evaluation.")
    continue_data: bool = Field(
        False,
        description="With an init checkpoint on the same packed data, continue its data position "
        "instead of starting the data over (a branch trains on tokens its trunk has not seen).",
        json_schema_extra=OMIT_DEFAULT,
    )
    log_interval: int = Field(
        10, gt=0, description="Steps between metric logs.", json_schema_extra=UNVERSIONED
    )
    eval_interval: int = Field(
        100, gt=0, description="Steps between validations.", json_schema_extra=UNVERSIONED
    )
    progress_bar: bool = Field(
        True, description="tqdm bar on rank 0 when stderr is a TTY.", json_schema_extra=UNVERSIONED
    )
    tracker: TrackerConfig = Field(
        default_factory=TrackerConfig, description="Trackers.", json_schema_extra=UNVERSIONED
    )
    monitor: MonitorConfig = Field(
        default_factory=MonitorConfig,
        description="Health metrics and detectors (alerts).",
        json_schema_extra=UNVERSIONED,
    )

    def compute_dtype(self, device_type: str) -> torch.dtype:
        """The dtype matrix multiplies run in on ``device_type`` (``auto``: bf16 on CUDA only)."""
        import torch

        bf16 = self.precision == "bf16" or (self.precision == "auto" and device_type == "cuda")
        return torch.bfloat16 if bf16 else torch.float32

    @model_validator(mode="after")
    def _length_given(self) -> TrainConfig:
        if (self.max_steps is None) == (self.num_tokens is None):
            raise ValueError("set exactly one of max_steps and num_tokens")
        total = self.schedule.total_steps
        if total is not None and self.max_steps is not None and self.schedule.warmup_steps > total:
            raise ValueError(
                f"schedule.warmup_steps={self.schedule.warmup_steps} exceeds "
                f"schedule.total_steps={total}"
            )
        return self

    def model_config_obj(self) -> ModelConfig:
        """Return the resolved ModelConfig."""
        return self.model.build()

    def replaced(self, **updates: Any) -> TrainConfig:
        """A copy with ``updates`` applied and validated once: the one way to derive a config.

        Keys are field names or dotted paths; a dict merges into the section it names::

            train.replaced(max_steps=None, num_tokens=8192, **{"optimizer.lr": 1e-3})
            train.replaced(schedule={"name": "cosine"}, model={"overrides": {"max_seq_len": 512}})

        Raises:
            ConfigError: the result is not a valid config (names the field and value).
        """
        data = self.model_dump()
        for key, value in updates.items():
            _merge(data, key.split("."), value)
        try:
            return TrainConfig.model_validate(data)
        except ValidationError as err:
            raise ConfigError(f"invalid trainer config: {err}") from None

    def save(self, path: Path) -> None:
        """Write the config as JSON."""
        Path(path).write_text(json.dumps(self.model_dump(mode="json"), indent=2))

    @classmethod
    def load(cls, path: Path) -> TrainConfig:
        """Read a config from a JSON or YAML file."""
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            import yaml

            return cls.model_validate(yaml.safe_load(text))
        return cls.model_validate_json(text)


def _merge(data: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``path`` in nested ``data``; a dict value merges into an existing section."""
    if isinstance(value, BaseModel):
        value = value.model_dump()
    node = data
    for key in path[:-1]:
        node = node.setdefault(key, {})
    current = node.get(path[-1])
    if isinstance(value, dict) and isinstance(current, dict):
        for key, sub in value.items():
            _merge(current, [key], sub)
    else:
        node[path[-1]] = value
