"""The layout rehearsal, preflight's step (8): the parallel layouts ``llmflow plan`` gives the
recipe's stages (tensor, context and pipeline parallelism), run through the trainer at a tiny
width on CPU ranks, each against the same steps with data parallelism alone.

A stage planned at ``tp=2 x cp=8`` on the cluster is rehearsed at ``tp=2 x cp=2``: every degree
above 1 becomes 2, and a layout of 2 ranks gets ``dp_shard=2`` too (4 processes at most, so
TP, CP and PP each meet FSDP2). The reference run has the same data-parallel ranks, micro-batch
and accumulation, so each rank reads the same rows; only the model-parallel split differs, and
the losses must agree to ``LOSS_TOLERANCE``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.preflight.report import PreflightOptions, Report, timed

TINY_WIDTH = {"vocab_size": 512, "hidden_size": 64, "num_layers": 4, "num_heads": 4,
              "num_kv_heads": 2, "intermediate_size": 128}  # fmt: skip
"""The recipe's architecture (NoPE layers, tying, QK-norm...) at a width 2 ranks divide."""
SEQ_LEN, MICRO_BATCH, GRAD_ACCUM, STEPS = 64, 2, 2, 2
"""The rehearsal's shape: 2 micro-batches per step (PP needs as many as its stages)."""
LOSS_TOLERANCE = 1e-4
"""Largest relative difference of a step's loss from the data-parallel run's for a "go"
(float32 on CPU; the parallel tests measure under 1e-5)."""
MAX_PROCESSES = 4
ALL_LAYOUTS = ({"tp": 2, "dp_shard": 2}, {"cp": 2, "dp_shard": 1}, {"pp": 2, "dp_shard": 1})
"""``layouts="all"``: each parallelism once, as the trainer's own tests run them."""


def rehearsal_layouts(config, mode: str) -> list[dict]:
    """The layouts to rehearse: ``plan`` those of the recipe's stage plans that use model or
    expert parallelism, scaled to degree 2; ``all`` each of TP, CP, PP; ``none`` none."""
    if mode == "none":
        return []
    if mode == "all":
        return [dict(layout) for layout in ALL_LAYOUTS]
    from llmflow.tasks.pretrain.layout_planner import stage_layout_plans

    found: list[dict] = []
    for _, _, plan in stage_layout_plans(config.pretrain, config.extend, config.hardware):
        layout = plan.layout
        degrees = {k: min(getattr(layout, k), 2) for k in ("tp", "cp", "pp")}
        degrees = {k: v for k, v in degrees.items() if v > 1}
        if layout.ep > 1:  # EP is carved from dp_shard: ep=2 of dp_shard=2
            degrees["ep"] = 2
        if not degrees:
            continue
        model_ranks = 2 ** len([k for k in degrees if k != "ep"])
        degrees["dp_shard"] = 2 if model_ranks * 2 <= MAX_PROCESSES or "ep" in degrees else 1
        if layout.pp > 1:
            degrees["pp_schedule"] = layout.pp_schedule
        if degrees not in found:
            found.append(degrees)
    return found


def layout_name(degrees: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in degrees.items() if k != "pp_schedule")


def world_size(degrees: dict) -> int:
    size = 1
    for key in ("tp", "cp", "pp", "dp_shard", "dp_replicate"):
        size *= degrees.get(key, 1)
    return size


def rehearse_layouts(
    report: Report,
    config,
    options: PreflightOptions,
    work: Path,
    log: Callable[[str], Any],
) -> None:
    """(8) One row per layout: its losses against data parallelism alone at the same batch."""
    from llmflow.tasks.preflight.rehearsal import RehearsalLauncher, random_packed
    from llmflow.tasks.pretrain.launch import TrainingFailed

    layouts = rehearsal_layouts(config, options.layouts)
    if not layouts:
        return
    train = tiny_train_config(config)
    rows = (STEPS + 2) * MICRO_BATCH * GRAD_ACCUM * MAX_PROCESSES
    data = random_packed(work / "layout-data", vocab=TINY_WIDTH["vocab_size"], seq_len=SEQ_LEN,
                         rows=rows, seed=0)  # fmt: skip
    references: dict[int, dict[int, float]] = {}
    for degrees in layouts:
        name = layout_name(degrees)
        with timed(report, f"layout {name}") as row:
            ranks, dp = world_size(degrees), degrees.get("dp_shard", 1)
            check = _unsupported(train, degrees, ranks)
            if check:
                row.update(go=False, detail=f"skipped: {check}")
                continue
            try:
                if dp not in references:
                    launch = RehearsalLauncher(dp, options.timeout_s, log)
                    references[dp] = _losses(launch, train, data, work / f"layout-dp{dp}")
                launch = RehearsalLauncher(ranks, options.timeout_s, log)
                layout_train = train.replaced(parallel=degrees)
                losses = _losses(launch, layout_train, data, work / f"layout-{_slug(degrees)}")
            except (TrainingFailed, BadInputError) as err:  # the trainer's own error line
                row.update(go=False, detail=_failure(err))
                continue
            row.update(**_compare(losses, references[dp], ranks, dp))
            report.numbers.setdefault("layouts", {})[name] = {
                "losses": losses,
                "reference": references[dp],
                "processes": ranks,
            }


def tiny_train_config(config):
    """Stage 1's trainer config at ``TINY_WIDTH`` and the rehearsal's shape."""
    from llmflow.tasks.preflight.rehearsal import steps_train_config

    tiny = {**TINY_WIDTH, "max_seq_len": SEQ_LEN}
    small = config.pretrain.train.replaced(model={"overrides": tiny})
    cfg = config.model_copy(
        update={"pretrain": config.pretrain.model_copy(update={"train": small})}
    )
    train = steps_train_config(cfg, SEQ_LEN, MICRO_BATCH, STEPS)
    return train.replaced(batch={"grad_accum_steps": GRAD_ACCUM}, compile=False)


def _unsupported(train, degrees: dict, ranks: int) -> str | None:
    """Why the trainer would refuse this layout here (``support.check_layout``, naming the
    field), or None."""
    from llmflow.tasks.framework.errors import ConfigError
    from llmflow.tasks.pretrain.parallel.config import ParallelConfig

    try:
        ParallelConfig(**degrees).resolve(
            ranks, train.model_config_obj(), SEQ_LEN, GRAD_ACCUM,
            optimizer=train.optimizer.name, compile=train.compile,
        )  # fmt: skip
    except ConfigError as err:
        return str(err)
    return None


def _losses(launch, train, data: Path, out: Path) -> dict[int, float]:
    from llmflow.tasks.preflight.rehearsal import run_losses

    launch(train, data, out)
    return run_losses(out)


def _compare(losses: dict, reference: dict, ranks: int, dp: int) -> dict:
    steps = sorted(reference)
    if sorted(losses) != steps:
        return {"go": False, "detail": f"logged steps {sorted(losses)}, expected {steps}"}
    worst = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in steps)
    shown = ", ".join(f"{losses[s]:.5f}" for s in steps)
    return {
        "go": worst <= LOSS_TOLERANCE,
        "detail": f"{ranks} ranks, losses {shown}; against {dp} data-parallel rank(s): worst "
        f"relative difference {worst:.1e} (tolerance {LOSS_TOLERANCE:.0e})",
    }


def _failure(err: Exception) -> str:
    from llmflow.tasks.preflight.rehearsal import last_error

    tail = getattr(err, "tail", None) or []
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return f"the trainer failed: {first}" + (f": {last_error(tail)}" if tail else "")


def _slug(degrees: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in degrees.items())
