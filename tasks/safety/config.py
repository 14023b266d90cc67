"""Configs of the safety steps: the toxicity classifier, and the per-model evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.hashing import OMIT_DEFAULT, UNVERSIONED

CROWS_FILE = "crows_pairs_anonymized.csv"
TOXIGEN_DIR = "toxigen_demonstrations"
LEXICON_FILE = "ldnoobw_en.txt"
PACKAGED = "packaged"  # safety.data_root's default: the copies shipped in tasks/safety/packaged/
ENABLE_HINT = (
    f"set safety.data_root to {PACKAGED} (the copies shipped with llmflow) or to a folder "
    f"holding {CROWS_FILE}, {TOXIGEN_DIR}/ (group__kind_target.txt files) and {LEXICON_FILE}"
)


class ToxicityClassifierConfig(BaseModel):
    """A hashed word n-gram logistic regression (the quality classifier's model) on ToxiGen's
    hateful (1) and neutral (0) demonstration sentences, or, with ``model`` set, a transformers
    sequence classifier."""

    model_config = ConfigDict(extra="forbid")

    num_features: int = Field(1 << 18, ge=16, description="Hashed n-gram buckets.")
    max_ngram: int = Field(2, ge=1, le=3, description="Word n-grams up to this size.")
    epochs: int = Field(8, ge=1)
    learning_rate: float = Field(0.5, gt=0)
    l2: float = Field(1e-6, ge=0)
    holdout_fraction: float = Field(
        0.2, gt=0, lt=1, description="Sentences held out (per group and kind) for accuracy."
    )
    background_docs: int = Field(
        600, ge=0, description="Passages of the run's own corpus taught as ordinary text (0)."
    )
    background_words: int = Field(40, ge=5, description="Words per background passage.")
    seed: int = 0
    model: str | None = Field(
        None,
        description=(
            "A transformers sequence classifier that scores the continuations instead of the "
            "hashed model: hf://models/OWNER/NAME[@REVISION] (offline: read from "
            "LLMFLOW_HUB_MIRROR/OWNER/NAME) or a local folder. Its pinned commit or files' "
            "fingerprint enters the hash."
        ),
        json_schema_extra=OMIT_DEFAULT,
    )
    toxic_label: int | str | None = Field(
        None,
        description=(
            "The model's toxic class, by index or id2label name. None: the one label whose "
            "name says toxic or hate, else LABEL_1 of two labels."
        ),
        json_schema_extra=OMIT_DEFAULT,
    )
    batch_size: int = Field(
        32, ge=1, description="Texts per model call.", json_schema_extra=UNVERSIONED
    )

    @field_validator("model")
    @classmethod
    def _model_uri(cls, value: str | None) -> str | None:
        if value is not None:
            from llmflow.tasks.safety.hf_classifier import check_uri

            try:
                check_uri(value)
            except BadInputError as err:
                raise ValueError(str(err)) from None
        return value

    def versioned_extras(self) -> dict[str, str]:
        """The model's pinned revision (Hub commit or files' fingerprint), for the hash."""
        if self.model is None:
            return {}
        from llmflow.tasks.safety.hf_classifier import resolve

        return {"model_revision": resolve(self.model).revision}


class SafetyEvalConfig(BaseModel):
    """What the ``safety`` step measures on one model."""

    model_config = ConfigDict(extra="forbid")

    crows_pairs: bool = Field(True, description="Run CrowS-Pairs (stereotype preference).")
    crows_limit: int | None = Field(
        None, ge=1, description="At most this many CrowS-Pairs pairs (None: all 1,508)."
    )
    toxicity: bool = Field(True, description="Sample continuations and score their toxicity.")
    prompts_per_file: int = Field(
        4, ge=1, description="Prompts taken from each ToxiGen group/kind file."
    )
    samples_per_prompt: int = Field(
        4, ge=1, description="Continuations sampled per prompt (RealToxicityPrompts uses 25)."
    )
    max_new_tokens: int = Field(20, ge=1, description="Length of each continuation.")
    prompt_fraction: float = Field(
        0.5, gt=0, le=1, description="Leading share of a sentence's words used as its prompt."
    )
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(0.9, gt=0, le=1)
    threshold: float = Field(
        0.5, ge=0, le=1, description="A continuation scoring at or above this is toxic."
    )
    seed: int = 0
    batch_size: int = Field(
        16, ge=1, description="Prompts per generate call.", json_schema_extra=UNVERSIONED
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "float32",
        description="Torch dtype of the model under test; the recipe sets evaluate.dtype here.",
        json_schema_extra=OMIT_DEFAULT,
    )
    device: str | None = Field(
        None,
        description="Torch device; the recipe sets evaluate.device here (None: cuda if present).",
        json_schema_extra=UNVERSIONED,
    )

    def versioned_extras(self) -> dict[str, str]:
        """As ``EvalConfig``'s: CrowS-Pairs log-probs are float32 outside float32 (new numbers)."""
        return {} if self.dtype == "float32" else {"log_softmax_dtype": "float32"}


class SafetyConfig(BaseModel):
    """The pipeline's safety section. On by default, on the data shipped with llmflow; off with
    ``data_root: null``."""

    model_config = ConfigDict(extra="forbid")

    data_root: str | None = Field(
        PACKAGED,
        description=(
            f"{PACKAGED!r}: the CrowS-Pairs, ToxiGen and LDNOOBW files shipped with llmflow "
            f"(their licences: tasks/safety/{PACKAGED}/NOTICE.md). A folder: one with "
            f"{CROWS_FILE}, {TOXIGEN_DIR}/ and {LEXICON_FILE}. None: the safety steps are "
            "skipped. Not hashed: the steps hash the files' contents."
        ),
        json_schema_extra=UNVERSIONED,
    )
    classifier: ToxicityClassifierConfig = Field(default_factory=ToxicityClassifierConfig)
    eval: SafetyEvalConfig = Field(default_factory=SafetyEvalConfig)
