"""The three-stage curriculum: per-stage mixtures and one learning-rate schedule across stages.

Stages 1..n-1 train at the stable learning rate (after warmup); the last stage anneals: WSD's
decay covers exactly its steps, down to the floor. Each stage starts from the previous stage's
final checkpoint (weights, optimizer state, step), so the schedule continues. Stage k's config
depends only on stages 1..k, so changing the last stage re-runs the last stage only.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmflow.tasks.dataprep.config import StageMixture
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.launch import LaunchSettings
from llmflow.tasks.pretrain.schedule import steps_for_tokens


class CurriculumStage(BaseModel):
    """One stage: a name and its data mixture (weights, token budget, sequence length)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Stage label, e.g. stage1.", pattern=r"^[A-Za-z0-9_-]+$")
    mixture: StageMixture = Field(description="Domain weights and token budget of this stage.")


class PretrainConfig(LaunchSettings):
    """Curriculum pretraining: a base trainer config and the stages it runs through."""

    model_config = ConfigDict(extra="forbid")

    train: TrainConfig = Field(description="Trainer settings shared by all stages.")
    stages: list[CurriculumStage] = Field(
        description="Stages in order; the last one anneals. Empty only with init (a model to "
        "post-train directly)."
    )
    anneal_schedule: str = Field("wsd", description="Schedule of the last stage (wsd decays).")

    @model_validator(mode="before")
    @classmethod
    def _parallel_shorthand(cls, data: object) -> object:
        """``pretrain.parallel`` is ``pretrain.train.parallel`` (the trainer reads it there)."""
        if isinstance(data, dict) and "parallel" in data:
            data = dict(data)
            parallel = data.pop("parallel")
            train = data.get("train") or {}
            train = dict(train) if isinstance(train, dict) else train.model_dump()
            if "parallel" in train:
                raise ValueError("set pretrain.parallel or pretrain.train.parallel, not both")
            data["train"] = {**train, "parallel": parallel}
        return data

    @field_validator("stages")
    @classmethod
    def _unique_names(cls, value: list[CurriculumStage]) -> list[CurriculumStage]:
        names = [s.name for s in value]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        return value

    @model_validator(mode="after")
    def _seq_len_fits(self) -> PretrainConfig:
        max_len = self.train.model_config_obj().max_seq_len
        for stage in self.stages:
            if stage.mixture.seq_len > max_len:
                raise ValueError(
                    f"stages.{stage.name}.mixture.seq_len={stage.mixture.seq_len} exceeds the "
                    f"model's max_seq_len={max_len}; lower seq_len or raise model max_seq_len"
                )
        return self


def stage_steps(cfg: PretrainConfig, world_size: int = 1) -> list[int]:
    """Optimizer steps of each stage, from its token budget."""
    steps, start = [], 0
    for stage in cfg.stages:
        n = steps_for_tokens(
            stage.mixture.num_tokens, cfg.train.batch, stage.mixture.seq_len, world_size, start
        )
        steps.append(n)
        start += n
    return steps


def stage_train_config(cfg: PretrainConfig, index: int) -> TrainConfig:
    """The trainer config of stage ``index``: its step budget and its part of the schedule."""
    # NOTE: the data-parallel ranks set the global batch (TP/CP/PP ranks share theirs)
    steps = stage_steps(cfg, cfg.train.parallel.resolve(cfg.world_size).dp)
    if index < len(cfg.stages) - 1:  # stable LR until the last stage
        schedule = {"name": "constant", "total_steps": None}
    elif len(cfg.stages) > 1:  # the last stage anneals: the decay covers exactly its steps
        total = sum(steps)
        schedule = {
            "name": cfg.anneal_schedule,
            "total_steps": total,
            "decay_fraction": steps[index] / total,
        }
    else:
        schedule = {}
    return cfg.train.replaced(max_steps=steps[index], num_tokens=None, schedule=schedule)
