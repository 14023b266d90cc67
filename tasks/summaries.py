"""The step summaries other steps read, typed once and shared by writer and reader.

A card or leaderboard reads what the pretraining, curation, export and external-model steps
record. Each such record is a pydantic model here: the writing step passes its dict through
``written`` (every declared field present and of its type, the dict returned unchanged, so its
bytes and the step's address stay as they were), and the reader takes it through ``read`` (a
field an output made before it existed is None, which the card writes "not recorded"). A field
renamed on either side fails: the writer's ``written`` raises, or the reader's attribute is gone.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class Summary(BaseModel):
    """A step's recorded summary; writers record more than the readers need (extra allowed)."""

    model_config = ConfigDict(extra="allow")

    @classmethod
    def written(cls, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` as the step records them, checked: each declared field present and valid.

        Raises:
            ValueError: a declared field is missing (renamed by the writer) or of another type.
        """
        missing = sorted(set(cls.model_fields) - set(values))
        if missing:
            raise ValueError(f"{cls.__name__}: the step records no {missing}")
        cls.model_validate(values)
        return values

    @classmethod
    def read(cls, values: dict[str, Any] | None):
        """A recorded summary for a reader; fields an older output lacks are None.

        NOTE: a record that does not validate (an output made by an older writer) is taken as
        it is rather than failing its reader: a card never fails on a missing fact.
        """
        try:
            return cls.model_validate(values or {})
        except ValidationError:
            return cls.model_construct(**(values or {}))


class PretrainSummary(Summary):
    """A pretraining stage's ``summary.json`` (its step's metrics), as the card reads it."""

    tokens_seen: int | None = None
    tokens_per_s: float | None = None
    world_size: int | None = None
    steps: int | None = None
    stage_steps: int | None = None
    final_loss: float | None = None
    val_loss: float | None = None


class CurationStage(Summary):
    """One row of ``curation_report.json``'s ``stages``: documents in and out, removal reasons."""

    stage: str | None = None
    documents_in: int | None = None
    documents_out: int | None = None
    removed: dict[str, dict[str, int]] | None = None


class CurationReport(Summary):
    """``curation_report.json``, the part the card reads."""

    stages: list[CurationStage] | None = None


class ModelSize(Summary):
    """The export and external-model steps' metrics: the model's parameter count."""

    num_parameters: int | None = None


class MoeModelSize(ModelSize):
    """``ModelSize`` of a mixture of experts, which also records the parameters one token goes
    through (``ModelConfig.active_parameters``). Written only for a model with experts, so a dense
    model's record (and its output's bytes) is as before; the card reads every record through it
    (a dense record reads ``active_parameters`` None)."""

    active_parameters: int | None = None
