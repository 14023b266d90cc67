"""Context extension (RoPE ABF, then YaRN at inference) and its long-context evaluation.

Each extension stage is a pretrain step: ``extension_mixture`` gives its data and
``extension_train_config`` its trainer config, both derived from the recipe's config here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmflow.tasks.dataprep.config import StageMixture
from llmflow.tasks.framework.hashing import UNVERSIONED
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.parallel.config import ParallelConfig


class ExtensionStage(BaseModel):
    """One length step: train at ``seq_len`` with a raised RoPE base and its own LR schedule."""

    model_config = ConfigDict(extra="forbid")

    seq_len: int = Field(gt=0, description="Training sequence length of this stage.")
    rope_theta: float = Field(gt=0, description="RoPE base for this length (ABF raises it).")
    num_tokens: int = Field(gt=0, description="Token budget of this stage.")
    lr: float = Field(gt=0, description="Peak LR of this stage's own warmup + cosine schedule.")
    warmup_steps: int = Field(5, ge=0, description="Warmup steps of this stage.")
    micro_batch_size: int = Field(
        4, gt=0, description="Sequences per micro-batch (longer sequences, fewer of them)."
    )
    grad_accum_steps: int | None = Field(
        None,
        gt=0,
        description="Micro-steps per optimizer step (None: pretrain.train's). With model "
        "parallelism fewer ranks read data: raise it to keep the global batch. Hashed through "
        "the stage's trainer config only.",
        json_schema_extra=UNVERSIONED,
    )
    parallel: ParallelConfig | None = Field(
        None,
        description="This stage's parallel layout (None: pretrain.train.parallel's); long "
        "sequences may need context or tensor parallelism the shorter stages do not "
        "(`llmflow plan` proposes one). Hashed through the stage's trainer config only.",
        json_schema_extra=UNVERSIONED,
    )


class LongContextEvalConfig(BaseModel):
    """Passkey retrieval (RULER format) and loss by position, before and after extension."""

    model_config = ConfigDict(extra="forbid")

    lengths: list[int] = Field(
        default_factory=lambda: [256, 512, 1024], description="Haystack sizes."
    )
    depths: list[float] = Field(
        default_factory=lambda: [0.1, 0.5, 0.9], description="Needle depths."
    )
    trials: int = Field(2, ge=1, description="Needles per (length, depth) cell.")
    position_loss_len: int = Field(1024, gt=1, description="Positions scored for loss by position.")
    num_buckets: int = Field(16, ge=2, description="Position buckets in the loss curve.")
    seed: int = Field(0, description="Seed of keys, numbers and needle placement.")

    @field_validator("depths")
    @classmethod
    def _depths_in_unit(cls, value: list[float]) -> list[float]:
        if not value or any(not 0 <= d <= 1 for d in value):
            raise ValueError(f"depths must lie in [0, 1], got {value}")
        return value


RULER_TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)
"""RULER's synthetic tasks; its QA tasks need SQuAD and HotpotQA from the network."""
MIN_RULER_LENGTH = 128  # RULER's templates and answers alone take about this many tokens


