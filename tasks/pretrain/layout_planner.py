"""Choosing the parallel layout of each stage: TP, CP, PP and data parallelism, micro-batch,
gradient accumulation and activation checkpointing, so that the stage fits its GPUs and keeps
the recipe's global batch (``llmflow plan``).

A stage's memory per GPU is ``memory_model.memory`` at the layout; its cost is its step time
estimated from the model FLOPs, the recomputation, the pipeline bubble and the TP/CP traffic
that the step cannot hide (the FSDP and pipeline sends are assumed overlapped with compute).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmflow.model.config import ModelConfig
from llmflow.tasks.framework.errors import ConfigError
from llmflow.tasks.pretrain.memory_model import (
    GB,
    MemoryEstimate,
    Shape,
    checkpointed_blocks,
    memory,
)
from llmflow.tasks.pretrain.parallel import cp as parallel_cp
from llmflow.tasks.pretrain.parallel import ep as parallel_ep
from llmflow.tasks.pretrain.parallel import pp as parallel_pp
from llmflow.tasks.pretrain.parallel import tp as parallel_tp
from llmflow.tasks.pretrain.parallel.config import Layout, ParallelConfig
from llmflow.tasks.pretrain.parallel.pp import bubble_fraction
from llmflow.tasks.pretrain.parallel.support import StageShape, check_layout, recipe_stages
from llmflow.tasks.pretrain.planner import HEADROOM, flops_per_token

INTRA_NODE_GBPS = 360.0
"""Bus bandwidth of one GPU's collectives inside a node, GB/s (NCCL all-gather on H100 NVLink 4
reaches about 360 of the 450 GB/s per direction)."""
INTER_NODE_GBPS = 45.0
"""Bus bandwidth of one GPU's collectives across nodes, GB/s (one 400 Gb/s NIC per GPU)."""
CHECKPOINTING = ("none", "selective", "full")
"""Activation checkpointing from the cheapest in compute to the smallest in memory."""
MAX_CP = 32
"""The largest context-parallel degree the planner tries."""
PARALLEL_FIELD = "pretrain.train.parallel"


@dataclass
class Communication:
    """Bytes one GPU sends per optimizer step, by parallelism (ring collectives move
    (n-1)/n of the tensor per GPU), GB."""

    tp_gb: float = 0.0
    """TP + SP: 4 all-gathers/reduce-scatters of b·(s/cp)·h per layer forward, 4 backward."""
    cp_gb: float = 0.0
    """CP: all-gather of K and V per layer forward (again for a recomputed layer), the
    reduce-scatter of their gradients backward."""
    fsdp_gb: float = 0.0
    """FSDP2: parameter all-gathers (forward and backward of each micro-batch), gradient
    reduce-scatter in float32 once per step, HSDP's all-reduce across replicas."""
    pp_gb: float = 0.0
    """PP: activations forward and their gradients backward per micro-batch per boundary."""
    ep_gb: float = 0.0
    """EP: the routed rows to their experts' ranks and back, forward and backward (2
    all-to-alls each way per sparse layer)."""


