"""The ``llmflow`` command line: run, show, lineage."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from llmflow.flows.cli_recipe import add_config_args, load_recipe, shorthands
from llmflow.tasks.framework.errors import BadInputError


def cmd_show(args: argparse.Namespace) -> int:
    from llmflow.tasks.config import dump_config

    print(dump_config(load_recipe(args)), end="")
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
    config = load_recipe(args)  # fails here, before Prefect starts, on any bad value
    if config.data:  # a missing path fails in about a second, before the heavy imports
        from llmflow.tasks.ingest.hub import split_sources
        from llmflow.tasks.ingest.ingest import list_files

        local, _ = split_sources(config.data)  # a malformed hf:// URI fails here too
        if local:
            list_files(local)
    if config.init:  # so does a missing model, folder or revision
        from llmflow.tasks.ingest import models

        models.resolve(config.init, "init")
    from llmflow.flows.recipe import planned

    graph = planned(config)  # and so does a misnamed input of any step, or a missing extra
    if not os.environ.get("PREFECT_API_URL"):
        # Every output already in the store: say so without starting a temporary API (against
        # a real server, the run goes through Prefect so the UI records each step as Cached).
        from llmflow.tasks.framework.executor import all_cached

        outcome = all_cached(graph, config.root)
        if outcome is not None:
            print("every step's output is already in the store: nothing to run")
            print(_summary(outcome.rows(), time.perf_counter() - started))
            return 0
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


def cmd_verify(args: argparse.Namespace) -> int:
    from llmflow.tasks.framework.verify import format_check, summary_line, verify_root

    checks = verify_root(args.root, on_output=lambda c: print(format_check(c), flush=True))
    print(summary_line(checks))
    return 1 if any(c.status == "corrupt" for c in checks) else 0


def _init_architecture(config):
    """With ``init``: ``pretrain`` on the model's own architecture, read from its config.json
    alone (planning needs no weights; a mirror folder may hold only that file); the configured
    ``pretrain.train.model`` when it cannot be read (offline without a mirror), said once."""
    if config.init is None:
        return config
    from llmflow.model.hf_arch import config_from_hf
    from llmflow.tasks.ingest import import_model, models

    try:
        source = models.resolve(config.init, "init")
        folder = import_model._config_folder(source)
        found = config_from_hf(models.read_config(folder, config.init, "init"), source="init")
    except BadInputError as err:
        print(f"(init's config.json is unreadable, planned with pretrain.train.model: {err})")
        return config
    model = import_model.InitModel(source, found, found.vocab_size)
    print(f"init: planned on the architecture of {source.name} ({found.hf_model_type})")
    return config.model_copy(update={"pretrain": import_model._on_model(config, model)})


def _init_size(config) -> str:
    """The ``init`` model's parameters as transformers counts them, built from its config.json
    on the meta device (any causal LM, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmflow.tasks.ingest import import_model, models

    try:
        source = models.resolve(config.init, "init")
        hf_config = AutoConfig.from_pretrained(import_model._config_folder(source))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except (BadInputError, OSError, ValueError) as err:
        return f"init model           {config.init}: its size is unknown ({err})"
    count = sum(p.numel() for p in model.parameters())
    return f"init model           {source.name} ({hf_config.model_type}): {count:,} parameters"


def _plan_without_stages(config, args: argparse.Namespace) -> int:
    """``plan`` of a recipe that post-trains its ``init`` model directly: no pretraining to plan;
    the model's size, and each context-extension stage's memory (those still train)."""
    from llmflow.tasks.pretrain.planner import NO_STAGE, extension_memory

    print(f"{config.name} on {config.hardware.gpus} GPU(s)")
    print(f"{NO_STAGE}: nothing to pretrain, the init model goes on as it is")
    print(_init_size(config))
    if config.extend.stages:  # the extension trains the imported model: on its architecture
        config = _init_architecture(config)
        for line in extension_memory(config.pretrain, config.extend, config.hardware):
            print(line)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from llmflow.tasks.pretrain.layout_planner import parse_parallel
    from llmflow.tasks.pretrain.planner import extension_memory, format_plan, recipe_plan

    config = load_recipe(args)
    parallel = parse_parallel(args.parallel) if args.parallel else None
    if not config.pretrain.stages:
        return _plan_without_stages(config, args)
    config = _init_architecture(config)
    result = recipe_plan(config.pretrain, config.hardware)
    gpus = config.hardware.gpus
    from llmflow.tasks.scaling.fit import find_law

    try:
        law = find_law(config.root, config.name)  # fitted by `llmflow ladder` for this recipe
    except Exception as exc:  # NOTE: an unreachable root (S3 offline) must not stop a plan
        law = None
        print(f"(no fitted scaling law read: {config.root} is unreachable: {type(exc).__name__})")
    if law is not None:
        result.predicted_loss = law.predict(result.num_non_embedding_parameters, result.num_tokens)
    print(f"{config.name} on {gpus} GPU(s)")
    print(format_plan(result))
    for line in extension_memory(config.pretrain, config.extend, config.hardware):
        print(line)
    _print_layouts(config, parallel)
    if not result.fits:
        print(
            "llmflow: error: the recipe does not fit its GPUs; see the fixes above", file=sys.stderr
        )
    return 0 if result.fits else 1


def _print_layouts(config, parallel: dict | None) -> None:
    """Each stage's parallel layout (chosen, or around the degrees ``--parallel`` or the
    recipe sets), with its memory per GPU, bubble and traffic."""
    from llmflow.tasks.pretrain.layout_planner import format_layout_plan, stage_layout_plans

    print("parallel layout per stage (TP+SP, CP, PP, FSDP2 over dp_shard x cp; global batch kept):")
    plans = stage_layout_plans(config.pretrain, config.extend, config.hardware, parallel=parallel)
    for name, seq_len, layout_plan in plans:
        print("\n".join(format_layout_plan(name, seq_len, layout_plan)))


def cmd_preflight(args: argparse.Namespace) -> int:
    from llmflow.flows.preflight import PreflightRun, preflight_flow

    options = load_recipe(args).preflight  # the recipe's, with the flags and --set applied
    preset = str(Path(args.config).resolve()) if args.config else "quickstart"
    overrides = shorthands(args) + list(args.overrides)
    result = preflight_flow(PreflightRun(preset=preset, overrides=overrides, options=options))
    print(result["table"])
    return 0 if result["go"] else 1


def cmd_sweep(args: argparse.Namespace) -> int:
    from llmflow.tasks.scaling.space import SweepSpace, check_space

    config, space = load_recipe(args), SweepSpace.load(args.space)
    check_space(config, space)  # an unknown field or a rejected value fails before Prefect
    from llmflow.flows.sweep import run_sweep

    result = run_sweep(config, space)
    for row in result.rows:
        print("  ".join(f"{k}={v}" for k, v in row.items() if v != ""))
    print(f"best val_loss {result.best_value:.4f}: {result.best_params}")
    print(f"best config, trials and plots: {result.folder}")
    return 0


def cmd_critical_batch(args: argparse.Namespace) -> int:
    from llmflow.flows.critical_batch import critical_batch

    config = load_recipe(args)
    result = critical_batch(config, config.critical_batch)
    for row in result["rows"]:
        print("  ".join(f"{k}={v}" for k, v in row.items()))
    for point, batch in result["critical"].items():
        print(f"critical batch after {point} tokens: {batch} sequences")
    return 0


def cmd_ladder(args: argparse.Namespace) -> int:
    from llmflow.flows.scaling import LadderConfig, scaling_ladder

    config = load_recipe(args)
    result = scaling_ladder(config, LadderConfig())
    law = result.law
    print(
        f"L(N, D) = {law['E']:.3f} + {law['A']:.4g}/N^{law['alpha']:.3f} "
        f"+ {law['B']:.4g}/D^{law['beta']:.3f}"
    )
    if result.degenerate:  # a law that cannot be trusted predicts nothing
        print(f"{result.degenerate}; held-out model: actual {result.actual:.4f}, no prediction")
    else:
        print(
            f"held-out model: predicted {result.predicted:.4f}, actual {result.actual:.4f}, "
            f"error {result.error:.2%}"
        )
    for row in result.ranking:
        print("  ".join(f"{k}={v}" for k, v in row.items()))
    print("ranking consistent across sizes:", "yes" if result.consistent else "no")
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    from llmflow.flows.ablation import annealing_ablation

    config = load_recipe(args)
    candidate = "+" + config.ablation.required_candidate()  # before Prefect starts
    rows = annealing_ablation(config, config.ablation)
    print(f"{'metric':<34} {'baseline':>10} {candidate:>10} {'diff':>10}")
    for row in rows:
        print(
            f"{row['metric']:<34} {row['baseline']:>10.4g} {row['candidate']:>10.4g} {row['difference']:>+10.4g}"
        )
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    from llmflow.tasks.evaluation.external import pin_model, store_output

    for model in args.models:  # a bad model fails here, before the recipe's heavy imports
        if store_output(model) is None:
            pin_model(model)
    from llmflow.flows.evaluate_models import EvaluateModelsRun, plan_evaluation

    run = EvaluateModelsRun(
        models=args.models,
        preset=str(Path(args.config).resolve()) if args.config else "quickstart",
        overrides=args.overrides,
        root=args.root,
        name=args.name,
        corpus=args.corpus,
        heldout=args.heldout,
    )
    plan_evaluation(run)  # every model pinned and checked before Prefect starts
    from llmflow.flows.evaluate_models import evaluate_models

    results = evaluate_models(run)
    print()
    print(_summary(results, time.perf_counter() - started))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from llmflow.flows.deploy import serve

    serve(args.names or None, limit=args.limit)
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from llmflow.tasks.pretrain.watch import watch

    return watch(args.root, interval=args.interval, once=args.once, recent_s=args.recent)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run", help="Run the end-to-end pipeline (steps already done are skipped)."
    )
    add_config_args(run)
    run.add_argument("--root", help="Artifact root: a folder or s3://bucket/prefix.")
    run.add_argument(
        "--data", nargs="+", help="Your own data files/folders/globs instead of the sample."
    )
    run.add_argument("--until", help="Stop after this step (e.g. curate).")
    run.set_defaults(func=cmd_run)
    show = sub.add_parser("show", help="Print the resolved config.")
    add_config_args(show)
    show.set_defaults(func=cmd_show)
    lin = sub.add_parser("lineage", help="Print the upstream tree of an output.")
    lin.add_argument("uri", help="An output directory or URI.")
    lin.set_defaults(func=cmd_lineage)
    ver = sub.add_parser(
        "verify", help="Check every committed output's files against its recorded checksums."
    )
    ver.add_argument("root", help="Artifact root: a folder or s3://bucket/prefix.")
    ver.set_defaults(func=cmd_verify)
    planner = sub.add_parser("plan", help="Parameters, FLOPs, memory per GPU, tokens and time.")
    add_config_args(planner)
    planner.add_argument(
        "--gpus", type=int, help="GPUs in all: sets hardware.nodes (x hardware.gpus_per_node)."
    )
    planner.add_argument("--gpu-mem", type=float, help="GB per GPU: hardware.gpu_mem_gb.")
    planner.add_argument("--mfu", type=float, help="Expected MFU: hardware.mfu.")
    planner.add_argument(
        "--parallel",
        metavar="tp=2,cp=4,pp=1",
        help="Fix parallel degrees (pretrain.train.parallel fields) of every stage; the planner "
        "chooses the others, the micro-batch, accumulation and checkpointing.",
    )
    planner.set_defaults(func=cmd_plan)
    pre = sub.add_parser("preflight", help="The go/no-go checklist to pass before a long run.")
    add_config_args(pre)
    pre.add_argument("--processes", type=int, help="preflight.processes: ranks of the test steps.")
    pre.add_argument("--seq-len", type=int, help="preflight.seq_len of the test steps.")
    pre.add_argument("--micro-batch-size", type=int, help="preflight.micro_batch_size per rank.")
    pre.add_argument("--steps", type=int, help="preflight.steps: test optimizer steps.")
    pre.add_argument("--no-train", action="store_true", help="preflight.train=false: plan only.")
    pre.add_argument("--no-data", action="store_true", help="preflight.check_data=false.")
    pre.set_defaults(func=cmd_preflight)
    sweep = sub.add_parser("sweep", help="Optuna search (TPE + pruning) over cached trials.")
    add_config_args(sweep)
    sweep.add_argument("--space", required=True, help="Search space YAML (configs/sweeps/).")
    sweep.add_argument("--root", help="Artifact root (the study's SQLite lives under it).")
    sweep.set_defaults(func=cmd_sweep)
    crit = sub.add_parser("critical-batch", help="Largest batch matching the base batch's loss.")
    add_config_args(crit)
    crit.add_argument("--root", help="Artifact root.")
    crit.add_argument("--lr-scaling", choices=["sqrt", "linear"], help="critical_batch.lr_scaling")
    crit.add_argument("--tolerance", type=float, help="critical_batch.tolerance (relative loss).")
    crit.add_argument("--base-batch", type=int, help="critical_batch.base_batch (sequences).")
    crit.add_argument("--factors", type=int, nargs="+", help="critical_batch.factors: k of k*B.")
    crit.add_argument("--points", type=int, nargs="+", help="critical_batch.points: trunk tokens.")
    crit.add_argument("--branch-tokens", type=int, help="critical_batch.branch_tokens.")
    crit.set_defaults(func=cmd_critical_batch)
    lad = sub.add_parser("ladder", help="Isoflop ladder, fitted scaling law, held-out check.")
    add_config_args(lad)
    lad.add_argument("--root", help="Artifact root.")
    lad.set_defaults(func=cmd_ladder)
    ablate = sub.add_parser(
        "ablate", help="Annealing ablation: baseline vs 40/60 with a candidate domain."
    )
    add_config_args(ablate)
    ablate.add_argument("--root", help="Artifact root.")
    ablate.add_argument("--candidate", help="ablation.candidate: the domain to test late.")
    ablate.add_argument("--num-tokens", type=int, help="ablation.num_tokens: budget per arm.")
    ablate.set_defaults(func=cmd_ablate)
    ev = sub.add_parser(
        "evaluate", help="Evaluate model folders or hf://models/ ids: suite, cards, leaderboard."
    )
    ev.add_argument("models", nargs="+", help="Folders or hf://models/OWNER/NAME[@REVISION].")
    ev.add_argument("--config", help="YAML preset whose evaluate/safety settings to use.")
    ev.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="a.b=value",
        help="Dotted override of any config field; repeatable.",
    )  # fmt: skip
    ev.add_argument("--root", help="Artifact root: a folder or s3://bucket/prefix.")
    ev.add_argument("--name", help="Leaderboard label (default: the preset's name).")
    ev.add_argument("--corpus", help="A decontaminate output: contamination shares against it.")
    ev.add_argument("--heldout", help="A tokenize output: documents for the perplexity tasks.")
    ev.set_defaults(func=cmd_evaluate)
    serve = sub.add_parser("serve", help="Serve the deployments from this process (no worker).")
    serve.add_argument("names", nargs="*", help="Deployment names (default: all local ones).")
    serve.add_argument("--limit", type=int, help="Concurrent flow runs.")
    serve.set_defaults(func=cmd_serve)
    wat = sub.add_parser(
        "watch", help="The running (and recently finished) training stages under a root, live."
    )
    wat.add_argument("root", help="Artifact root (a local folder).")
    wat.add_argument("--interval", type=float, default=2.0, help="Seconds between redraws.")
    wat.add_argument("--once", action="store_true", help="Print one frame and exit.")
    wat.add_argument(
        "--recent", type=float, default=3600.0, help="Show finished stages this many seconds."
    )
    wat.set_defaults(func=cmd_watch)
    return parser


class _NoBadInputTraceback(logging.Filter):
    """Drops the traceback from a record that logs a BadInputError: the input is wrong, not the
    code, and ``main`` prints the one line that says what to fix."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], BadInputError):
            record.exc_info, record.exc_text = None, None
        return True


PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
"""Where Prefect's engines log a run's exception with its traceback."""


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    args = build_parser().parse_args(argv)
    for name in PREFECT_RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoBadInputTraceback) for f in logger.filters):
            logger.addFilter(_NoBadInputTraceback())
    try:
        return args.func(args)
    except BadInputError as err:
        print(f"llmflow: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
