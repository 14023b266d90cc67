"""The ``llmflow`` command line: run, show, lineage."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from llmflow.tasks.framework.errors import BadInputError


def _add_config_args(parser: argparse.ArgumentParser) -> None:
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


def _load(args: argparse.Namespace):
    from llmflow.tasks.config import load_config

    overrides = list(args.overrides)
    for field in ("root", "until"):
        value = getattr(args, field, None)
        if value is not None:
            overrides.append(f"{field}={value}")
    config = load_config(args.config, overrides)
    if getattr(args, "data", None):
        config = config.model_copy(update={"data": list(args.data)})
    return config


def cmd_show(args: argparse.Namespace) -> int:
    from llmflow.tasks.config import dump_config

    print(dump_config(_load(args)), end="")
    return 0


def _summary(results, seconds: float) -> str:
    width = max((len(r.step) for r in results), default=4)
    lines = [f"{'step':<{width}}  status  seconds  output"]
    for r in results:
        status = "cached" if r.cached else "ran"
        lines.append(f"{r.step:<{width}}  {status:<6}  {r.seconds:7.1f}  {r.uri}")
    ran = sum(not r.cached for r in results)
    lines.append(
        f"{len(results)} steps, {ran} ran, {len(results) - ran} cached, {seconds:.1f} s in all"
    )
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    config = _load(args)  # fails here, before Prefect starts, on any bad value
    if config.data:  # a missing path fails in about a second, before the heavy imports
        from llmflow.tasks.ingest.hub import split_sources
        from llmflow.tasks.ingest.ingest import list_files

        local, _ = split_sources(config.data)  # a malformed hf:// URI fails here too
        if local:
            list_files(local)
    from llmflow.flows.recipe import recipe

    recipe(config)  # and so does a misnamed input of any step
    from llmflow.flows.pipeline import run_pipeline

    results = run_pipeline(config)
    print()
    print(_summary(results, time.perf_counter() - started))
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    from llmflow.tasks.framework import lineage
    from llmflow.tasks.framework.store import Store

    uri = args.uri.rstrip("/")
    parent = uri.rsplit("/", 2)[0]
    store = Store(parent)
    if store.is_local and "://" not in uri:
        uri = str(Path(uri).resolve())
    print(lineage.format_tree(uri, store.read_lineage))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from llmflow.tasks.pretrain.planner import format_plan, recipe_plan

    config = _load(args)
    result = recipe_plan(
        config.pretrain, config.hardware, num_gpus=args.gpus, gpu_mem_gb=args.gpu_mem, mfu=args.mfu
    )
    gpus = args.gpus or config.hardware.gpus
    print(f"{config.name} on {gpus} GPU(s)")
    print(format_plan(result))
    if not result.fits:
        print(
            "llmflow: error: the recipe does not fit its GPUs; see the fixes above", file=sys.stderr
        )
    return 0 if result.fits else 1


def cmd_ablate(args: argparse.Namespace) -> int:
    from llmflow.flows.ablation import AblationConfig, annealing_ablation

    config = _load(args)
    ablation = AblationConfig(candidate=args.candidate, num_tokens=args.num_tokens)
    rows = annealing_ablation(config, ablation)
    print(f"{'metric':<34} {'baseline':>10} {'+' + args.candidate:>10} {'diff':>10}")
    for row in rows:
        print(
            f"{row['metric']:<34} {row['baseline']:>10.4g} {row['candidate']:>10.4g} {row['difference']:>+10.4g}"
        )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from llmflow.flows.deploy import serve

    serve(args.names or None, limit=args.limit)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run", help="Run the end-to-end pipeline (steps already done are skipped)."
    )
    _add_config_args(run)
    run.add_argument("--root", help="Artifact root: a folder or s3://bucket/prefix.")
    run.add_argument(
        "--data", nargs="+", help="Your own data files/folders/globs instead of the sample."
    )
    run.add_argument("--until", help="Stop after this step (e.g. curate).")
    run.set_defaults(func=cmd_run)
    show = sub.add_parser("show", help="Print the resolved config.")
    _add_config_args(show)
    show.set_defaults(func=cmd_show)
    lin = sub.add_parser("lineage", help="Print the upstream tree of an output.")
    lin.add_argument("uri", help="An output directory or URI.")
    lin.set_defaults(func=cmd_lineage)
    planner = sub.add_parser("plan", help="Parameters, FLOPs, memory per GPU, tokens and time.")
    _add_config_args(planner)
    planner.add_argument("--gpus", type=int, help="Data-parallel GPUs (default: hardware.*).")
    planner.add_argument("--gpu-mem", type=float, help="GB per GPU (default: hardware.gpu_mem_gb).")
    planner.add_argument("--mfu", type=float, help="Expected MFU (default: hardware.mfu).")
    planner.set_defaults(func=cmd_plan)
    ablate = sub.add_parser(
        "ablate", help="Annealing ablation: baseline vs 40/60 with a candidate domain."
    )
    _add_config_args(ablate)
    ablate.add_argument("--root", help="Artifact root.")
    ablate.add_argument("--candidate", required=True, help="Domain to test as late-stage data.")
    ablate.add_argument("--num-tokens", type=int, default=50_000, help="Annealing budget per arm.")
    ablate.set_defaults(func=cmd_ablate)
    serve = sub.add_parser("serve", help="Serve the deployments from this process (no worker).")
    serve.add_argument("names", nargs="*", help="Deployment names (default: all local ones).")
    serve.add_argument("--limit", type=int, help="Concurrent flow runs.")
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BadInputError as err:
        print(f"llmflow: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
