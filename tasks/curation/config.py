"""Typed configuration for the curate step: one pydantic model per stage, nested in CurateConfig.

Defaults follow datatrove 0.10 (the FineWeb pipeline) so that our keep/remove decisions match
theirs; every filter can be switched off and scoped to domains.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmflow.tasks.framework.hashing import OMIT_DEFAULT

PROSE_SECTIONS = ("gopher_repetition", "gopher_quality", "c4", "fineweb")
"""The filters written for prose: a recipe's ``curate.skip_domains`` reaches each of them."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_fraction(name: str, value: float | None) -> float | None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return value


class NormalizeConfig(_Strict):
    """Unicode and whitespace normalization plus rejection of unusable documents."""

    unicode_form: Literal["NFC", "NFKC", "none"] = Field("NFC", description="Unicode normal form.")
    collapse_inner_spaces: bool = Field(
        True, description="Collapse runs of spaces inside a line (leading indentation is kept)."
    )
    verbatim_domains: list[str] = Field(
        default_factory=lambda: ["code"],
        description="Domains whose inner spacing is kept as is (indentation-sensitive text).",
    )
    max_doc_chars: int = Field(
        1_000_000, gt=0, description="Reject documents longer than this many characters."
    )
    max_line_chars: int = Field(
        100_000, gt=0, description="Reject documents with a single line longer than this."
    )
    max_control_ratio: float = Field(
        0.01,
        description="Reject as binary when more than this fraction of chars are control chars.",
    )
    max_replacement_ratio: float = Field(
        0.01, description="Reject as non-UTF-8 when more than this fraction of chars are U+FFFD."
    )
    max_error_share: float = Field(
        0.01,
        ge=0,
        le=1,
        description="Stop the step when more than this share of a shard's documents raise an "
        "exception while normalized (each is also rejected with its reason).",
        json_schema_extra=OMIT_DEFAULT,
    )

    @field_validator("max_control_ratio", "max_replacement_ratio")
    @classmethod
    def _fraction(cls, value: float, info) -> float:
        return _check_fraction(info.field_name, value)


class ExactHashConfig(_Strict):
    """What hashing one shard for exact dedup reads (the ``curate-exact-hashes`` step)."""

    level: Literal["document", "paragraph"] = "document"
    min_paragraph_chars: int = Field(50, ge=0)


class ExactDedupConfig(_Strict):
    """Exact deduplication on a hash of the text-normal form (lowercase, no punctuation, digits 0)."""

    enabled: bool = Field(True, description="Run exact deduplication.")
    level: Literal["document", "paragraph"] = Field(
        "document", description="Drop whole duplicate documents, or also repeated paragraphs."
    )
    expected_documents: int = Field(
        1_000_000, gt=0, description="Bloom filter capacity; more documents raise the FP rate."
    )
    false_positive_rate: float = Field(
        1e-4, gt=0.0, lt=1.0, description="Target Bloom filter false-positive rate at capacity."
    )
    min_paragraph_chars: int = Field(
        50, ge=0, description="Paragraph level: shorter paragraphs are never dropped."
    )
    method: Literal["bloom", "partitioned"] = Field(
        "bloom",
        description="'bloom': one process streams every hash through a Bloom filter, then an "
        "exact check. 'partitioned': hashes shuffled by prefix into `partitions` files, each "
        "deduplicated on its own (on the run's backend: Ray or processes under runner.kind "
        "ray or processes): memory per worker bounded by its partition. Same drops.",
        json_schema_extra=OMIT_DEFAULT,
    )
    partitions: int = Field(
        64,
        ge=1,
        description="Partitioned method: hash-prefix partitions.",
        json_schema_extra=OMIT_DEFAULT,
    )

    def hash_config(self) -> ExactHashConfig:
        """The fields the per-shard hashing reads: the Bloom filter's size never re-hashes."""
        return ExactHashConfig(level=self.level, min_paragraph_chars=self.min_paragraph_chars)


class SignatureConfig(_Strict):
    """What MinHash signatures of one shard read (the ``curate-minhash`` step)."""

    n_grams: int = Field(5, ge=1)
    num_buckets: int = Field(14, ge=1)
    hashes_per_bucket: int = Field(8, ge=1)
    seed: int = 1