class RulerConfig(BaseModel):
    """RULER's synthetic tasks (lm-eval's generators) on the model of every extension stage."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Score the extension stages on RULER.")
    tasks: list[str] = Field(
        default_factory=lambda: list(RULER_TASKS),
        description=f"RULER tasks to score, of {', '.join(RULER_TASKS)}.",
    )
    lengths: list[int] | None = Field(
        None,
        description="Context lengths (tokens, generation included) every stage's model is "
        f"scored at; None: the stages' own seq_len (those of at least {MIN_RULER_LENGTH}).",
    )
    samples: int = Field(2, ge=1, description="Prompts per task and length.")
    seed: int = Field(0, description="Seed of needles, words, chains and their placement.")

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, value: list[str]) -> list[str]:
        unknown = [t for t in value if t not in RULER_TASKS]
        if unknown or not value or len(set(value)) != len(value):
            raise ValueError(
                f"tasks must be distinct names of {', '.join(RULER_TASKS)}; got {value}"
            )
        return value

    @field_validator("lengths")
    @classmethod
    def _increasing_lengths(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (
            not value or value != sorted(set(value)) or value[0] < MIN_RULER_LENGTH
        ):
            raise ValueError(
                f"lengths must be strictly increasing, each at least {MIN_RULER_LENGTH}; "
                f"got {value}"
            )
        return value


class ExtendConfig(BaseModel):
    """Staged context extension, YaRN for inference, and the long-context evaluation."""

    model_config = ConfigDict(extra="forbid")

    stages: list[ExtensionStage] = Field(description="Length steps in increasing order.")
    weights: dict[str, float] = Field(description="Domain weights of the extension data.")
    max_epochs: float = Field(8.0, gt=0, description="Repetition cap of each domain.")
    yarn_factor: float = Field(
        2.0, ge=1, description="YaRN factor applied at inference on top of the last length."
    )
    beta_fast: float = Field(32.0, gt=0, description="YaRN beta_fast.")
    beta_slow: float = Field(1.0, gt=0, description="YaRN beta_slow.")
    eval: LongContextEvalConfig = Field(default_factory=LongContextEvalConfig)
    ruler: RulerConfig = Field(
        default_factory=RulerConfig,
        description="RULER on each extension stage's model. Hashed through the ruler step's "
        "config only (the longctx step does not read it).",
        json_schema_extra=UNVERSIONED,
    )

    @model_validator(mode="after")
    def _increasing(self) -> ExtendConfig:
        lengths = [s.seq_len for s in self.stages]
        if lengths != sorted(set(lengths)):  # empty: no extension (the base is the last model)
            raise ValueError(f"stages[].seq_len must be strictly increasing, got {lengths}")
        return self

    def ruler_lengths(self) -> list[int]:
        """The context lengths RULER scores: ``ruler.lengths``, else the stages' seq_len (a
        stage shorter than RULER's prompts is left out)."""
        if self.ruler.lengths is not None:
            return self.ruler.lengths
        return [s.seq_len for s in self.stages if s.seq_len >= MIN_RULER_LENGTH]

    def yarn_scaling(self) -> dict:
        """transformers-style rope parameters for inference past the last trained length."""
        return {
            "rope_type": "yarn",
            "factor": self.yarn_factor,
            "original_max_position_embeddings": self.stages[-1].seq_len,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
        }


def extension_mixture(cfg: ExtendConfig, stage: ExtensionStage, seed: int) -> StageMixture:
    """The packed data of one extension stage, at its sequence length."""
    return StageMixture(
        weights=cfg.weights,
        num_tokens=stage.num_tokens,
        seq_len=stage.seq_len,
        max_epochs=cfg.max_epochs,
        on_overflow="reweight",
        seed=seed,
    )


def extension_train_config(base: TrainConfig, stage: ExtensionStage) -> TrainConfig:
    """The trainer config of one extension stage: longer context, raised RoPE base, own schedule.

    With Muon, its group's peak LR keeps its ratio to the AdamW groups' (``stage.lr`` sets those).
    """
    optimizer: dict = {"lr": stage.lr}
    if base.optimizer.name == "muon":
        optimizer["muon_lr"] = base.optimizer.muon_lr * stage.lr / base.optimizer.lr
    return base.replaced(
        model={"overrides": {"max_seq_len": stage.seq_len, "rope_theta": stage.rope_theta}},
        optimizer=optimizer,
        schedule={
            "name": "cosine",
            "warmup_steps": stage.warmup_steps,
            "total_steps": None,
            "per_stage": True,
        },
        batch={"micro_batch_size": stage.micro_batch_size, "warmup_start_micro_batch": None}
        | ({} if stage.grad_accum_steps is None else {"grad_accum_steps": stage.grad_accum_steps}),
        max_steps=None,
        num_tokens=stage.num_tokens,
        **({} if stage.parallel is None else {"parallel": stage.parallel.model_dump()}),
    )
