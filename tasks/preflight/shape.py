"""The rehearsal's shape: its planned memory per rank on this machine, the recipe's sequence
length and micro-batch scaled down until that plan fits this host, and the settings that would
fit after a rank ran out of memory."""

from __future__ import annotations

from llmflow.tasks.preflight.memory import host_memory_per_rank_gb
from llmflow.tasks.preflight.report import PreflightOptions, Report, timed

HOST_MEMORY_SHARE = 0.7
"""Share of the memory available per rank that a rehearsal scaled to this host may plan to use
(the rest: the runtime, about 0.35 GB per CPU rank, and the plan's error)."""
RUNTIME_GB = 0.5
"""Memory per CPU rank that no plan counts (Python, torch, the process group: 0.35 GB measured)."""
MIN_SCALED_SEQ_LEN = 64
"""The shortest sequence a rehearsal is scaled down to."""


def rehearsal_plan_gb(
    config, seq_len: int, micro: int, ranks: int, activation_checkpointing: str | None = None
) -> float:
    """The plan's memory per rank of the test steps, at the recipe's precision on this machine
    (``auto``: bf16 on a GPU, float32 on a CPU)."""
    import torch

    from llmflow.tasks.pretrain.planner import memory_per_gpu, precision_bytes

    train = config.pretrain.train  # the test steps' own optimizer, checkpointing and precision
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return memory_per_gpu(
        train.model_config_obj(), seq_len=seq_len, micro_batch_size=micro, num_gpus=ranks,
        param_dtype_bytes=precision_bytes(train, device), optimizer=train.optimizer.name,
        fsdp=ranks > 1, activation_checkpointing=activation_checkpointing or train.activation_checkpointing,
        every_k=train.activation_checkpointing_every_k, device_type=device,
    ).total_gb  # fmt: skip


def rehearsal_shape(report: Report, config, options: PreflightOptions) -> tuple[int, int]:
    """The test steps' sequence length and micro-batch: as asked, else the recipe's, scaled down
    (micro-batch first, then sequence length, halving) until the plan fits this host.

    Adds a "rehearsal shape" row saying what was scaled, or that an asked shape is over.
    """
    import torch

    ranks = options.processes
    recipe_seq = max(s.mixture.seq_len for s in config.pretrain.stages)
    recipe_micro = config.pretrain.train.batch.micro_batch_size
    seq, micro = options.seq_len or recipe_seq, options.micro_batch_size or recipe_micro
    with timed(report, "rehearsal shape") as row:
        budget, where = (
            (options.host_memory_gb, "as given")
            if options.host_memory_gb
            else host_memory_per_rank_gb(ranks)
        )
        runtime = 0.0 if torch.cuda.is_available() else RUNTIME_GB
        usable = HOST_MEMORY_SHARE * budget

        def need(seq_len: int, micro_batch: int) -> float:
            return rehearsal_plan_gb(config, seq_len, micro_batch, ranks) + runtime

        asked = need(seq, micro)
        while need(seq, micro) > usable and options.micro_batch_size is None and micro > 1:
            micro //= 2
        while need(seq, micro) > usable and options.seq_len is None and seq > MIN_SCALED_SEQ_LEN:
            seq = max(MIN_SCALED_SEQ_LEN, seq // 2)
        plan = f"plan {need(seq, micro) - runtime:.2f} GB per rank"
        here = f"{usable:.1f} GB usable per rank here ({where}, x{HOST_MEMORY_SHARE:g})"
        scaled = [f"{name} {old} -> {new}" for name, old, new in
                  (("micro-batch", options.micro_batch_size or recipe_micro, micro),
                   ("seq", options.seq_len or recipe_seq, seq)) if old != new]  # fmt: skip
        report.numbers["host"] = {"memory_per_rank_gb": budget, "usable_gb": usable,
                                  "asked_plan_gb": asked - runtime, "scaled": scaled}  # fmt: skip
        if scaled:
            row["detail"] = (f"scaled to this host: {', '.join(scaled)} ({plan}; the asked shape "
                             f"plans {asked - runtime:.2f} GB, {here})")  # fmt: skip
        else:
            row["detail"] = f"seq {seq} x micro {micro} on {ranks} ranks: {plan}, {here}"
        if need(seq, micro) > usable:
            row["detail"] += "; over it: the test steps may run out of memory"
    return seq, micro


def memory_fixes(config, seq: int, micro: int, ranks: int, usable_gb: float | None) -> list[str]:
    """The settings that shrink the rehearsal's memory, each with its plan per rank."""
    train = config.pretrain.train
    fixes = []
    if micro > 1:
        fixes.append(f"--micro-batch-size 1 ({rehearsal_plan_gb(config, seq, 1, ranks):.2f} GB)")
    if train.activation_checkpointing != "full":
        full = rehearsal_plan_gb(config, seq, micro, ranks, "full")
        fixes.append(f"pretrain.train.activation_checkpointing=full ({full:.2f} GB)")
    shorter = seq // 2
    limit = (usable_gb or 0) - RUNTIME_GB
    while shorter > MIN_SCALED_SEQ_LEN and rehearsal_plan_gb(config, shorter, 1, ranks) > limit:
        shorter //= 2
    if MIN_SCALED_SEQ_LEN <= shorter < seq:
        fixes.append(f"--seq-len {shorter} ({rehearsal_plan_gb(config, shorter, 1, ranks):.2f} GB "
                     "at micro-batch 1)")  # fmt: skip
    return fixes
