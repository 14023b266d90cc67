"""Per-model evaluation, wired in one place: ``evaluate``, then ``safety`` (when its inputs are
set), then the ``card``; the three make the model's leaderboard entry.

The recipe (each export and post-trained model), ``llmflow evaluate`` (models made elsewhere) and
the scheduled evaluation (every model output of a store) all call ``add_model_evaluation``, so a
new per-model step is added here once and all three get it. What differs between them is passed
in: the output label, the suite, the card's config, the held-out documents and the corpus.

    model ─► evaluate ─────────────► card ─► (leaderboard entry)
          └► safety (classifier, files) ┘
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel

from llmflow.tasks.evaluation.card import CardConfig, model_card
from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.harness import evaluate
from llmflow.tasks.evaluation.leaderboard import LeaderboardConfig, leaderboard
from llmflow.tasks.framework.graph import Existing, Graph, Node, Raw
from llmflow.tasks.safety.classifier import toxicity_classifier
from llmflow.tasks.safety.config import SafetyConfig, SafetyEvalConfig
from llmflow.tasks.safety.data import safety_files
from llmflow.tasks.safety.step import safety

log = logging.getLogger("llmflow.model_evaluation")
C = TypeVar("C", bound=BaseModel)  # a config with ``evaluate`` and ``safety`` sections
Input = Node | Existing  # an output made in this graph, or one already committed in the store


@dataclass(frozen=True)
class SafetyInputs:
    """What every model's ``safety`` step shares: its settings, the classifier and the files."""

    config: SafetyEvalConfig
    classifier: Node
    data: Raw


@dataclass(frozen=True)
class Evaluated:
    """One model's evaluation nodes: its leaderboard entry (``safety`` None when it is off)."""

    label: str
    model: Input
    scores: Input
    card: Input
    safety: Input | None = None


def safety_config(config: BaseModel) -> SafetyEvalConfig:
    """The safety step's settings of a config with ``safety`` and ``evaluate`` sections, with the
    model loaded as ``evaluate`` loads it."""
    run_as = {"dtype": config.evaluate.dtype, "device": config.evaluate.device}
    return config.safety.eval.model_copy(update=run_as)


def safety_with_background(config: C, background: Input | None, corpus_field: str) -> C:
    """``config`` with safety off (said in the log) when its classifier would be the hashed one
    with no ``background`` corpus to learn ordinary text from; as it is otherwise."""
    settings = config.safety
    if background is not None or not settings.data_root or settings.classifier.model is not None:
        return config
    # NOTE: the hashed classifier learns "not hateful" from a corpus's ordinary text; without
    # one it scores any continuation near 0.5, which would read as toxicity.
    log.info(
        "safety is off for these models: the hashed toxicity classifier needs %s (its ordinary "
        "text) or safety.classifier.model (a transformers classifier)",
        corpus_field,
    )
    off = settings.model_copy(update={"data_root": None})
    return config.model_copy(update={"safety": off})


def add_safety_inputs(
    graph: Graph, config: BaseModel, name: str, background: Input | None
) -> SafetyInputs | None:
    """The toxicity classifier (taught that ``background``'s ordinary text is not hateful) and
    the safety files of ``config.safety``; None when ``safety.data_root`` is None."""
    settings: SafetyConfig = config.safety
    if settings.data_root is None:
        return None
    files = Raw(tuple(safety_files(settings.data_root)))
    classifier = graph.add(
        toxicity_classifier,
        settings.classifier,
        name,
        phase="evaluate",
        data=files,
        background=background,
    )
    return SafetyInputs(safety_config(config), classifier, files)


def add_model_evaluation(
    graph: Graph,
    model: Input,
    label: str,
    *,
    name: str,
    suite: EvalConfig,
    card: CardConfig,
    safety_inputs: SafetyInputs | None = None,
    heldout: Input | None = None,
    corpus: Input | None = None,
    phase: str = "evaluate",
    long_context: Input | None = None,
) -> Evaluated:
    """Evaluate ``model`` on ``suite``, measure its safety (when ``safety_inputs``), write its card.

    Args:
        graph: The graph the nodes are appended to.
        model: The model output (an export, a post-trained model, an external model).
        label: The model's label on the leaderboard.
        name: The outputs' label in the store (``quickstart-base``).
        suite: The evaluation suite.
        card: The card's config.
        safety_inputs: The classifier and files of ``add_safety_inputs``; None: no safety step.
        heldout: A tokenize output whose held-out documents feed the perplexity tasks.
        corpus: A decontaminated corpus whose share of each task's items the scores carry.
        phase: The phase of the three nodes (``--until`` cuts by phase).
        long_context: A ruler output whose scores (of the checkpoint exported) join the card.
    """
    scores = graph.add(
        evaluate, suite, name, phase=phase, model=model, heldout=heldout, corpus=corpus
    )
    checked = None
    if safety_inputs is not None:
        checked = graph.add(
            safety,
            safety_inputs.config,
            name,
            phase=phase,
            model=model,
            classifier=safety_inputs.classifier,
            data=safety_inputs.data,
        )
    written = graph.add(
        model_card, card, name, phase=phase, model=model, evaluation=scores, safety=checked,
        long_context=long_context,
    )  # fmt: skip
    return Evaluated(label, model, scores, written, checked)


def add_leaderboard(
    graph: Graph, name: str, entries: list[Evaluated], long_context: list[Input] | None = None
) -> Node:
    """Every evaluated model x task in one table, with each model's card (and the RULER scores
    of ``long_context``'s ruler outputs in their models' rows)."""
    return graph.add(
        leaderboard,
        LeaderboardConfig(labels=[e.label for e in entries]),
        name,
        evaluations=[e.scores for e in entries],
        models=[e.model for e in entries],
        cards=[e.card for e in entries],
        long_context=long_context,
    )
