"""Typed configs for the SFT and DPO steps (pydantic v2: validated before any compute)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmflow.tasks.framework.hashing import OMIT_DEFAULT, UNVERSIONED
from llmflow.tasks.posttrain.rewards import RewardSpec

Schedule = Literal["constant", "linear", "cosine"]


def _learning_rate(default: float) -> Any:
    """The ``learning_rate`` field every method declares, with the method's default."""
    return Field(default, gt=0, lt=1, description="Peak AdamW learning rate.")


def _schedule(default: str) -> Any:
    """The ``lr_scheduler_type`` field every method declares, with the method's default."""
    return Field(default, description="Learning-rate schedule after warmup.")


def _max_steps(default: int) -> Any:
    """The ``max_steps`` field every method declares, with the method's default."""
    return Field(default, gt=0, description="Optimizer steps; None trains for num_epochs instead.")


def _num_heldout(default: int, what: str) -> Any:
    """The ``num_heldout`` field; ``what`` names the method's records (Examples, Pairs, ...)."""
    return Field(
        default, ge=0, description=f"{what} held out (by seed) for before/after evaluation."
    )


class _TrainStepConfig(BaseModel):
    """Fields shared by SFT and DPO.

    Learning rates default to what fine-tuning a real pretrained model wants (TRL's SFT default
    2e-5; DPO 5e-7, the Zephyr / Tulu recipe): a user pointing the step at a 1B model must not
    inherit a toy model's rate, which would wreck it in a few steps. The CPU quickstart (a ~2M
    model, a few dozen steps) sets its own rates in ``configs/quickstart.yaml``.
    """

    model_config = ConfigDict(extra="forbid")

    data: str = Field(
        "quickstart",
        description="'quickstart' (generated arithmetic data) or a local JSON/JSONL(.gz) file; "
        "the format is detected per record.",
    )
    num_quickstart_examples: int = Field(
        512, gt=0, description="How many quickstart records to generate when data='quickstart'."
    )
    max_length: int = Field(
        128, ge=16, description="Longest tokenized sequence; longer prompts are rejected."
    )
    learning_rate: float = _learning_rate(2e-5)
    lr_scheduler_type: Schedule = _schedule("cosine")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_steps: int | None = _max_steps(60)
    num_epochs: float = Field(1.0, gt=0, description="Epochs, used only when max_steps is None.")
    per_device_batch_size: int = Field(8, gt=0, description="Examples per device per micro-batch.")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per step.")
    num_heldout: int = _num_heldout(32, "Examples")
    seed: int = Field(0, description="Seed for the held-out split, data order and init.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="Compute precision: bf16 is TRL's bf16 mixed precision (autocast over "
        "float32 weights and optimizer state; on CPU too); auto is bf16 on CUDA and fp32 on CPU, "
        "as pretrain.train.precision.",
        json_schema_extra=OMIT_DEFAULT,  # NOTE: added after outputs existed; auto keeps them
    )
    bf16: bool = Field(
        False, description="The older spelling of precision='bf16': true computes in bf16."
    )
    attn_implementation: str = Field(
        "sdpa",
        description="Attention kernel: 'sdpa' or 'eager' (CPU), 'flash_attention_2' (GPU).",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations to save memory.", json_schema_extra=UNVERSIONED
    )
    logging_steps: int = Field(
        10, gt=0, description="Steps between log lines.", json_schema_extra=UNVERSIONED
    )
    dataloader_num_workers: int = Field(
        0, ge=0, description="Data loader worker processes.", json_schema_extra=UNVERSIONED
    )
    checkpoint_interval: int | None = Field(
        100,
        gt=0,
        description="Save a resumable checkpoint (weights, optimizer, RNG, data position) every "
        "this many optimizer steps into the output's partial folder; a retried or preempted step "
        "resumes from the newest one, to the same weights. None: no checkpoints.",
        # NOTE: resume is exact (tests/tasks/posttrain/test_posttrain_resume.py), so the cadence
        # changes no result and stays out of the hash, as the log interval does.
        json_schema_extra=UNVERSIONED,
    )

    @model_validator(mode="after")
    def _one_precision(self) -> _TrainStepConfig:
        if self.bf16 and self.precision == "fp32":
            raise ValueError("bf16=True contradicts precision='fp32'; set one of them")
        return self

    def uses_bf16(self, device_type: str) -> bool:
        """Whether TRL computes in bf16 on ``device_type`` (``auto``: on CUDA only)."""
        if self.bf16 or self.precision == "bf16":
            return True
        return self.precision == "auto" and device_type == "cuda"

    @field_validator("data")
    @classmethod
    def _data_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("data='' : use 'quickstart' or a path to a JSON/JSONL file")
        return value

    @field_validator("attn_implementation")
    @classmethod
    def _known_attention(cls, value: str) -> str:
        allowed = {"sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"}
        if value not in allowed:
            raise ValueError(f"attn_implementation={value!r} is not one of {sorted(allowed)}")
        return value


class SFTStepConfig(_TrainStepConfig):
    """Supervised fine-tuning on chat data through TRL's SFTTrainer."""

    assistant_only_loss: bool = Field(
        True, description="Loss on assistant tokens only (needs {% generation %} in the template)."
    )
    packing: bool = Field(
        True,
        description="Pack conversations into max_length rows (best-fit decreasing) without "
        "cross-example attention: padding-free batches carry position_ids that restart at 0.",
    )


