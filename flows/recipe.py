"""The end-to-end recipe as data: which step runs on which config, fed by which outputs.

``recipe(config)`` builds the graph; it computes nothing and needs no Prefect, so input checks
(a missing ``--data`` path, a misnamed input) fail here, before the Prefect API starts. The flow in
``pipeline.py`` runs the graph (or ``graph.until(phase)``); the annealing ablation and the
scheduled evaluation build their own graphs from the same steps.

    sample ─► ingest ─► curate ─► tokenizer ─► tokenize ─► mixtures ─► pretrain 1..n ─► extend
       ─► longctx, ruler ─► export ─► evaluate ─► sft ─► evaluate ─► dpo ─► evaluate ─► leaderboard
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from llmflow.flows.model_evaluation import (
    Evaluated,
    SafetyInputs,
    add_leaderboard,
    add_model_evaluation,
    add_safety_inputs,
    safety_config,  # noqa: F401  (re-exported: the safety settings test reads it here)
)
from llmflow.tasks.config import PHASES, PipelineConfig
from llmflow.tasks.curation.recipe import add_curation
from llmflow.tasks.dataprep.mixture import check_data_domains, mixture, validation
from llmflow.tasks.dataprep.tokenize import tokenize_corpus
from llmflow.tasks.decontam.posttrain import add_posttrain_check
from llmflow.tasks.decontam.step import add_decontamination
from llmflow.tasks.evaluation.card import card_config
from llmflow.tasks.evaluation.export import ExportConfig, export
from llmflow.tasks.evaluation.external import STEP_NAME as EXTERNAL_STEP
from llmflow.tasks.extend.config import extension_mixture, extension_train_config
from llmflow.tasks.extend.longctx import LongContextEval, longctx
from llmflow.tasks.extend.ruler import RulerEval, ruler
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.graph import Graph, Node, Raw
from llmflow.tasks.ingest.hub import data_sources
from llmflow.tasks.ingest.import_model import ImportTokenizerConfig, add_init, import_tokenizer
from llmflow.tasks.ingest.ingest import ingest_sources, list_files
from llmflow.tasks.ingest.sample import sample
from llmflow.tasks.posttrain.average import average
from llmflow.tasks.posttrain.dpo import dpo
from llmflow.tasks.posttrain.grpo import grpo
from llmflow.tasks.posttrain.merge import merge
from llmflow.tasks.posttrain.sft import sft
from llmflow.tasks.pretrain.curriculum import stage_train_config
from llmflow.tasks.pretrain.parallel.support import check_recipe_layouts
from llmflow.tasks.pretrain.step import StageRun, pretrain
from llmflow.tasks.safety.config import ENABLE_HINT
from llmflow.tasks.tokenizer.train import train_tokenizer

log = logging.getLogger("llmflow.recipe")


def planned(config: PipelineConfig) -> Graph:
    """The graph this config runs: the recipe, up to ``config.until`` if set.

    Raises:
        BadInputError: a step of that graph needs an optional package that is not installed
            (a run cut before the merge does not need mergekit).
    """
    graph = recipe(config)
    graph = graph.until(config.until) if config.until else graph
    if any(n.step is merge for n in graph.nodes) and importlib.util.find_spec("mergekit") is None:
        raise BadInputError(
            "merge.enabled needs mergekit: pip install 'llmflow[merge]' (or merge.enabled=false)"
        )
    return graph


def recipe(config: PipelineConfig) -> Graph:
    """The whole pipeline as a graph of steps, in run order."""
    graph = Graph(PHASES)
    config, imported = add_init(graph, config)  # init: pinned, its architecture for pretrain
    if imported is not None:  # the layouts on that architecture (validation had not read it)
        check_recipe_layouts(config.pretrain, config.extend)
    curated = add_curation(graph, config.curate, ingested(graph, config), config.name)
    curated = add_decontamination(
        graph, config.decontaminate, config.evaluate, curated, config.name
    )
    if imported is None:
        tokenizer = graph.add(train_tokenizer, config.tokenizer, config.name, corpus=curated)
    else:
        tokenizer = graph.add(
            import_tokenizer, ImportTokenizerConfig(), config.name, phase="tokenizer",
            model=imported,
        )  # fmt: skip
    tokenized = graph.add(
        tokenize_corpus, config.tokenize, config.name, corpus=curated, tokenizer=tokenizer
    )
    base = curriculum(graph, config, tokenized, init=imported)
    averaged = average_checkpoints(graph, config, base) if config.average.enabled else None
    extended = extension(graph, config, tokenized, base)
    long_context = None
    if config.extend.stages:  # long-context scores before vs after the extension
        passkey = graph.add(
            longctx,
            LongContextEval(extend=config.extend),
            config.name,
            phase="extend",
            before=base,
            after=extended,
            tokenizer=tokenizer,
            tokenized=tokenized,
        )
        long_context = ruler_scores(graph, config, tokenizer, tokenized, passkey)
    checks = safety_inputs(graph, config, curated)
    models = [export_and_evaluate(graph, config, "base", base, tokenizer, tokenized, checks)]
    long_export = models[0].model  # post-training starts from the extended export, else this
    if averaged is not None:
        models.append(
            export_and_evaluate(graph, config, "averaged", averaged, tokenizer, tokenized, checks)
        )
    if config.extend.stages:
        rope = yarn_rope(config)
        models.append(
            export_and_evaluate(
                graph, config, "extended", extended, tokenizer, tokenized, checks,
                long_context=long_context, **rope,
            )
        )  # fmt: skip
        long_export = models[-1].model
    models += posttraining(graph, config, checks, long_export, tokenized)
    add_leaderboard(
        graph, config.name, models, long_context=[long_context] if long_context else None
    )
    return graph


def ruler_scores(
    graph: Graph, config: PipelineConfig, tokenizer: Node, tokenized: Node, passkey: Node
) -> Node | None:
    """RULER on every extension stage's checkpoint, beside the passkey and loss-by-position
    results; None when ``extend.ruler`` is off or no stage is long enough for its prompts."""
    settings, lengths = config.extend.ruler, config.extend.ruler_lengths()
    if not settings.enabled or not lengths:
        return None
    stages = graph.find(step="pretrain", phase="extend")
    return graph.add(
        ruler,
        RulerEval(ruler=settings, labels=[n.name.rsplit("-", 1)[-1] for n in stages],
                  lengths=lengths),
        config.name, phase="extend", models=stages, tokenizer=tokenizer, tokenized=tokenized,
        longctx=passkey,
    )  # fmt: skip


def yarn_rope(config: PipelineConfig) -> dict:
    """RoPE settings of the extended export: YaRN on top of the last trained length."""
    longest = config.extend.stages[-1].seq_len
    return {
        "rope_scaling": config.extend.yarn_scaling(),
        "max_seq_len": int(longest * config.extend.yarn_factor),
    }


def ingested(graph: Graph, config: PipelineConfig) -> Node:
    """The ingest node: the user's raw files (listed now, so a bad path fails now) and Hub
    datasets (pinned to a commit now, so an unreachable one fails now), or the sample. A
    mixture weighing a domain the data lacks fails now too."""
    if config.data:
        local, hub = data_sources(config)
        files = Raw(tuple(list_files(local))) if local else None
        check_data_domains(config, list(files.files) if files else [], hub)
        ingest_cfg = config.ingest.model_copy(update={"hub": hub}) if hub else config.ingest
        return graph.add(ingest_sources, ingest_cfg, config.name, files=files)
    generated = graph.add(sample, config.sample, config.name)
    return graph.add(ingest_sources, config.ingest, config.name, sample=generated)


def _stage_mixtures(graph: Graph, config: PipelineConfig, tokenized: Node) -> list[Node]:
    """One mixture node per pretraining stage, in stage order."""
    return [
        graph.add(mixture, s.mixture, f"{config.name}-{s.name}", tokenized=tokenized)
        for s in config.pretrain.stages
    ]


def curriculum(
    graph: Graph, config: PipelineConfig, tokenized: Node, init: Node | None = None
) -> Node:
    """The validation set, each stage's mixture, then the stages in order, the first from
    ``init`` (an imported model) if given; the last checkpoint (``init`` without stages)."""
    held_out = graph.add(
        validation, config.validation, config.name, phase="mixture", tokenized=tokenized
    )
    stages = config.pretrain.stages
    mixtures = _stage_mixtures(graph, config, tokenized)
    checkpoint = init
    for index, (stage, data) in enumerate(zip(stages, mixtures, strict=True)):
        run = stage_run(config, stage_train_config(config.pretrain, index))
        checkpoint = graph.add(
            pretrain,
            run,
            f"{config.name}-{stage.name}",
            data=data,
            validation=held_out,
            init=checkpoint,
        )
    return checkpoint


def average_checkpoints(graph: Graph, config: PipelineConfig, last_stage: Node) -> Node:
    """The mean of the last stage's newest checkpoints, validated on the curriculum's held-out
    set against the plain final checkpoint."""
    held_out = graph.find(step="validation", phase="mixture")[0]
    return graph.add(
        average,
        config.average,
        f"{config.name}-{config.pretrain.stages[-1].name}",
        phase="pretrain",
        run=last_stage,
        validation=held_out,
    )


def extension(graph: Graph, config: PipelineConfig, tokenized: Node, checkpoint: Node) -> Node:
    """RoPE ABF stages, each at its own length with its own data and validation set."""
    for index, stage in enumerate(config.extend.stages):
        label = f"{config.name}-ctx{stage.seq_len}"
        data = graph.add(
            mixture,
            extension_mixture(config.extend, stage, seed=100 + index),
            label,
            phase="extend",
            tokenized=tokenized,
        )
        long_validation = config.validation.model_copy(update={"seq_len": stage.seq_len})
        held_out = graph.add(
            validation, long_validation, label, phase="extend", tokenized=tokenized
        )
        run = stage_run(config, extension_train_config(config.pretrain.train, stage))
        checkpoint = graph.add(
            pretrain, run, label, phase="extend", data=data, validation=held_out, init=checkpoint
        )
    return checkpoint


def stage_run(config: PipelineConfig, train) -> StageRun:
    """One trainer run: its config plus how to launch it (execution-only)."""
    return StageRun(train=train, **config.pretrain.launch_settings())


def _exported(
    graph: Graph, config: PipelineConfig, label: str, checkpoint: Node, tokenizer: Node, rope: dict
) -> Node:
    """The checkpoint's Hugging Face export; an external model is its own export."""
    if checkpoint.step.name == EXTERNAL_STEP:
        return checkpoint
    return graph.add(
        export,
        ExportConfig(label=label, **rope),
        f"{config.name}-{label}",
        phase="evaluate",
        checkpoint=checkpoint,
        tokenizer=tokenizer,
    )


