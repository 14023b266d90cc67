"""The evaluate step's config: which lm-eval tasks, how much of each, and how to run them."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmflow.tasks.framework.hashing import UNVERSIONED

TASK_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class EvalConfig(BaseModel):
    """Evaluate one exported Hugging Face checkpoint with lm-eval's ``hf`` backend."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[str] = Field(
        default_factory=lambda: ["heldout_ppl", "cf_arith", "mcf_arith", "gen_arith", "cf_facts"],
        description=(
            "lm-eval task, group or tag names. Bundled: 'ppl_<domain>' per held-out domain "
            "(tag 'heldout_ppl' for all), 'cf_arith', 'mcf_arith', 'gen_arith', 'cf_facts', "
            "'mcf_facts', 'gen_facts'; real sets under data_root: 'piqa_local', "
            "'wikitext2_local', 'gsm8k_local'; or any lm-eval task whose data is reachable."
        ),
    )
    num_fewshot: int | None = Field(
        default=None, description="Few-shot examples per prompt; None keeps each task's default."
    )
    limit: int | None = Field(
        default=None, description="At most this many documents per task (None: all)."
    )
    num_items: int = Field(
        default=80, description="Synthetic items written per bundled arith/facts task."
    )
    num_ppl_docs: int = Field(
        default=20, description="Held-out documents per domain for the perplexity tasks."
    )
    max_doc_chars: int = Field(
        default=2000,
        description="Held-out documents are cut to this many characters (keeps the suite fast).",
    )
    max_gen_toks: int = Field(
        default=8, description="Generation budget of the bundled generate_until tasks."
    )
    seed: int = Field(default=1234, description="Seed of the synthetic item generator.")
    dtype: str = Field(
        default="float32", description="Torch dtype the model is evaluated in ('auto' allowed)."
    )
    bootstrap_iters: int = Field(
        default=0,
        description="lm-eval bootstrap iterations for stderrs (0: skip; costly for perplexity).",
    )
    data_root: str | None = Field(
        default=None,
        description=(
            "Folder with the real eval files (piqa_valid.jsonl, wikitext2_test.txt, ...). "
            "Part of the hash: another folder may hold other data."
        ),
    )
    batch_size: Literal["auto"] | int = Field(
        default="auto",
        description="lm-eval batch size; 'auto' lets lm-eval find the largest that fits.",
        json_schema_extra=UNVERSIONED,
    )
    max_batch_size: int = Field(
        default=64,
        description="Upper bound for the 'auto' batch size search.",
        json_schema_extra=UNVERSIONED,
    )
    device: str | None = Field(
        default=None,
        description="Torch device ('cpu', 'cuda:0'); None picks cuda when present, else cpu.",
        json_schema_extra=UNVERSIONED,
    )
    log_samples: bool = Field(
        default=False,
        description="Also write the per-sample log (samples_<task>.jsonl) beside results.json.",
        json_schema_extra=UNVERSIONED,
    )

    def versioned_extras(self) -> dict[str, str]:
        """Outside float32, the dtype lm-eval's log-probs are taken in, for the hash: float32
        (``harness.load_model``) where they were the model's own dtype before, so bf16 and fp16
        results moved and take new addresses; float32 results keep theirs."""
        return {} if self.dtype == "float32" else {"log_softmax_dtype": "float32"}

    @field_validator("tasks")
    @classmethod
    def _check_tasks(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("tasks=[] names no task; give at least one lm-eval task name")
        bad = [name for name in value if not TASK_NAME.match(name)]
        if bad:
            raise ValueError(f"tasks={bad!r}: task names use letters, digits, '_', '-', '.'")
        if len(set(value)) != len(value):
            raise ValueError(f"tasks={value!r} lists a task twice")
        return value

    @field_validator("num_fewshot")
    @classmethod
    def _check_fewshot(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"num_fewshot={value} must be >= 0")
        return value

    @field_validator("limit", "num_items", "num_ppl_docs", "max_doc_chars", "max_gen_toks")
    @classmethod
    def _check_positive(cls, value: int | None, info) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"{info.field_name}={value} must be >= 1")
        return value

    @field_validator("batch_size")
    @classmethod
    def _check_batch_size(cls, value: str | int) -> str | int:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"batch_size={value} must be >= 1 or 'auto'")
        return value

    @field_validator("bootstrap_iters")
    @classmethod
    def _check_bootstrap(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"bootstrap_iters={value} must be >= 0")
        return value

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        allowed = {"auto", "float32", "float16", "bfloat16"}
        if value not in allowed:
            raise ValueError(f"dtype={value!r} must be one of {sorted(allowed)}")
        return value
