"""The decontaminate step's config: how n-grams are taken, what happens to a contaminated
document, and which evaluation sets are indexed (copied from the evaluate config by
``decontam_config``, so changing an evaluation setting that does not change the eval sets, such
as the dtype or the batch size, re-runs nothing upstream of training)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmflow.tasks.evaluation.config import EvalConfig


class DecontamSettings(BaseModel):
    """What a user sets: the n-gram method and the action (the ``decontaminate`` section)."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(13, ge=4, le=64, description="Words per n-gram (datatrove/GPT-3 style: 13).")
    mode: Literal["remove", "flag"] = Field(
        "remove",
        description="remove: contaminated documents leave the corpus; flag: they stay, recorded.",
    )
    query_ngrams: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "Also match n-grams of the question alone: true always, false never (datatrove's "
            "default), auto for an item whose gold answer is shorter than n words."
        ),
    )
    min_item_words: int = Field(
        8,
        ge=1,
        description=(
            "An item shorter than n words, but of at least this many, is matched as its whole "
            "normalized question + answer; a shorter one cannot be checked and is reported."
        ),
    )
    overlap_ngrams: bool = Field(
        True, description="Match n-grams that span the end of the question and the answer."
    )
    custom_tasks: list[str] = Field(
        default_factory=list,
        description=(
            "Paths of custom lm-eval task YAMLs (files or folders) whose eval sets are also "
            "indexed; their content is hashed."
        ),
    )


class DecontamConfig(DecontamSettings):
    """The step's config: the settings plus the eval sets' identity (from ``EvalConfig``)."""

    tasks: list[str] = Field(description="The evaluate step's task names.")
    num_items: int = Field(80, ge=1, description="Items per bundled synthetic set.")
    seed: int = Field(1234, description="Seed of the synthetic item generator.")

    @field_validator("tasks")
    @classmethod
    def _some_tasks(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("tasks=[] names no evaluation task to decontaminate against")
        return value


def decontam_config(settings: DecontamSettings, evaluate: EvalConfig) -> DecontamConfig:
    """The step config for a pipeline: only the eval fields that decide the eval sets' items.

    The real sets' files (under ``evaluate.data_root``) enter the hash by content, as the
    step's raw input, not by the folder's name.
    """
    return DecontamConfig(
        **settings.model_dump(),
        tasks=list(evaluate.tasks),
        num_items=evaluate.num_items,
        seed=evaluate.seed,
    )