def export_and_evaluate(
    graph: Graph,
    config: PipelineConfig,
    label: str,
    checkpoint: Node,
    tokenizer: Node,
    tokenized: Node,
    checks: SafetyInputs | None = None,
    long_context: Node | None = None,
    **rope,
) -> Evaluated:
    """Export a checkpoint to Hugging Face format, then evaluate the export (an ``init`` model
    no stage trains is a model output already: evaluated as it is); ``long_context`` (RULER's
    scores of the checkpoint) joins its card."""
    exported = _exported(graph, config, label, checkpoint, tokenizer, rope)
    return evaluate_model(
        graph, config, checks, label, exported, tokenized, phase="evaluate",
        long_context=long_context,
    )  # fmt: skip


def evaluate_model(
    graph: Graph,
    config: PipelineConfig,
    checks: SafetyInputs | None,
    label: str,
    model: Node,
    tokenized: Node,
    phase: str,
    long_context: Node | None = None,
) -> Evaluated:
    """The recipe's model ``label``: evaluated (perplexity on the run's held-out documents),
    safety-checked when on, and carded with the resolved config (and ``long_context``)."""
    return add_model_evaluation(
        graph, model, label, name=f"{config.name}-{label}", suite=config.evaluate,
        card=card_config(config, label), safety_inputs=checks, heldout=tokenized, phase=phase,
        long_context=long_context,
    )  # fmt: skip