class MinhashConfig(_Strict):
    """MinHash LSH near-deduplication (datatrove defaults: 5-grams, 14 bands x 8 hashes)."""

    enabled: bool = Field(True, description="Run near deduplication.")
    n_grams: int = Field(5, ge=1, description="Word n-gram size of the shingles.")
    num_buckets: int = Field(14, ge=1, description="LSH bands.")
    hashes_per_bucket: int = Field(8, ge=1, description="Hashes per band.")
    seed: int = Field(1, description="Seed of the permutation parameters.")
    keep: Literal["first", "longest"] = Field(
        "first", description="Which member of a cluster survives (ties: first by shard, row)."
    )
    num_sample_clusters: int = Field(5, ge=0, description="Clusters sampled into the report.")
    method: Literal["union_find", "partitioned"] = Field(
        "union_find",
        description="'union_find': one process loads every band key and joins all documents. "
        "'partitioned': band keys shuffled by (band, key) into `partitions` files, each emitting "
        "its duplicate pairs; the union-find runs on the pairs only (on the run's backend: Ray "
        "or processes under runner.kind ray or processes): memory grows with duplicates, "
        "not documents. Same clusters and keepers.",
        json_schema_extra=OMIT_DEFAULT,
    )
    partitions: int = Field(
        64,
        ge=1,
        description="Partitioned method: (band, key) partitions.",
        json_schema_extra=OMIT_DEFAULT,
    )

    def signature_config(self) -> SignatureConfig:
        """The fields signatures read: which cluster member is kept never re-signs a shard."""
        return SignatureConfig(
            n_grams=self.n_grams,
            num_buckets=self.num_buckets,
            hashes_per_bucket=self.hashes_per_bucket,
            seed=self.seed,
        )


class GopherQualityConfig(_Strict):
    """Gopher quality rules (Rae et al. 2021, table A1), datatrove thresholds."""

    enabled: bool = True
    skip_domains: list[str] = Field(
        default_factory=list,
        description="Domains this rule leaves alone; in a recipe, curate.skip_domains unless set.",
    )
    min_doc_words: int | None = 50
    max_doc_words: int | None = 100_000
    min_avg_word_length: float | None = 3
    max_avg_word_length: float | None = 10
    max_symbol_word_ratio: float | None = 0.1
    max_bullet_lines_ratio: float | None = 0.9
    max_ellipsis_lines_ratio: float | None = 0.3
    max_non_alpha_words_ratio: float | None = Field(
        0.8, description="Minimum fraction of words with a letter (datatrove's name kept)."
    )
    min_stop_words: int | None = 2
    alpha_ratio_skips_punctuation: bool = Field(
        False,
        description="Leave punctuation-only tokens out of the alpha-word ratio. False matches "
        "datatrove (spaCy tokens, so punctuation counts as words and much clean prose fails).",
    )
    stop_words: list[str] = Field(
        default_factory=lambda: ["the", "be", "to", "of", "and", "that", "have", "with"]
    )


class GopherRepetitionConfig(_Strict):
    """Gopher repetition rules, datatrove thresholds."""

    enabled: bool = True
    skip_domains: list[str] = Field(
        default_factory=list,
        description="Domains this rule leaves alone; in a recipe, curate.skip_domains unless set.",
    )
    dup_line_frac: float | None = 0.3
    dup_para_frac: float | None = 0.3
    dup_line_char_frac: float | None = 0.2
    dup_para_char_frac: float | None = 0.2
    top_n_grams: list[tuple[int, float]] = Field(
        default_factory=lambda: [(2, 0.2), (3, 0.18), (4, 0.16)]
    )
    dup_n_grams: list[tuple[int, float]] = Field(
        default_factory=lambda: [(5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10)]
    )


class C4Config(_Strict):
    """C4 rules as a document filter; line rewriting (dropping failing lines) is optional."""

    enabled: bool = True
    skip_domains: list[str] = Field(
        default_factory=list,
        description="Domains this rule leaves alone; in a recipe, curate.skip_domains unless set.",
    )
    rewrite_lines: bool = Field(False, description="Replace the text by its kept lines.")
    remove_citations: bool = True
    filter_no_terminal_punct: bool = Field(
        False, description="Drop lines without terminal punctuation (FineWeb uses False)."
    )
    min_num_sentences: int = Field(5, description="-1 disables.")
    min_words_per_line: int = Field(3, description="-1 disables.")
    max_word_length: int = Field(1000, description="-1 disables.")
    filter_lorem_ipsum: bool = True
    filter_javascript: bool = True
    filter_curly_bracket: bool = True
    filter_policy: bool = True


class FineWebQualityConfig(_Strict):
    """FineWeb's own quality rules, datatrove thresholds."""

    enabled: bool = True
    skip_domains: list[str] = Field(
        default_factory=list,
        description="Domains this rule leaves alone; in a recipe, curate.skip_domains unless set.",
    )
    line_punct_thr: float = 0.12
    line_punct_exclude_zero: bool = False
    short_line_thr: float = 0.67
    short_line_length: int = 30
    char_duplicates_ratio: float = 0.01
    new_line_ratio: float = 0.3


class FiltersConfig(_Strict):
    """Heuristic filters, applied in FineWeb's order: repetition, quality, C4, FineWeb."""

    gopher_repetition: GopherRepetitionConfig = Field(default_factory=GopherRepetitionConfig)
    gopher_quality: GopherQualityConfig = Field(default_factory=GopherQualityConfig)
    c4: C4Config = Field(default_factory=C4Config)
    fineweb: FineWebQualityConfig = Field(default_factory=FineWebQualityConfig)
    num_removed_samples: int = Field(5, ge=0, description="Removed documents kept per reason.")
    max_error_share: float = Field(
        0.01,
        ge=0,
        le=1,
        description="Stop the step when more than this share of a shard's documents raise an "
        "exception in a filter (a bug, not bad text) (each is also counted and sampled with its reason).",
        json_schema_extra=OMIT_DEFAULT,
    )


