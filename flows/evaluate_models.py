"""``llmflow evaluate MODEL...``: models made elsewhere, scored with the recipe's suite.

The graph, per model: ``external-model`` (the folder or ``hf://models/OWNER/NAME[@REV]``, pinned
when the graph is built; a folder's files are raw inputs, hashed) -> ``evaluate`` (the config's
suite) -> ``safety`` (when ``safety.data_root`` is set) -> ``card``; then one ``leaderboard``
over all of them. These are the recipe's own steps, so a model evaluated here and there has the
same evaluation when its output is the same, and everything is cached by content.

A model trained elsewhere has no ``decontaminate`` step in its lineage, so its scores say "not
checked" unless ``corpus`` names a curated, decontaminated output of the store: then each score
carries the share of its task's items found in that corpus.

A committed model output of a store (``runs/export/NAME-HASH``, say the export of
``llmflow run configs/continue-pretrain.yaml``) is evaluated as it stands, not copied: its
lineage, and the decontamination of the corpus it was trained on, still follow it.

Everything is checked when the graph is built (a missing repo or revision, a folder without
weights, a sequence classifier, a corpus that is not in the store): the run fails in seconds,
naming the value, before anything is written.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import flow
from pydantic import BaseModel, ConfigDict, Field

from llmflow.flows.evaluate_scheduled import label_of
from llmflow.flows.model_evaluation import (
    add_leaderboard,
    add_model_evaluation,
    add_safety_inputs,
    safety_with_background,
)
from llmflow.tasks.config import PHASES, PipelineConfig, load_config
from llmflow.tasks.evaluation.card import CardConfig, card_config
from llmflow.tasks.evaluation.external import (
    display_name,
    external_model,
    pin_model,
    store_output,
)
from llmflow.tasks.evaluation.suite import PPL_TAG
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.executor import PrefectExecutor
from llmflow.tasks.framework.graph import Existing, Graph, Raw
from llmflow.tasks.framework.resources import data_dir
from llmflow.tasks.framework.step import StepResult
from llmflow.tasks.framework.store import Store

log = logging.getLogger("llmflow.evaluate_models")
PRESET_ROOT = data_dir("configs").parent


class EvaluateModelsRun(BaseModel):
    """Which models to evaluate, against what, with which preset's suite (the UI's Run form)."""

    model_config = ConfigDict(extra="forbid")

    models: list[str] = Field(
        min_length=1,
        description="Model folders or hf://models/OWNER/NAME[@REVISION] ids (pinned when run).",
    )
    preset: str = Field(
        "quickstart",
        description="A preset in configs/ or a YAML path: its evaluate and safety settings.",
    )
    overrides: list[str] = Field(
        default_factory=list, description="Dotted overrides, as `llmflow evaluate --set`."
    )
    root: str | None = Field(None, description="Artifact root (a folder or s3://bucket/prefix).")
    name: str | None = Field(
        None, description="Label of the leaderboard (default: the preset's name)."
    )
    corpus: str | None = Field(
        None,
        description="A decontaminate output of the store (or one downstream of it): scores "
        "carry the share of their items found in it.",
    )
    heldout: str | None = Field(
        None,
        description="A tokenize output of the store whose held-out documents feed the "
        "perplexity tasks (without it they are left out).",
    )

    def config(self) -> PipelineConfig:
        """The resolved, validated pipeline config (only its evaluate/safety/name/root count)."""
        path = Path(self.preset if self.preset.endswith(".yaml") else f"configs/{self.preset}.yaml")
        if not path.is_absolute() and not path.exists():
            path = PRESET_ROOT / path
        overrides = [*self.overrides]
        overrides += [f"{k}={v}" for k, v in (("root", self.root), ("name", self.name)) if v]
        return load_config(path, overrides)


def without_perplexity(config: PipelineConfig) -> PipelineConfig:
    """The config less its held-out perplexity tasks (no tokenize output to draw them from)."""
    tasks = config.evaluate.tasks
    kept = [t for t in tasks if t != PPL_TAG and not t.startswith("ppl_")]
    if kept == tasks:
        return config
    if not kept:
        raise BadInputError(
            f"evaluate.tasks={tasks} are all perplexity tasks, which need --heldout (a tokenize "
            "output); add other tasks or give --heldout"
        )
    log.info("no --heldout: leaving out %s", ", ".join(t for t in tasks if t not in kept))
    return config.model_copy(
        update={"evaluate": config.evaluate.model_copy(update={"tasks": kept})}
    )


def committed(uri: str, field: str, root: str) -> Existing:
    """A store output named by hand, checked to be committed (else BadInputError)."""
    store = Store(root)
    if "://" not in uri and store.is_local:
        uri = str(Path(uri).resolve())
    if not store.is_complete(uri):
        raise BadInputError(f"{field}={uri!r} is not a committed output of the store")
    return Existing(uri)


def unique_labels(names: list[str]) -> list[str]:
    """``names`` with a count appended to repeats (two revisions of one repo, say)."""
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name}-{seen[name]}")
    return labels


def evaluation_graph(
    config: PipelineConfig,
    models: list[str],
    corpus: str | None = None,
    heldout: str | None = None,
) -> Graph:
    """Import, evaluate, safety (when configured) and card per model, then one leaderboard."""
    corpus_leaf = committed(corpus, "corpus", config.root) if corpus else None
    heldout_leaf = committed(heldout, "heldout", config.root) if heldout else None
    if heldout_leaf is None:
        config = without_perplexity(config)
    # every model checked before any is run: a store output as it is, anything else pinned
    found = [(uri, store_output(uri)) for uri in models]
    pinned = [None if output else pin_model(uri) for uri, output in found]
    graph = Graph(PHASES)
    config = safety_with_background(config, corpus_leaf, "--corpus")
    checks = add_safety_inputs(graph, config, config.name, background=corpus_leaf)
    evaluated = []
    names = [
        label_of(out) if out else display_name(pin[0])
        for (_, out), pin in zip(found, pinned, strict=True)
    ]
    for label, (uri, output), pin in zip(unique_labels(names), found, pinned, strict=True):
        if output is not None:
            model = Existing(output)
        else:
            source, files = pin
            model = graph.add(
                external_model, source, label, phase="evaluate", files=Raw(files) if files else None
            )
        evaluated.append(
            add_model_evaluation(
                graph,
                model,
                label,
                name=f"{config.name}-{label}",
                suite=config.evaluate,
                card=model_card_config(config, label, uri),
                safety_inputs=checks,
                heldout=heldout_leaf,
                corpus=corpus_leaf,
            )
        )
    add_leaderboard(graph, config.name, evaluated)
    return graph


def model_card_config(config: PipelineConfig, label: str, source: str) -> CardConfig:
    """The card of a model evaluated here: named for the model, reproduced by this command."""
    return card_config(config, label).model_copy(
        update={"model_name": label, "run_command": f"llmflow evaluate {source}"}
    )


@flow(name="llmflow-evaluate-models", log_prints=True)
def evaluate_models(run: EvaluateModelsRun) -> list[StepResult]:
    """Evaluate models made elsewhere with the preset's suite; cards and a leaderboard."""
    config = run.config()
    graph = evaluation_graph(config, run.models, run.corpus, run.heldout)
    return PrefectExecutor(config.root).run(graph).rows()


def plan_evaluation(run: EvaluateModelsRun) -> Graph:
    """The graph ``evaluate_models`` runs, built (and every input checked) without Prefect."""
    return evaluation_graph(run.config(), run.models, run.corpus, run.heldout)
