"""How a command reads its recipe: ``CONFIG``, ``--set``, and the command's flags as
shorthands for recipe fields (`SHORTHANDS`)."""

from __future__ import annotations

import argparse


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", nargs="?", default=None, help="YAML preset (default: configs/quickstart.yaml)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="a.b=value",
        help="Dotted override of any config field; repeatable.",
    )


SHORTHANDS = {
    "plan": {"gpu_mem": "hardware.gpu_mem_gb", "mfu": "hardware.mfu"},
    "preflight": {
        "processes": "preflight.processes",
        "seq_len": "preflight.seq_len",
        "micro_batch_size": "preflight.micro_batch_size",
        "steps": "preflight.steps",
        "no_train": "preflight.train",
        "no_data": "preflight.check_data",
    },
    "critical-batch": {
        "base_batch": "critical_batch.base_batch",
        "factors": "critical_batch.factors",
        "points": "critical_batch.points",
        "branch_tokens": "critical_batch.branch_tokens",
        "lr_scaling": "critical_batch.lr_scaling",
        "tolerance": "critical_batch.tolerance",
    },
    "ablate": {"candidate": "ablation.candidate", "num_tokens": "ablation.num_tokens"},
}
"""Per command, each flag (its ``argparse`` name) and the recipe field it sets: ``preflight
--steps 6`` is ``--set preflight.steps=6``; a ``--no-*`` flag sets its field to false. A
``--set`` of the same field wins. ``plan --gpus N`` sets ``hardware`` to N GPUs (`with_gpus`)."""


def shorthands(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides a command's flags stand for (those given on the command line)."""
    overrides = []
    for flag, field in SHORTHANDS.get(getattr(args, "command", ""), {}).items():
        value = getattr(args, flag, None)
        if flag.startswith("no_"):
            value = False if value else None
        if value is not None:
            overrides.append(f"{field}={_yaml_value(value)}")
    return overrides


def _yaml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def with_gpus(config, gpus: int | None):
    """``hardware`` with ``gpus`` GPUs in all: machines of ``gpus_per_node`` when it divides
    them, else one machine of ``gpus``."""
    if gpus is None:
        return config
    per_node = config.hardware.gpus_per_node
    nodes, per_node = (gpus // per_node, per_node) if gpus % per_node == 0 else (1, gpus)
    hardware = config.hardware.model_copy(update={"nodes": nodes, "gpus_per_node": per_node})
    return config.model_copy(update={"hardware": hardware})


def load_recipe(args: argparse.Namespace):
    from llmflow.tasks.config import load_config

    overrides = shorthands(args) + list(args.overrides)
    for field in ("root", "until"):
        value = getattr(args, field, None)
        if value is not None:
            overrides.append(f"{field}={value}")
    config = with_gpus(load_config(args.config, overrides), getattr(args, "gpus", None))
    if getattr(args, "data", None):
        config = config.model_copy(update={"data": list(args.data)})
    return config