class PIIConfig(_Strict):
    """Replace e-mail addresses, IP addresses and phone numbers with placeholders."""

    enabled: bool = True
    email_placeholder: str = "<EMAIL>"
    ip_placeholder: str = "<IP_ADDRESS>"
    phone_placeholder: str = "<PHONE>"


class QualityModelConfig(_Strict):
    """Teacher-labelled subset -> hashed n-gram linear classifier -> filter everything."""

    enabled: bool = True
    teacher: Literal["rules", "hf"] = Field("rules", description="Rule-based or local HF model.")
    teacher_path: str | None = Field(None, description="Local HF sequence-classification model.")
    teacher_threshold: float = Field(
        0.5, description="Teacher score at or above which a document counts as good."
    )
    num_teacher_docs: int = Field(2000, ge=10, description="Documents the teacher labels.")
    holdout_fraction: float = Field(0.2, description="Teacher labels held out for evaluation.")
    num_features: int = Field(1 << 18, ge=16, description="Hashed n-gram buckets.")
    max_ngram: int = Field(2, ge=1, le=3, description="Word n-grams up to this size.")
    epochs: int = Field(5, ge=1)
    learning_rate: float = Field(0.5, gt=0)
    l2: float = Field(1e-6, ge=0)
    threshold: float = Field(
        0.5, description="Drop documents whose predicted good-probability is below this."
    )
    skip_domains: list[str] = Field(
        default_factory=list,
        description="Domains this rule leaves alone; in a recipe, curate.skip_domains unless set.",
    )
    seed: int = 0

    @field_validator("holdout_fraction", "threshold")
    @classmethod
    def _fraction(cls, value: float, info) -> float:
        return _check_fraction(info.field_name, value)

    @model_validator(mode="after")
    def _hf_needs_path(self) -> QualityModelConfig:
        if self.teacher == "hf" and not self.teacher_path:
            raise ValueError("quality_model.teacher='hf' needs quality_model.teacher_path")
        return self


class FilterStepConfig(_Strict):
    """What filtering one shard reads (the ``curate-filter`` step): heuristics, then PII."""

    filters: FiltersConfig = Field(default_factory=FiltersConfig)
    pii: PIIConfig = Field(default_factory=PIIConfig)


class CorpusConfig(_Strict):
    """The final ``curate`` step reads no setting: its corpus follows from its inputs alone."""


def _with_skip(section: Any, skip: list[str]) -> Any:
    """A section's raw fields with ``skip_domains`` filled in, unless it gives its own."""
    if not isinstance(section, dict) or "skip_domains" in section:
        return section
    return {**section, "skip_domains": skip}


class CurateConfig(_Strict):
    """The whole curate step; each stage's step gets only the part it reads (see `recipe.py`)."""

    normalize: NormalizeConfig = Field(default_factory=NormalizeConfig)
    exact_dedup: ExactDedupConfig = Field(default_factory=ExactDedupConfig)
    minhash: MinhashConfig = Field(default_factory=MinhashConfig)
    filters: FiltersConfig = Field(default_factory=FiltersConfig)
    quality_model: QualityModelConfig = Field(default_factory=QualityModelConfig)
    pii: PIIConfig = Field(default_factory=PIIConfig)
    skip_domains: list[str] = Field(
        default_factory=list,
        description="Domains the prose filters and the quality model leave alone (e.g. code, "
        "math: Python fails Gopher's stop-word and C4's curly-bracket rules, templated "
        "arithmetic Gopher's n-gram rules). Each of them inherits it unless it sets its own.",
    )

    @model_validator(mode="before")
    @classmethod
    def _inherit_skip_domains(cls, data: Any) -> Any:
        """Give each prose filter and the quality model ``skip_domains`` where they set none."""
        if not isinstance(data, dict) or not data.get("skip_domains"):
            return data
        skip = list(data["skip_domains"])
        filters = data.get("filters", {})
        if isinstance(filters, dict):
            filters = {s: _with_skip(filters.get(s, {}), skip) for s in PROSE_SECTIONS} | {
                k: v for k, v in filters.items() if k not in PROSE_SECTIONS
            }
        quality = _with_skip(data.get("quality_model", {}), skip)
        return {**data, "filters": filters, "quality_model": quality}

    def filter_config(self) -> FilterStepConfig:
        """The heuristic filters and PII settings, what the filter step reads."""
        return FilterStepConfig(filters=self.filters, pii=self.pii)

    @model_validator(mode="after")
    def _paragraphs_need_layout(self) -> CurateConfig:
        if self.exact_dedup.level == "paragraph" and self.filters.c4.rewrite_lines:
            raise ValueError(
                "exact_dedup.level='paragraph' needs filters.c4.rewrite_lines=False "
                "(C4 line rewriting removes the paragraph breaks the hashes refer to)"
            )
        return self
