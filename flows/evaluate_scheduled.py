"""Scheduled evaluation: score every model output in the store once per suite, keep a leaderboard.

The recipe is a graph: per committed model output (``export``, ``sft``, ``dpo``; each an
``Existing`` leaf) and per model made elsewhere (``models``: a folder or
``hf://models/OWNER/NAME[@REV]``, pinned at each run and copied in by ``external-model``), the
recipe's own per-model evaluation (``add_model_evaluation``: ``evaluate``, ``safety`` when it
has a classifier to trust, ``card``), then one ``leaderboard`` over the models that were scored.
Safety needs ``corpus`` (a decontaminated corpus of the store: the hashed toxicity classifier's
ordinary text) or ``safety.classifier.model``; without either it is off, said in the log.
The store's content addressing makes it run-once: an evaluation of the same model on the same
suite has the same address, so a later run finds it (Cached) instead of scoring again. A model
that fails to evaluate (a truncated safetensors, say) fails alone: the others are scored, the
leaderboard is built over them, then the run ends Failed naming it. Deploy it with a cron
schedule (``deployments/prefect.yaml``).

Two runs that overlap (a slow run and the next scheduled one, or a manual run) never evaluate one
model output twice: a run holds the one slot of a Prefect global concurrency limit named after
its store root (``store_lock``) while it evaluates, so the second waits, then finds every
evaluation the first made in the store. The store's own file lock covers runs on one machine;
this limit covers workers on different machines sharing one store (S3) and one Prefect server.
The deployments also set ``concurrency_limit: 1``.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, ConfigDict, Field

from llmflow.flows.model_evaluation import (
    Evaluated,
    add_leaderboard,
    add_model_evaluation,
    add_safety_inputs,
    safety_with_background,
)
from llmflow.tasks.evaluation.card import CardConfig, card_config
from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.external import STEP_NAME as EXTERNAL_STEP
from llmflow.tasks.evaluation.external import (
    ExternalModelConfig,
    display_name,
    external_model,
    pin_model,
)
from llmflow.tasks.evaluation.harness import evaluate
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.executor import Outcome, PrefectExecutor
from llmflow.tasks.framework.graph import Existing, Graph, Node, Raw
from llmflow.tasks.framework.store import Store
from llmflow.tasks.safety.config import SafetyConfig

MODEL_STEPS = ("export", "sft", "dpo")  # the steps whose outputs hold a model in hf/
LEADERBOARD_NAME = "scheduled"
LOCK_PREFIX = "llmflow-scheduled-evaluation"


class ScheduledEvaluationConfig(BaseModel):
    """The store to scan, the suite to run, and the held-out documents for perplexity."""

    model_config = ConfigDict(extra="forbid")

    root: str = Field("./runs", description="Artifact root: a folder or s3://bucket/prefix.")
    evaluate: EvalConfig = Field(
        default_factory=lambda: EvalConfig(
            tasks=["cf_arith", "mcf_arith", "gen_arith", "cf_facts"]
        ),
        description="The suite (the perplexity tasks need heldout).",
    )
    heldout: str | None = Field(
        None,
        description="A committed tokenize output (store URI) whose validation_docs feed the "
        "held-out perplexity tasks.",
    )
    models: list[str] = Field(
        default_factory=list,
        description="Models made elsewhere, evaluated too: folders or "
        "hf://models/OWNER/NAME[@REVISION], pinned at each run (a revision that moved is a "
        "new model, scored once).",
    )
    safety: SafetyConfig = Field(
        default_factory=SafetyConfig,
        description="Bias and toxicity settings (on when corpus or safety.classifier.model is "
        "set: the hashed classifier needs a corpus's ordinary text).",
    )
    corpus: str | None = Field(
        None,
        description="A committed decontaminate output (store URI): the toxicity classifier's "
        "ordinary text, and the share of each task's items found in it.",
    )


class CheckpointEvalError(RuntimeError):
    """One or more model outputs failed to evaluate; the message names each."""


def model_outputs(store: Store) -> list[str]:
    """Every committed model output in the store (none in a fresh root)."""
    return [uri for step_name in MODEL_STEPS for uri in store.list_outputs(step_name)]


def label_of(uri: str) -> str:
    """The evaluation label of a model output, the one the pipeline gives it (so an evaluation
    the pipeline made is found, not repeated): the output's label less its hash, with the step
    appended for post-trained models (``export/quickstart-base-<hash>`` -> ``quickstart-base``,
    ``sft/quickstart-<hash>`` -> ``quickstart-sft``)."""
    step_name, label, _ = Store.address_of(uri)
    if step_name in ("export", EXTERNAL_STEP) or label.endswith(f"-{step_name}"):
        return label
    return f"{label}-{step_name}"


def evaluation_graph(
    config: ScheduledEvaluationConfig,
    models: list[str],
    external: list[tuple[ExternalModelConfig, tuple[str, ...]]] = (),
) -> Graph:
    """The recipe's per-model evaluation of each model output, on the same suite; a model made
    elsewhere is first copied into the store (``external-model``, pinned)."""
    graph = Graph()
    heldout = Existing(config.heldout) if config.heldout else None
    corpus = committed_corpus(config)
    config = safety_with_background(config, corpus, "corpus")
    # no model, no classifier: an empty store stays an empty graph
    checks = None
    if models or external:
        checks = add_safety_inputs(graph, config, LEADERBOARD_NAME, background=corpus)
    found: list[tuple[str, str, Node | Existing]] = [
        (uri, label_of(uri), Existing(uri)) for uri in models
    ]
    for source, files in external:
        name = display_name(source)
        model = graph.add(external_model, source, name, files=Raw(files) if files else None)
        found.append((source.pinned, name, model))
    for source, label, model in found:
        add_model_evaluation(
            graph,
            model,
            label,
            name=label,
            suite=config.evaluate,
            card=scheduled_card(config, label, source),
            safety_inputs=checks,
            heldout=heldout,
            corpus=corpus,
        )
    return graph


def committed_corpus(config: ScheduledEvaluationConfig) -> Existing | None:
    """``config.corpus`` as an input, checked to be a committed output of the store."""
    if config.corpus is None:
        return None
    if not Store(config.root).is_complete(config.corpus):
        raise BadInputError(f"corpus={config.corpus!r} is not a committed output of the store")
    return Existing(config.corpus)


def scheduled_card(config: ScheduledEvaluationConfig, label: str, source: str) -> CardConfig:
    """The card of a model scored here: named for the model, with the suite that scored it (the
    model list is left out, so adding a model does not re-card the others)."""
    suite = config.model_copy(update={"models": []})
    command = f"scheduled evaluation of {config.root} (deployments/prefect.yaml) on {source}"
    return card_config(suite, label).model_copy(
        update={"model_name": label, "run_command": command}
    )


def pin_external(refs: list[str]) -> tuple[list, list[dict[str, Any]]]:
    """Each external model pinned now, and a failed row for each that cannot be (a repo gone,
    a folder without weights): one bad reference does not stop the others."""
    pinned, rows = [], []
    for ref in refs:
        try:
            pinned.append(pin_model(ref))
        except BadInputError as err:
            rows.append({"checkpoint": ref, "status": "failed", "cached": False,
                         "evaluation": "", "card": "", "error": str(err)})  # fmt: skip
    return pinned, rows


def leaderboard_graph(scored: list[tuple[str, str, str]]) -> Graph:
    """One leaderboard over ``(model, evaluation, card)`` URIs, labelled uniquely."""
    labels = [label_of(model) for model, _, _ in scored]
    if len(set(labels)) < len(labels):  # same label, other hashes: keep the folder names
        labels = [model.rstrip("/").rsplit("/", 1)[-1] for model, _, _ in scored]
    graph = Graph()
    entries = [
        Evaluated(label, Existing(model), Existing(evaluation), Existing(card))
        for label, (model, evaluation, card) in zip(labels, scored, strict=True)
    ]
    add_leaderboard(graph, LEADERBOARD_NAME, entries)
    return graph


def statuses(graph: Graph, outcome: Outcome) -> list[dict[str, Any]]:
    """One row per model output: ok (its evaluation, safety and card ran or were cached) or
    failed, with the first of them that failed."""
    rows = []
    for scores in graph.find(step=evaluate.name):
        (card,) = [n for n in graph.find(step="card") if n.inputs["evaluation"] is scores]
        checked = card.inputs.get("safety")
        classifier = checked.inputs["classifier"] if checked is not None else None
        nodes = [n for n in (scores, classifier, checked, card) if n is not None]
        failed = [outcome.failed[n] for n in nodes if n in outcome.failed]
        row: dict[str, Any] = {"checkpoint": _model_uri(scores, outcome)}
        if failed:
            row.update(status="failed", cached=False, evaluation="", card="", error=f"{failed[0]}")
        else:
            result = outcome.results[scores]
            row.update(status="ok", cached=result.cached, evaluation=result.uri, error="")
            row["card"] = outcome.results[card].uri
        rows.append(row)
    return rows


def _model_uri(node: Node, outcome: Outcome) -> str:
    """The evaluated model's URI: an output of the store, or the copy of an external model
    (its pinned source when the copy failed)."""
    model = node.inputs["model"]
    if isinstance(model, Existing):
        return model.uri
    if model in outcome.results:
        return outcome.results[model].uri
    return model.config.pinned


def raise_for_failures(rows: list[dict[str, Any]]) -> None:
    """Raise ``CheckpointEvalError`` naming every model output that failed, if any did."""
    failed = [f"{r['checkpoint']}: {r['error']}" for r in rows if r["status"] != "ok"]
    if failed:
        raise CheckpointEvalError(
            f"{len(failed)} checkpoint(s) failed to evaluate:\n" + "\n".join(failed)
        )


def build_leaderboard(executor: PrefectExecutor, rows: list[dict[str, Any]]) -> list[dict]:
    """The leaderboard over the models scored so far; a row for it if it failed."""
    scored = [(r["checkpoint"], r["evaluation"], r["card"]) for r in rows if r["status"] == "ok"]
    if not scored:
        return []
    failed = executor.run(leaderboard_graph(scored)).failed.values()
    return [
        {"checkpoint": "(leaderboard)", "status": "failed", "cached": False, "evaluation": "",
         "card": "", "error": str(err)}
        for err in failed
    ]  # fmt: skip


def lock_name(root: str) -> str:
    """The global concurrency limit of one store root (runs on other roots don't wait)."""
    return f"{LOCK_PREFIX}-{hashlib.sha256(root.encode()).hexdigest()[:16]}"


def _ensure_limit(name: str) -> None:
    """Create the one-slot limit ``name`` unless it exists (a concurrent creator may win)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=1)
                )


@contextlib.contextmanager
def store_lock(root: str) -> Iterator[None]:
    """Hold the one slot of the store root's limit: one scheduled evaluation per store at once."""
    from prefect.concurrency.sync import concurrency

    name = lock_name(root)
    _ensure_limit(name)
    # NOTE: strict: without the limit two runs could both evaluate; a missing one is an error.
    with concurrency(name, occupy=1, strict=True):
        yield


@flow(name="llmflow-scheduled-evaluation", log_prints=True)
def scheduled_evaluation(
    config: ScheduledEvaluationConfig = ScheduledEvaluationConfig(),  # noqa: B008
) -> list[dict[str, Any]]:
    """Evaluate model outputs not yet scored, rebuild the leaderboard, fail naming failures."""
    executor = PrefectExecutor(config.root, keep_going=True)
    with store_lock(executor.store.root):
        external, rows = pin_external(config.models)
        graph = evaluation_graph(config, model_outputs(executor.store), external)
        rows = statuses(graph, executor.run(graph)) + rows
        rows += build_leaderboard(executor, rows)
    create_table_artifact(
        rows or [{"checkpoint": "(no model outputs yet)", "status": "", "error": ""}],
        key="llmflow-scheduled-evaluation",
        description="Each model output in the store: evaluated now, cached, or failed",
    )
    new = sum(1 for r in rows if r["status"] == "ok" and not r["cached"])
    failed = sum(1 for r in rows if r["status"] != "ok")
    print(f"{len(rows)} model(s): {new} evaluated now, {failed} failure(s)")
    raise_for_failures(rows)
    return rows
