"""Learning-rate schedules and batch-size warmup, as pure functions of the global step.

Being stateless in the step is what makes them continuable: stage k of a curriculum starts at the
global step where stage k-1 stopped and gets the same multiplier the uninterrupted run would.
"""

from __future__ import annotations

import bisect
import math

from llmflow.tasks.pretrain.config import BatchConfig, ScheduleConfig


def lr_multiplier(step: int, cfg: ScheduleConfig, total_steps: int) -> float:
    """Return the LR as a fraction of the peak for the update made at global ``step`` (0-based).

    Args:
        step: Global optimizer step (counts across curriculum stages).
        cfg: Schedule configuration.
        total_steps: Steps of the whole run (``cfg.total_steps`` or the stage's end).
    """
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if cfg.name == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.name == "multistep":
        drops = bisect.bisect_right([m * total_steps for m in cfg.milestones], step)
        return cfg.gamma**drops
    if cfg.name == "wsd":
        return _wsd(step, cfg, total_steps)
    span = max(total_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    if cfg.name == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 - (1 - floor) * progress  # linear


def _wsd(step: int, cfg: ScheduleConfig, total_steps: int) -> float:
    """Warmup-stable-decay: flat at the peak, then decay to the floor over the last share."""
    decay_steps = max(round(cfg.decay_fraction * total_steps), 1)
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)
    if cfg.decay_shape == "cosine":
        shape = 0.5 * (1 + math.cos(math.pi * progress))
    elif cfg.decay_shape == "sqrt":
        shape = 1 - math.sqrt(progress)
    else:
        shape = 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def micro_batch_size(step: int, cfg: BatchConfig) -> int:
    """Return the per-process micro-batch for ``step`` under batch-size warmup (linear ramp).

    The step counts from the start of the run's first stage, so a later stage keeps full size.
    """
    start = cfg.warmup_start_micro_batch
    if start is None or cfg.warmup_steps == 0 or step >= cfg.warmup_steps:
        return cfg.micro_batch_size
    return start + (cfg.micro_batch_size - start) * step // cfg.warmup_steps


def steps_for_tokens(
    num_tokens: int, cfg: BatchConfig, seq_len: int, world_size: int, start_step: int = 0
) -> int:
    """Return how many optimizer steps from ``start_step`` it takes to see ``num_tokens``."""
    steps, seen = 0, 0
    while seen < num_tokens:
        per_step = micro_batch_size(start_step + steps, cfg) * cfg.grad_accum_steps
        if start_step + steps >= cfg.warmup_steps:  # closed form once the ramp is over
            remaining = num_tokens - seen
            return steps + math.ceil(remaining / (per_step * seq_len * world_size))
        seen += per_step * seq_len * world_size
        steps += 1
    return steps