@dataclass
class LayoutPlan:
    """One stage's layout, batch split, checkpointing, memory, bubble and traffic."""

    layout: Layout
    micro_batch_size: int
    grad_accum_steps: int
    activation_checkpointing: str
    memory: MemoryEstimate
    usable_gb: float
    bubble: float
    """Pipeline bubble: (pp - 1) / micro-batches, the idle share of a step (Narayanan 2021)."""
    communication: Communication
    step_seconds: float
    """Estimated step time: compute (recomputation included), bubble, unhidden TP/CP traffic."""
    compute_seconds: float
    fixed: dict = field(default_factory=dict)
    """The degrees the user or the recipe set (the rest were chosen)."""

    @property
    def fits(self) -> bool:
        return self.memory.total_gb <= self.usable_gb

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro-batch x accumulation x data parallelism."""
        return self.micro_batch_size * self.grad_accum_steps * self.layout.dp


def communication(
    cfg: ModelConfig,
    layout: Layout,
    *,
    seq_len: int,
    micro_batch_size: int,
    micro_batches: int,
    activation_bytes: int,
    activation_checkpointing: str = "none",
    every_k: int = 2,
) -> Communication:
    """Bytes one GPU sends per optimizer step for each parallelism of ``layout``.

    Recomputed blocks repeat their forward collectives in the backward pass.
    """
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    blocks = parallel_pp.stage_blocks(cfg.num_layers, pp)
    recomputed = checkpointed_blocks(cfg, activation_checkpointing, every_k) / cfg.num_layers
    tokens = micro_batch_size * seq_len / cp  # per rank per micro-batch
    residual = tokens * cfg.hidden_size * activation_bytes  # b·(s/cp)·h
    tp_bytes = parallel_tp.traffic_bytes(
        residual, tp=tp, blocks=blocks, micro_batches=micro_batches, recomputed=recomputed
    )
    cp_bytes = parallel_cp.traffic_bytes(
        cfg, seq_len=seq_len, micro_batch_size=micro_batch_size, micro_batches=micro_batches,
        activation_bytes=activation_bytes, tp=tp, cp=cp, blocks=blocks, recomputed=recomputed,
    )  # fmt: skip
    shards = layout.dp_shard * cp
    per_block = (cfg.num_parameters(non_embedding=True) - cfg.hidden_size) / cfg.num_layers
    params = (blocks * per_block + cfg.vocab_size * cfg.hidden_size) / tp
    fsdp_bytes = params * (2 * micro_batches * activation_bytes + 4) * (shards - 1) / shards
    r = layout.dp_replicate
    fsdp_bytes += 2 * params / shards * 4 * (r - 1) / r
    if layout.ep > 1:  # the experts are gathered over dp_shard_mod_ep only (E/ep of them)
        experts = parallel_ep.expert_parameters(cfg) / tp
        mod = layout.dp_shard_mod_ep * cp
        fsdp_bytes -= experts * (2 * micro_batches * activation_bytes + 4) * (shards - 1) / shards
        fsdp_bytes += (
            experts / layout.ep * (2 * micro_batches * activation_bytes + 4) * ((mod - 1) / mod)
        )
    pp_bytes = parallel_pp.traffic_bytes(residual, tp=tp, pp=pp, micro_batches=micro_batches)
    ep_bytes = parallel_ep.traffic_bytes(
        cfg, tokens * micro_batches, layout.ep, activation_bytes, recomputed
    )
    return Communication(
        tp_bytes / GB, cp_bytes / GB, fsdp_bytes / GB, pp_bytes / GB, ep_bytes / GB
    )


def _traffic_seconds(layout: Layout, comm: Communication, hardware) -> float:
    """Seconds of TP, CP and EP traffic, each at the bandwidth of the link it crosses (the EP
    ranks are neighbours: inside a node while ep fits in one)."""
    inside = layout.tp * layout.cp <= hardware.gpus_per_node
    bandwidth = INTRA_NODE_GBPS if inside else INTER_NODE_GBPS
    tp_bandwidth = INTRA_NODE_GBPS if layout.tp <= hardware.gpus_per_node else INTER_NODE_GBPS
    seconds = comm.tp_gb / tp_bandwidth + comm.cp_gb / bandwidth
    if comm.ep_gb:
        ep_inside = layout.ep * layout.tp * layout.cp <= hardware.gpus_per_node
        seconds += comm.ep_gb / (INTRA_NODE_GBPS if ep_inside else INTER_NODE_GBPS)
    return seconds


def step_seconds(
    cfg: ModelConfig,
    layout: Layout,
    comm: Communication,
    *,
    seq_len: int,
    global_batch: int,
    micro_batches: int,
    hardware,
    activation_checkpointing: str,
    every_k: int,
) -> tuple[float, float]:
    """(step time, compute time) of one GPU, seconds. The model FLOPs of the global batch split
    over every GPU at the hardware's MFU, plus a third of a block's forward and backward for
    each recomputed block, plus the bubble, plus the TP and CP traffic at the bandwidth of the
    link it crosses (inside a node while tp x cp fits in one); for a mixture of experts, the
    FSDP2 traffic that outlasts the compute."""
    flops = flops_per_token(cfg, seq_len) * global_batch * seq_len / layout.world_size
    recomputed = checkpointed_blocks(cfg, activation_checkpointing, every_k) / cfg.num_layers
    compute = flops * (1 + recomputed / 3) / (hardware.peak_tflops * 1e12 * hardware.mfu)
    traffic = _traffic_seconds(layout, comm, hardware)
    if cfg.num_experts:
        # NOTE: a mixture of experts computes top-k experts but FSDP2 gathers all of a block's
        # (E/ep under EP): its traffic can outlast the compute it overlaps; the excess counts.
        inside = layout.world_size <= hardware.gpus_per_node
        fsdp = comm.fsdp_gb / (INTRA_NODE_GBPS if inside else INTER_NODE_GBPS)
        traffic += max(0.0, fsdp - compute)
    bubble = compute * bubble_fraction(layout.pp, micro_batches)
    return compute + bubble + traffic, compute


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(limit, 1))) + 1)]


def _divisors_descending(n: int, cap: int) -> list[int]:
    return [d for d in range(min(n, cap), 0, -1) if n % d == 0]


def _parallel_item(text: str, item: str) -> tuple[str, int | str]:
    """One ``NAME=VALUE`` item of ``--parallel`` as a ParallelConfig field and its value."""
    name, sep, value = item.partition("=")
    name = name.strip()
    if not sep or not value.strip():
        raise ConfigError(f"--parallel {text!r}: {item!r} is not NAME=VALUE (e.g. tp=2,cp=4)")
    if name not in ParallelConfig.model_fields:
        raise ConfigError(
            f"--parallel: {PARALLEL_FIELD}.{name} is not a field; "
            f"one of {sorted(ParallelConfig.model_fields)}"
        )
    return name, value.strip() if name == "pp_schedule" else _integer(name, value)


def parse_parallel(text: str) -> dict:
    """``tp=2,cp=4,pp=1`` (``llmflow plan --parallel``) as ParallelConfig fields, checked.

    Raises:
        ConfigError: a malformed item, an unknown field or a bad value, naming the field.
    """
    values: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, value = _parallel_item(text, item)
        values[name] = value
    try:
        ParallelConfig(**values)
    except ValueError as err:  # pydantic's ValidationError
        bad = ", ".join(f"{PARALLEL_FIELD}.{e['loc'][0]}={e['input']!r}: {e['msg']}"
                        for e in err.errors())  # fmt: skip
        raise ConfigError(f"--parallel: {bad}") from None
    return values


def _integer(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"--parallel: {PARALLEL_FIELD}.{name}={value.strip()!r} is not an integer"
        ) from None


def configured_degrees(parallel: ParallelConfig) -> dict:
    """The degrees a recipe's ``parallel`` sets: none at the default (plain FSDP2 over every
    GPU: the planner chooses), all of them otherwise (``dp_shard: -1`` stays the rest)."""
    if parallel == ParallelConfig():
        return {}
    values = parallel.model_dump()
    if values["dp_shard"] == -1:
        del values["dp_shard"]
    if values["ep"] == 1:  # NOTE: a dense recipe's degrees read as before EP existed
        del values["ep"]
    return values


def choose_layout(
    model: ModelConfig,
    seq_len: int,
    micro_batch: int,
    hardware,
    *,
    global_batch: int,
    param_dtype_bytes: int = 2,
    optimizer: str = "adamw",
    compile: bool = False,
    activation_checkpointing: str = "none",
    every_k: int = 2,
    fixed: dict | None = None,
    num_gpus: int | None = None,
    gpu_mem_gb: float | None = None,
) -> LayoutPlan:
    """The cheapest layout that fits, Megatron-style.

    Candidates: tp a power of two up to ``gpus_per_node`` (TP stays inside a node), cp one up
    to ``MAX_CP``, pp one up to the layers, dp_shard the GPUs left, which must divide
    ``global_batch`` (sequences per step, kept: micro-batch x accumulation x dp); the
    micro-batch at most ``micro_batch``; checkpointing the recipe's or stronger (selective,
    then full). Only layouts the trainer runs are candidates: `support.check_layout` with the
    model, ``optimizer``, ``compile``, ``seq_len`` and the accumulation decides (tp dividing
    the heads, cp dividing the sequence, pp micro-batches, no cp with pp, ...).

    Each candidate's memory is ``memory_model.memory``; among those within ``HEADROOM`` of the GPU,
    the one with the shortest `step_seconds` wins: its cost grows with tp (traffic per layer),
    cp, pp (bubble) and recomputation, so tp grows first, as far as the layer needs to fit,
    then cp or pp, and checkpointing comes in where it costs less than more model
    parallelism. Ties go to less model parallelism and larger micro-batches. When nothing
    fits, the candidate needing the least memory is returned (``fits`` False).

    ``fixed`` holds degrees the user or the recipe set (``--parallel``,
    ``pretrain.train.parallel``); they are checked by `ParallelConfig.resolve`, which names a
    bad field (the same rule).

    Raises:
        ConfigError: a fixed layout does not fit the world size, the model or the sequence,
            or no layout keeps ``global_batch`` on these GPUs.
    """
    fixed = dict(fixed or {})
    world = num_gpus or hardware.gpus
    usable = HEADROOM * (gpu_mem_gb or hardware.gpu_mem_gb)
    support = dict(optimizer=optimizer, compile=compile)
    if fixed:  # a fixed layout that cannot work fails here, naming the field
        ParallelConfig(**fixed).resolve(world, model, seq_len, **support)
    tps = [fixed["tp"]] if "tp" in fixed else _powers_of_two(hardware.gpus_per_node)
    cps = [fixed["cp"]] if "cp" in fixed else _powers_of_two(MAX_CP)
    pps = [fixed["pp"]] if "pp" in fixed else _powers_of_two(model.num_layers)
    replicate = fixed.get("dp_replicate", 1)
    schedule = fixed.get("pp_schedule", "1f1b")
    eps = [fixed["ep"]] if "ep" in fixed else _expert_degrees(model, world)
    start = CHECKPOINTING.index(activation_checkpointing)
    ladder = CHECKPOINTING[start:]
    best, smallest = None, None
    for tp in tps:
        for cp in cps:
            for pp in pps:
                rest = world // (replicate * tp * cp * pp)
                if rest * replicate * tp * cp * pp != world:
                    continue
                if fixed.get("dp_shard", rest) != rest or global_batch % (rest * replicate):
                    continue
                for ep in eps:
                    if rest % ep:
                        continue
                    layout = Layout(replicate, rest, tp, cp, pp, schedule, ep)
                    per_rank = global_batch // layout.dp
                    for micro in _divisors_descending(per_rank, micro_batch):
                        accum = per_rank // micro
                        if not _supported(layout, model, StageShape(seq_len, accum), support):
                            continue
                        for ac in ladder:
                            plan = _evaluate(model, layout, seq_len, micro, accum, ac, hardware,
                                             param_dtype_bytes, optimizer, every_k, usable,
                                             fixed)  # fmt: skip
                            key = (plan.step_seconds, tp * cp * pp * ep, -micro)
                            if plan.fits and (best is None or key < best[0]):
                                best = (key, plan)
                            if smallest is None or (
                                plan.memory.total_gb < smallest.memory.total_gb
                            ):
                                smallest = plan
    if smallest is None:
        raise ConfigError(
            f"{PARALLEL_FIELD}: no layout of {world} GPUs {fixed or ''} that the trainer runs "
            f"keeps the global batch of {global_batch} sequences (micro-batch x accumulation x "
            f"dp) at seq_len {seq_len}"
        )
    return best[1] if best else smallest


def _expert_degrees(model: ModelConfig, world: int) -> list[int]:
    """The EP degrees tried: 1, and for a mixture of experts the powers of two dividing the
    experts, up to the world size."""
    if not model.num_experts:
        return [1]
    return [e for e in _powers_of_two(world) if model.num_experts % e == 0]


def _supported(layout: Layout, model: ModelConfig, stage: StageShape, support: dict) -> bool:
    """Whether the trainer runs ``layout`` (``support.check_layout``, the trainer's own rule)."""
    try:
        check_layout(layout, model, stages=[stage], **support)
    except ConfigError:
        return False
    return True


def _evaluate(model, layout, seq_len, micro, accum, ac, hardware, param_dtype_bytes, optimizer,
              every_k, usable, fixed) -> LayoutPlan:  # fmt: skip
    shape = Shape(model, seq_len, micro, param_dtype_bytes, optimizer, ac, every_k,
                  micro_batches=accum, packed=True)  # fmt: skip
    estimate = memory(shape, layout)
    comm = communication(model, layout, seq_len=seq_len, micro_batch_size=micro,
                         micro_batches=accum, activation_bytes=param_dtype_bytes,
                         activation_checkpointing=ac, every_k=every_k)  # fmt: skip
    seconds, compute = step_seconds(
        model, layout, comm, seq_len=seq_len, global_batch=micro * accum * layout.dp,
        micro_batches=accum, hardware=hardware, activation_checkpointing=ac, every_k=every_k,
    )  # fmt: skip
    return LayoutPlan(layout, micro, accum, ac, estimate, usable, bubble_fraction(layout.pp, accum),
                      comm, seconds, compute, fixed)  # fmt: skip


def layout_text(layout: Layout) -> str:
    """``tp=2 cp=4 pp=1 dp_shard=36 dp_replicate=1``, and the schedule when pp > 1."""
    text = (f"tp={layout.tp} cp={layout.cp} pp={layout.pp} dp_shard={layout.dp_shard} "
            f"dp_replicate={layout.dp_replicate}")  # fmt: skip
    text += f" ep={layout.ep}" if layout.ep > 1 else ""
    return text + (f" ({layout.pp_schedule})" if layout.pp > 1 else "")


def format_layout_plan(name: str, seq_len: int, p: LayoutPlan) -> list[str]:
    """Three lines: the layout and batch, the memory per GPU, the bubble and traffic."""
    m, c = p.memory, p.communication
    if {"tp", "cp", "pp"} <= set(p.fixed):
        source = "set"
    elif p.fixed:
        source = "chosen around " + ",".join(f"{k}={v}" for k, v in p.fixed.items())
    else:
        source = "chosen"
    hidden = 1 - p.compute_seconds / p.step_seconds if p.step_seconds else 0.0
    return [
        f"{name:<14} ctx {seq_len:<7} {layout_text(p.layout)} ({source}); micro-batch "
        f"{p.micro_batch_size} x accumulation {p.grad_accum_steps} x dp {p.layout.dp} = "
        f"{p.global_batch} sequences; activation_checkpointing {p.activation_checkpointing}",
        f"{'':<14} memory per GPU (GB) weights {m.weights_gb:.2f} + gradients "
        f"{m.gradients_gb:.2f} + optimizer {m.optimizer_gb:.2f} + activations "
        f"{m.activations_gb:.2f}: {m.total_gb:.1f} at the peak, of {p.usable_gb:.1f} usable: "
        + ("fits" if p.fits else "does NOT fit"),
        f"{'':<14} bubble {p.bubble:.1%}; per step per GPU: TP {c.tp_gb:.1f} GB, CP "
        f"{c.cp_gb:.1f} GB, FSDP {c.fsdp_gb:.1f} GB, PP {c.pp_gb:.2f} GB"
        + (f", EP {c.ep_gb:.1f} GB" if c.ep_gb else "")
        + f"; step ~{p.step_seconds:.2f} s ({hidden:.1%} bubble and unhidden "
        + ("TP/CP/EP" if c.ep_gb else "TP/CP")
        + " traffic)",
    ]


def stage_layout_plans(
    pretrain,
    extend,
    hardware,
    *,
    parallel: dict | None = None,
    num_gpus: int | None = None,
    gpu_mem_gb: float | None = None,
) -> list[tuple[str, int, LayoutPlan]]:
    """(name, seq_len, plan) of each pretraining stage and each context-extension stage.

    A stage keeps the global batch its trainer config makes with the recipe's own layout
    (``micro_batch_size x grad_accum_steps x dp``); its layout is chosen around the degrees
    ``parallel`` (``llmflow plan --parallel``) or, without it, the stage's configured ones
    (``pretrain.train.parallel``, an extension stage's ``parallel``) when they are not the
    default. ``pretrain`` is a ``PretrainConfig``, ``extend`` an ``ExtendConfig``.
    """
    from llmflow.tasks.pretrain.planner import precision_bytes

    world = num_gpus or hardware.gpus
    plans = []
    for stage in recipe_stages(pretrain, extend):
        train, batch, seq_len = stage.train, stage.train.batch, stage.shape.seq_len
        recipe_dp = train.parallel.resolve(world).dp
        plans.append((stage.name, seq_len, choose_layout(
            train.model_config_obj(), seq_len, batch.micro_batch_size, hardware,
            global_batch=batch.micro_batch_size * batch.grad_accum_steps * recipe_dp,
            param_dtype_bytes=precision_bytes(train), optimizer=train.optimizer.name,
            compile=train.compile, activation_checkpointing=train.activation_checkpointing,
            every_k=train.activation_checkpointing_every_k,
            fixed=parallel if parallel is not None else configured_degrees(train.parallel),
            num_gpus=world, gpu_mem_gb=gpu_mem_gb,
        )))  # fmt: skip
    return plans