def safety_inputs(graph: Graph, config: PipelineConfig, corpus: Node) -> SafetyInputs | None:
    """The toxicity classifier (taught that the corpus's ordinary text is not hateful) and the
    safety files; None (said in the log) when they are not set."""
    checks = add_safety_inputs(graph, config, config.name, background=corpus)
    if checks is None:
        log.info("bias and toxicity evaluation is off: %s", ENABLE_HINT)
    return checks


def posttraining(
    graph: Graph, config: PipelineConfig, checks: SafetyInputs | None, base: Node, tokenized: Node
) -> list[Evaluated]:
    """SFT of the (extended) base export, DPO of the SFT model, GRPO (after SFT or DPO), then
    the last of them merged with the base (SmolLM3's recipe); each evaluated, in that order."""

    def check(kind: str):  # the data, against the eval sets (a record holding an item drops)
        return add_posttrain_check(
            graph, kind, getattr(config, kind), config.decontaminate, config.evaluate,
            config.name, phase=kind,
        )  # fmt: skip

    tuned = graph.add(
        sft, config.sft, config.name, model=base, data=user_file(config.sft.data),
        data_check=check("sft"),
    )  # fmt: skip
    models = [evaluate_model(graph, config, checks, "sft", tuned, tokenized, phase="sft")]
    aligned = graph.add(
        dpo, config.dpo, config.name, model=tuned, data=user_file(config.dpo.data),
        data_check=check("dpo"),
    )  # fmt: skip
    models.append(evaluate_model(graph, config, checks, "dpo", aligned, tokenized, phase="dpo"))
    trained = {"sft": tuned, "dpo": aligned}
    if config.grpo.enabled:
        start = trained[config.grpo.after]
        data = user_file(config.grpo.data)
        trained["grpo"] = graph.add(
            grpo, config.grpo, config.name, model=start, data=data, data_check=check("grpo")
        )
        models.append(
            evaluate_model(graph, config, checks, "grpo", trained["grpo"], tokenized, "grpo")
        )
    if config.merge.enabled:
        source = config.merge.source
        if source == "last":
            source = "grpo" if "grpo" in trained else "dpo"
        if source not in trained:
            raise BadInputError(f"merge.source={source!r}, but grpo.enabled is false")
        merged = graph.add(
            merge, config.merge, config.name, phase="merge", models=[trained[source], base]
        )
        models.append(evaluate_model(graph, config, checks, "merged", merged, tokenized, "merge"))
    return models


def user_file(data: str) -> Raw | None:
    """A user's post-training file as a raw input (hashed); None for the generated data."""
    if data == "quickstart":
        return None
    if not Path(data).exists() and "://" not in data:
        raise BadInputError(f"post-training data file does not exist: {data}")
    return Raw((data,))
