"""Back-of-the-envelope plan for a pretraining run: parameters, FLOPs, memory per GPU, time.

The estimates are the standard ones: 6N + 12·L·C·T FLOPs per token (Kaplan et al. 2020, PaLM
appendix B), Chinchilla's 20 tokens per parameter (Hoffmann et al. 2022), and activation memory
counted tensor by tensor for this model's block (Korthikanti et al. 2022 redone for RMSNorm,
GQA, SDPA and SwiGLU: `block_activation_bytes`), per GPU of a TP/CP/PP/FSDP2 layout
(``memory_model.memory``, whose parallel terms live in ``parallel/tp.py``, ``cp.py`` and
``pp.py``). Choosing the layout is `layout_planner`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmflow.model.config import ModelConfig
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.pretrain.memory_model import (  # noqa: F401 (the planner's public terms)
    BUCKET_PADDING,
    FLOAT32,
    GB,
    OPTIMIZER_STATES,
    AttentionExtra,
    MemoryEstimate,
    Shape,
    activation_bytes_per_token,
    attention_extra_bytes,
    block_activation_bytes,
    checkpointed_blocks,
    hidden_matrix_parameters,
    logits_chunk_bytes,
    loss_buffer_bytes,
    memory,
    precision_bytes,
)
from llmflow.tasks.pretrain.parallel.config import Layout

HEADROOM = 0.9
"""Fraction of GPU memory a plan may use; the rest is CUDA context and allocator fragmentation."""
CHINCHILLA_TOKENS_PER_PARAM = 20
NO_STAGE = "no pretraining stage (pretrain.stages is empty)"
"""How plans and preflight name a recipe that post-trains its ``init`` model directly."""


@dataclass
class Plan:
    """What a run costs; `warnings` proposes fixes when it does not fit or looks wrong."""

    num_parameters: int
    num_non_embedding_parameters: int
    flops_per_token: float
    """Model FLOPs per trained token (forward + backward), without recomputation."""
    memory: MemoryEstimate
    chinchilla_tokens: int
    num_tokens: int
    num_steps: int
    grad_accum_steps: int
    estimated_hours: float
    fits: bool
    warnings: list[str] = field(default_factory=list)
    predicted_loss: float | None = None
    """Validation loss from the recipe's fitted scaling law (``llmflow ladder``), if one exists."""
    num_active_parameters: int | None = None
    """The parameters a token goes through (a mixture of experts' top-k); None when all are."""


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6N + 12·L·C·T, N = non-embedding parameters + the output projection (tied or not).

    The input embedding is a lookup, not a matmul, so it is left out of N; the few norm weights
    stay in, as in nanoGPT's MFU estimate. The attention term
    counts QK^T and AV over the full T×T square, as PaLM's MFU convention does. A mixture of
    experts counts the parameters a token goes through (``active_parameters``: its top-k
    experts, not all of them).
    """
    matmul_params = cfg.active_parameters(non_embedding=True) + cfg.vocab_size * cfg.hidden_size
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return 6 * matmul_params + attention


def memory_per_gpu(
    cfg: ModelConfig,
    *,
    seq_len: int,
    micro_batch_size: int,
    num_gpus: int,
    param_dtype_bytes: int,
    optimizer: str,
    fsdp: bool,
    activation_checkpointing: bool | str,
    every_k: int = 2,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    dp_shard: int | None = None,
    dp_replicate: int = 1,
    micro_batches: int = 1,
    pp_schedule: str = "1f1b",
    packed: bool = False,
    device_type: str = "cuda",
    eval_batches: int = 4,
    ep: int = 1,
) -> MemoryEstimate:
    """`memory` from keywords, for the layout ``dp_replicate x dp_shard x cp x tp x pp =
    num_gpus`` (``dp_shard`` defaults to the GPUs the other degrees leave; ``ep`` divides it)."""
    if dp_shard is None:
        dp_shard = max(1, num_gpus // (dp_replicate * tp * cp * pp))
    layout = Layout(dp_replicate, dp_shard, tp, cp, pp, pp_schedule, ep)
    shape = Shape(
        cfg, seq_len, micro_batch_size, param_dtype_bytes, optimizer, activation_checkpointing,
        every_k, micro_batches, fsdp, packed, device_type, eval_batches,
    )  # fmt: skip
    return memory(shape, layout)


def plan(
    model_cfg: ModelConfig,
    *,
    seq_len: int,
    global_batch_tokens: int,
    num_tokens: int,
    num_gpus: int = 1,
    gpu_mem_gb: float = 80,
    mfu: float = 0.4,
    peak_tflops: float = 989,
    param_dtype_bytes: int = 2,
    optimizer: str = "adamw",
    fsdp: bool = True,
    micro_batch_size: int = 1,
    activation_checkpointing: bool | str = False,
    every_k: int = 2,
    layout=None,
    packed: bool = False,
) -> Plan:
    """Estimate a pretraining run and say whether it fits in GPU memory.

    Args:
        model_cfg: the model.
        seq_len: tokens per sequence.
        global_batch_tokens: tokens per optimizer step over all GPUs.
        num_tokens: tokens to train on.
        num_gpus: data-parallel GPUs.
        gpu_mem_gb: memory of one GPU (GB); a plan fits within `HEADROOM` of it.
        mfu: model FLOPs utilization expected.
        peak_tflops: dense peak of one GPU at the training precision (H100 SXM bf16: 989).
        param_dtype_bytes: bytes per parameter, gradient and activation (bf16: 2).
        optimizer: "adamw", "muon" (hidden matrices; AdamW for the rest), "lion" or "sgd".
        fsdp: shard weights, gradients and optimizer states across GPUs (ZeRO-3).
        micro_batch_size: sequences per GPU per forward pass.
        activation_checkpointing: recompute blocks in the backward pass: True or "full" (every
            block), "selective" (every ``every_k``-th block), False or "none".
        every_k: the selective interval.
        layout: a resolved ``parallel.config.Layout`` of the `num_gpus` (None: FSDP over all).
        packed: rows hold several documents (`attention_extra_bytes`: on CUDA their kernels
            keep nothing more than one document's).
    """
    _check_positive(seq_len=seq_len, global_batch_tokens=global_batch_tokens,
                    num_tokens=num_tokens, num_gpus=num_gpus, gpu_mem_gb=gpu_mem_gb, mfu=mfu,
                    peak_tflops=peak_tflops, micro_batch_size=micro_batch_size)  # fmt: skip
    memory_kwargs = dict(
        seq_len=seq_len, micro_batch_size=micro_batch_size, num_gpus=num_gpus,
        param_dtype_bytes=param_dtype_bytes, optimizer=optimizer, fsdp=fsdp,
        activation_checkpointing=activation_checkpointing, every_k=every_k, packed=packed,
    )  # fmt: skip
    if layout is not None and not layout.is_plain:
        memory_kwargs.update(tp=layout.tp, cp=layout.cp, pp=layout.pp, dp_shard=layout.dp_shard,
                             dp_replicate=layout.dp_replicate, pp_schedule=layout.pp_schedule)  # fmt: skip
    memory = memory_per_gpu(model_cfg, **memory_kwargs)
    fits = memory.total_gb <= HEADROOM * gpu_mem_gb
    per_token = flops_per_token(model_cfg, seq_len)
    # NOTE: checkpointing runs a recomputed block's forward twice: 8N instead of 6N of work.
    recomputed = checkpointed_blocks(model_cfg, activation_checkpointing, every_k)
    hardware_flops = per_token * num_tokens * (1 + recomputed / model_cfg.num_layers / 3)
    seconds = hardware_flops / (num_gpus * peak_tflops * 1e12 * mfu)
    data_parallel = layout.dp if layout is not None else num_gpus
    tokens_per_micro_step = micro_batch_size * seq_len * data_parallel
    params = model_cfg.num_parameters()
    result = Plan(
        num_parameters=params,
        num_non_embedding_parameters=model_cfg.num_parameters(non_embedding=True),
        num_active_parameters=(model_cfg.active_parameters() if model_cfg.num_experts else None),
        flops_per_token=per_token,
        memory=memory,
        chinchilla_tokens=CHINCHILLA_TOKENS_PER_PARAM * params,
        num_tokens=num_tokens,
        num_steps=math.ceil(num_tokens / global_batch_tokens),
        grad_accum_steps=max(1, math.ceil(global_batch_tokens / tokens_per_micro_step)),
        estimated_hours=seconds / 3600,
        fits=fits,
    )
    result.warnings = _batch_warnings(model_cfg, result, seq_len, global_batch_tokens,
                                      tokens_per_micro_step)  # fmt: skip
    if not fits:
        result.warnings += _memory_fixes(model_cfg, memory, gpu_mem_gb, memory_kwargs)
    return result


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise BadInputError(f"{name}={value} must be > 0")


def _batch_warnings(
    cfg: ModelConfig, result: Plan, seq_len: int, global_batch_tokens: int, micro_tokens: int
) -> list[str]:
    warnings = []
    if seq_len > cfg.max_seq_len:
        warnings.append(
            f"seq_len={seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}: "
            "raise max_seq_len or extend the context (ABF/YaRN) first"
        )
    if global_batch_tokens % micro_tokens:
        warnings.append(
            f"global_batch_tokens={global_batch_tokens} is not a multiple of micro_batch_size x "
            f"seq_len x num_gpus = {micro_tokens}; each step will use "
            f"{result.grad_accum_steps * micro_tokens} tokens"
        )
    if result.num_tokens < result.chinchilla_tokens / 2:
        warnings.append(
            f"num_tokens={result.num_tokens:.3g} is under half the Chinchilla-optimal "
            f"{result.chinchilla_tokens:.3g} (20 x parameters): the model will be undertrained"
        )
    return warnings


def _memory_fixes(
    cfg: ModelConfig, memory: MemoryEstimate, gpu_mem_gb: float, kwargs: dict
) -> list[str]:
    """Propose the changes that shrink the largest parts, each with its new total."""
    budget = HEADROOM * gpu_mem_gb
    fixes = [f"needs {memory.total_gb:.1f} GB per GPU, over {budget:.1f} GB usable"]

    def total(**changes) -> float:
        return memory_per_gpu(cfg, **{**kwargs, **changes}).total_gb

    if not kwargs["fsdp"] and kwargs["num_gpus"] > 1:
        fixes.append(f"enable fsdp (shard states over {kwargs['num_gpus']} GPUs): "
                     f"{total(fsdp=True):.1f} GB")  # fmt: skip
    sharded = memory.weights_gb + memory.gradients_gb + memory.optimizer_gb
    if sharded > memory.activations_gb:
        for num_gpus in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            if num_gpus > kwargs["num_gpus"] and total(num_gpus=num_gpus, fsdp=True) <= budget:
                fixes.append(f"more sharding: fsdp over num_gpus={num_gpus}: "
                             f"{total(num_gpus=num_gpus, fsdp=True):.1f} GB")  # fmt: skip
                break
    if kwargs["micro_batch_size"] > 1:
        fixes.append(f"smaller micro-batch: micro_batch_size=1 (more gradient accumulation): "
                     f"{total(micro_batch_size=1):.1f} GB")  # fmt: skip
    if checkpointed_blocks(cfg, kwargs["activation_checkpointing"]) < cfg.num_layers:
        fixes.append(f"activation_checkpointing=full (about 33% more compute): "
                     f"{total(activation_checkpointing=True):.1f} GB")  # fmt: skip
    return fixes


def format_plan(p: Plan) -> str:
    """A human-readable summary of a plan, one fact per line."""
    m = p.memory
    lines = [
        f"parameters           {p.num_parameters / 1e6:,.1f}M "
        f"({p.num_non_embedding_parameters / 1e6:,.1f}M non-embedding"
        + (
            f"; {p.num_active_parameters / 1e6:,.1f}M active per token: a mixture of experts)"
            if p.num_active_parameters is not None
            else ")"
        ),
        f"FLOPs per token      {p.flops_per_token:.3e}",
        f"tokens               {p.num_tokens:.3e} (Chinchilla-optimal "
        f"{p.chinchilla_tokens:.3e}, x{p.num_tokens / p.chinchilla_tokens:.2f})",
        f"steps                {p.num_steps:,} (gradient accumulation {p.grad_accum_steps})",
        f"estimated time       {p.estimated_hours:,.2f} h",
        "memory per GPU (GB)  "
        f"weights {m.weights_gb:.2f} + optimizer {m.optimizer_gb:.2f} + activations and "
        f"gradients at their peak {m.peak_live_gb:.2f} (activations {m.activations_gb:.2f}, "
        f"gradients {m.gradients_gb:.2f}) = {m.total_gb:.2f}",
        f"  and beside weights and optimizer: optimizer step {m.optimizer_step_gb:.2f}, "
        f"validation {m.validation_gb:.2f}, checkpoint save {m.checkpoint_gb:.2f} (the total "
        f"takes the largest: {m.peak_gb:.2f})",
        f"fits                 {'yes' if p.fits else 'NO'}",
    ]
    if p.predicted_loss is not None:
        lines.append(f"predicted val loss   {p.predicted_loss:.4f} (fitted scaling law)")
    lines += [f"warning: {w}" for w in p.warnings]
    return "\n".join(lines)


def recipe_plan(
    pretrain,
    hardware,
    *,
    num_gpus: int | None = None,
    gpu_mem_gb: float | None = None,
    mfu: float | None = None,
) -> Plan:
    """The plan of a recipe's pretraining stages on the hardware it declares.

    ``pretrain`` is a ``PretrainConfig`` and ``hardware`` a ``HardwareConfig``; the keyword
    arguments replace the declared GPU count, memory and MFU (``llmflow plan --gpus ...``).

    Raises:
        BadInputError: the recipe has no pretraining stage (``NO_STAGE``): nothing to plan.
    """
    if not pretrain.stages:
        raise BadInputError(f"{NO_STAGE}: no pretraining tokens, steps, time or memory to plan")
    num_gpus = num_gpus or hardware.gpus
    train = pretrain.train
    batch = train.batch
    seq_len = max(s.mixture.seq_len for s in pretrain.stages)
    layout = train.parallel.resolve(num_gpus)  # the recipe's; plain FSDP2 at the default
    return plan(
        pretrain.train.model_config_obj(),
        seq_len=seq_len,
        global_batch_tokens=batch.micro_batch_size * batch.grad_accum_steps * seq_len * layout.dp,
        num_tokens=sum(s.mixture.num_tokens for s in pretrain.stages),
        num_gpus=num_gpus,
        gpu_mem_gb=gpu_mem_gb or hardware.gpu_mem_gb,
        mfu=mfu or hardware.mfu,
        peak_tflops=hardware.peak_tflops,
        param_dtype_bytes=precision_bytes(train),
        micro_batch_size=batch.micro_batch_size,
        optimizer=train.optimizer.name,
        activation_checkpointing=train.activation_checkpointing,
        every_k=train.activation_checkpointing_every_k,
        layout=layout,
        packed=True,  # packed rows hold several documents
    )


def extension_memory(pretrain, extend, hardware, num_gpus: int | None = None) -> list[str]:
    """One line per context-extension stage: its memory per GPU at its length, micro-batch and
    layout (the stage's ``parallel``, else ``pretrain.train.parallel``).

    ``extend`` is an ``ExtendConfig``. A stage over the usable memory gets a warning: long
    sequences need activation checkpointing or context parallelism its layout does not use
    (``llmflow plan`` proposes a layout that fits).
    """
    from llmflow.tasks.extend.config import extension_train_config

    num_gpus = num_gpus or hardware.gpus
    lines = []
    for stage in extend.stages:
        train = extension_train_config(pretrain.train, stage)
        layout = train.parallel.resolve(num_gpus, train.model_config_obj(), stage.seq_len)
        memory = memory_per_gpu(
            train.model_config_obj(), seq_len=stage.seq_len,
            micro_batch_size=stage.micro_batch_size, num_gpus=num_gpus,
            param_dtype_bytes=precision_bytes(train), optimizer=train.optimizer.name, fsdp=True,
            activation_checkpointing=train.activation_checkpointing,
            every_k=train.activation_checkpointing_every_k, tp=layout.tp, cp=layout.cp,
            pp=layout.pp, dp_shard=layout.dp_shard, dp_replicate=layout.dp_replicate,
            micro_batches=train.batch.grad_accum_steps, pp_schedule=layout.pp_schedule,
            packed=True,
        )  # fmt: skip
        fits = memory.total_gb <= HEADROOM * hardware.gpu_mem_gb
        where = "" if layout.is_plain else f" at tp={layout.tp} cp={layout.cp} pp={layout.pp}"
        lines.append(
            f"extension ctx{stage.seq_len:<7} {memory.total_gb:,.1f} GB per GPU{where} "
            f"(activations {memory.activations_gb:,.1f}): "
            + ("fits" if fits else "does NOT fit: needs activation checkpointing or context "
               "parallelism (`llmflow plan` proposes a layout), or a shorter seq_len")
        )  # fmt: skip
    return lines
