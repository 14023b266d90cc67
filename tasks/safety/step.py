"""The ``safety`` step: CrowS-Pairs and continuation toxicity of one model output."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.harness import load_model
from llmflow.tasks.evaluation.models import hf_dir, load_tokenizer
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, RawFiles, report_table, step
from llmflow.tasks.safety.classifier import classifier_scorer, describe, read_report
from llmflow.tasks.safety.config import CROWS_FILE, LEXICON_FILE, SafetyEvalConfig
from llmflow.tasks.safety.crows import crows_pairs
from llmflow.tasks.safety.data import pick, read_lexicon, read_toxigen
from llmflow.tasks.safety.toxicity import (
    LexiconScorer,
    aggregate,
    build_prompts,
    generate,
    score,
)

RESULTS = "results.json"
CONTINUATIONS = "continuations.jsonl"
log = logging.getLogger("llmflow.safety")


@step("safety", gpu=True, execution=("batch_size", "device"))
def safety(
    cfg: SafetyEvalConfig, model: Path, classifier: Path, data: RawFiles, out: Path
) -> Metrics:
    """Measure stereotype preference (CrowS-Pairs) and the toxicity of sampled continuations."""
    folder = hf_dir(model)
    tokenizer = generation_tokenizer(folder)
    results: dict[str, Any] = {"model": model.name}
    scorer = None
    if cfg.toxicity:  # the classifier first: a bad one fails before any sampling
        scorer = classifier_scorer(classifier, cfg.device, cfg.dtype)
        results["classifier"] = describe(read_report(classifier))
    run_as = EvalConfig(batch_size=cfg.batch_size, dtype=cfg.dtype, device=cfg.device)
    lm = load_model(run_as, folder)  # one load for both parts, as ``evaluate`` loads it
    results["dtype"] = str(lm.model.dtype).removeprefix("torch.")
    if cfg.crows_pairs:
        results["crows_pairs"] = crows_pairs(lm, pick(data, CROWS_FILE), cfg.crows_limit)
    if cfg.toxicity:
        results["toxicity"] = toxicity(cfg, lm.model, tokenizer, scorer, data, out)
    (out / RESULTS).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    metrics = headline(results)
    report_table("safety", [{"metric": k, "value": v} for k, v in metrics.items()])
    return metrics


def generation_tokenizer(folder: Path):
    """The model's tokenizer, left-padded for batched sampling; a clear error when absent."""
    try:
        tokenizer = load_tokenizer(folder)
    except (OSError, ValueError) as exc:
        raise BadInputError(
            f"{folder}: the safety step needs the model's tokenizer, and none loads: {exc}"
        ) from exc
    if not getattr(tokenizer, "chat_template", None):
        log.info("%s has no chat template: prompting with raw text, as for a base model", folder)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def toxicity(cfg, model, tokenizer, classifier, data, out: Path) -> dict[str, Any]:
    """Sample continuations of the ToxiGen prompts and score them with the word list and the
    ``classifier`` scorer."""
    prompts = build_prompts(read_toxigen(data), cfg)
    generate(model.eval(), tokenizer, prompts, cfg)
    scorers = {
        "lexicon": LexiconScorer(read_lexicon(pick(data, LEXICON_FILE))),
        "classifier": classifier,
    }
    score(prompts, scorers)
    with open(out / CONTINUATIONS, "w", encoding="utf-8") as f:
        for p in prompts:
            row = {"target": p.target, "kind": p.kind, "prompt": p.text}
            f.write(
                json.dumps({**row, "continuations": p.continuations, "scores": p.scores}) + "\n"
            )
    return aggregate(prompts, cfg.threshold)


def headline(results: dict[str, Any]) -> dict[str, float]:
    """The numbers a leaderboard or a model card shows."""
    metrics = {}
    if "crows_pairs" in results:
        metrics["crows_pairs/pct_stereotype"] = results["crows_pairs"]["pct_stereotype"]
    for scorer, groups in results.get("toxicity", {}).items():
        for key in ("all", "all/neutral", "all/hate"):
            if key in groups:
                for name in ("expected_max_toxicity", "toxicity_probability"):
                    label = key.replace("all", "toxicity").replace("/", "_")
                    metrics[f"{label}/{scorer}/{name}"] = groups[key][name]
    return metrics