class DPOStepConfig(_TrainStepConfig):
    """Direct preference optimization through TRL's DPOTrainer; the reference is the SFT model."""

    learning_rate: float = _learning_rate(5e-7)
    lr_scheduler_type: Schedule = _schedule("constant")
    max_steps: int | None = _max_steps(30)
    num_heldout: int = _num_heldout(64, "Pairs")
    beta: float = Field(
        0.1, gt=0, description="DPO beta: higher keeps the policy closer to the reference."
    )
    loss_type: Literal["sigmoid", "hinge", "ipo", "apo_zero", "apo_down"] = Field(
        "sigmoid",
        description="TRL DPO loss; 'sigmoid' is the original DPO loss, 'apo_zero' / 'apo_down' "
        "Anchored Preference Optimization (D'Oosterlinck et al. 2024; SmolLM3's alignment): "
        "apo_zero raises the chosen and lowers the rejected likelihood (chosen better than the "
        "model), apo_down lowers both (neither better).",
    )
    sft_weight: float = Field(
        0.0,
        ge=0,
        description="Weight of a negative log-likelihood term on the chosen responses (RPO; TRL's "
        "'sft' loss added to loss_type). It keeps a small model answering in the chosen format, "
        "which plain DPO can lose while its preference accuracy rises; 0 is plain DPO.",
    )

    @model_validator(mode="after")
    def _ipo_beta(self) -> DPOStepConfig:
        if self.loss_type == "ipo" and self.beta > 10:
            raise ValueError(
                f"beta={self.beta} with loss_type='ipo' gives a near-zero target margin"
            )
        return self


def _default_rewards() -> list[RewardSpec]:
    return [
        RewardSpec(name="exact_answer", weight=1.0),
        RewardSpec(name="format", weight=0.5),
        RewardSpec(name="length_penalty", weight=0.5, params={"target_words": 8}),
    ]


class GRPOStepConfig(_TrainStepConfig):
    """GRPO with verifiable rewards through TRL's GRPOTrainer, after SFT or after DPO.

    Each prompt gets ``num_generations`` sampled completions; each completion's reward is the
    weighted sum of ``rewards``; its advantage is the reward minus its group's mean, divided by
    the group's standard deviation (``scale_rewards="group"``). ``beta`` weighs the KL penalty to
    the starting model. On a GPU, ``use_vllm`` generates with vLLM (TRL's ``use_vllm`` /
    ``vllm_mode``; vLLM must be installed there); on CPU generation runs through transformers.
    """

    enabled: bool = Field(True, description="Run GRPO in the recipe.")
    after: Literal["sft", "dpo"] = Field(
        "dpo", description="Which model GRPO starts from (and keeps as its KL reference)."
    )
    data: str = Field(
        "quickstart",
        description="'quickstart' (generated arithmetic prompts with answers) or a GSM8K-format "
        "JSONL file ({question, answer with '#### N'}) or {prompt, answer} records.",
    )
    num_quickstart_examples: int = Field(
        256, gt=0, description="Training prompts to draw when data='quickstart'."
    )
    max_length: int = Field(
        128, ge=16, description="Longest prompt in tokens; longer prompts are rejected."
    )
    learning_rate: float = _learning_rate(1e-6)
    lr_scheduler_type: Schedule = _schedule("constant")
    max_steps: int | None = _max_steps(20)
    num_heldout: int = _num_heldout(32, "Prompts")
    num_generations: int = Field(4, ge=2, description="Completions per prompt (the group).")
    max_completion_length: int = Field(
        16, gt=0, description="Longest completion in tokens, in training and evaluation."
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature in training.")
    beta: float = Field(0.04, ge=0, description="KL penalty weight; 0 drops the reference.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantage normalization: group std (GRPO), batch std, or none."
    )
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = Field(
        "grpo", description="TRL's GRPO loss aggregation."
    )
    rewards: list[RewardSpec] = Field(
        default_factory=_default_rewards,
        min_length=1,
        description="Rewards summed with their weights: built-in names or 'module:function'.",
    )
    max_failure_rate: float = Field(
        0.1, ge=0, le=1, description="Share of completions a reward may fail on before stopping."
    )
    use_vllm: bool = Field(
        False, description="Generate with vLLM (GPU; vLLM installed) instead of transformers."
    )
    vllm_mode: Literal["colocate", "server"] = Field(
        "colocate", description="vLLM in the training process, or a separate `trl vllm-serve`."
    )

    @model_validator(mode="after")
    def _full_groups(self) -> GRPOStepConfig:
        batch = self.per_device_batch_size * self.gradient_accumulation_steps
        if batch % self.num_generations:
            raise ValueError(
                f"per_device_batch_size x gradient_accumulation_steps = {batch} must be a "
                f"multiple of num_generations={self.num_generations} (whole prompt groups)"
            )
        return self


class AverageConfig(BaseModel):
    """Checkpoint averaging of the last pretraining (decay) stage."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        False, description="Average in the recipe.", json_schema_extra=UNVERSIONED
    )
    last_k: int = Field(3, ge=2, description="How many of the newest checkpoints to average.")
    eval_batches: int = Field(8, gt=0, description="Validation batches for the loss comparison.")
    micro_batch_size: int = Field(8, gt=0, description="Sequences per validation batch.")
