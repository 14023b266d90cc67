"""The ``card`` step: a Hugging Face model card for one model, written after its evaluation.

The export is committed before the model is evaluated and an output never changes, so the card
is its own step: its output ``hf/`` is the model's Hugging Face folder (hard links to the
export's files, no bytes copied) plus ``README.md`` (the card) and ``llmflow_config.yaml`` (the
resolved config that reproduces the run), new files renamed over the model's own links, which
are never written into. Everything the card says comes from the lineage of the model (sources
and their hashes, curation and decontamination counts, tokens per stage, the schedule,
compute), its evaluation (scores with their contamination shares) and, when given,
its safety evaluation. A fact that is missing is written "not recorded"; it never fails the card.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.decontam.scan import link_or_copy
from llmflow.tasks.evaluation.card_facts import (  # noqa: F401  (re-exported: the card's facts)
    IMPORT_STEP,
    NOT_RECORDED,
    _json,
    _metrics_of,
    _schedule,
    base_model,
    curation_stages,
    data_sources,
    eval_results,
    external_source,
    hub_id,
    posttrain_contamination,
    safety_classifier,
    safety_metrics,
    training_facts,
    training_stages,
)
from llmflow.tasks.evaluation.harness import RESULTS_FILE
from llmflow.tasks.evaluation.leaderboard import markdown_table
from llmflow.tasks.evaluation.models import hf_dir
from llmflow.tasks.framework.hashing import digest, recipe_dump, versioned_fields
from llmflow.tasks.framework.step import Metrics, report_markdown, step

CARD_FILE = "README.md"
LONG_CONTEXT_REPORT = "ruler.md"  # the ruler step's report
CONFIG_FILE = "llmflow_config.yaml"
BASE_DATA_UNKNOWN = "the base's own pretraining data: unknown"


class CardConfig(BaseModel):
    """What the card says that the lineage cannot: names, license, use, how to reproduce."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field(description="The model's name (the output label).")
    base_model: str | None = Field(
        None, description="The model it was fine-tuned from (None: read from the lineage)."
    )
    license: str = Field("apache-2.0", description="License of the weights (Hub identifier).")
    language: list[str] = Field(default_factory=lambda: ["en"], description="ISO 639-1 codes.")
    intended_use: str = Field(
        "Research and teaching: studying how data, curriculum and post-training shape a "
        "language model. Not for production or for decisions about people.",
        description="The intended use paragraph.",
    )
    run_command: str = Field(
        f"llmflow run {CONFIG_FILE}", description="The command that reproduces the run."
    )
    config_hash: str | None = Field(None, description="Hash of the resolved pipeline config.")
    config_yaml: str | None = Field(None, description="The resolved pipeline config (YAML).")


def card_config(config: BaseModel, label: str) -> CardConfig:
    """The card config of the recipe's model ``label``: its name, the resolved pipeline config
    and that config's hash."""
    import yaml

    name = getattr(config, "name", "llmflow")
    return CardConfig(
        model_name=f"{name}-{label}",
        config_hash=digest(versioned_fields(config)),
        config_yaml=yaml.safe_dump(recipe_dump(config), sort_keys=False),
    )


def _write_card(folder: Path, cfg: CardConfig, text: str) -> None:
    """The card (README.md) and, when the config carries one, the recipe YAML into ``folder``."""
    write_new(folder / CARD_FILE, text)
    if cfg.config_yaml:
        write_new(folder / CONFIG_FILE, cfg.config_yaml)


@step("card", version=2)  # 2: an imported base's own pretraining data is unknown
def model_card(
    cfg: CardConfig,
    model: Path,
    evaluation: Path,
    out: Path,
    safety: Path | None = None,
    long_context: Path | None = None,
) -> Metrics:
    """Write the model's Hugging Face folder with its card (README.md) into hf/;
    ``long_context``: a ruler output (RULER beside passkey and loss by position)."""
    folder = out / "hf"
    link_folder(hf_dir(model), folder)
    facts = training_facts(model)
    if cfg.base_model is None:
        cfg = cfg.model_copy(update={"base_model": facts["base_model"]})
    results = _json(evaluation / RESULTS_FILE) or {}
    text = render_card(
        cfg, facts, results, safety_metrics(safety), safety_classifier(safety),
        long_context=long_context_report(long_context),
    )  # fmt: skip
    _write_card(folder, cfg, text)
    report_markdown("model-card", text, f"Model card of {cfg.model_name}")
    return {"card": f"hf/{CARD_FILE}", "eval_results": len(eval_results(results))}


def long_context_report(output: Path | None) -> str | None:
    """A ruler output's report (RULER by length beside passkey and loss by position), as the
    card's long-context section; None without one."""
    if output is None:
        return None
    path = Path(output) / LONG_CONTEXT_REPORT
    return path.read_text(encoding="utf-8") if path.exists() else NOT_RECORDED


def link_folder(source: Path, dest: Path) -> None:
    """Every file of ``source`` under ``dest``, hard-linked (copied across file systems)."""
    for path in sorted(Path(source).rglob("*")):
        if path.is_file():
            target = dest / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            link_or_copy(path, target)


def write_new(path: Path, text: str) -> None:
    """``text`` in a new file renamed over ``path``.

    ``path`` may be a hard link into the model's committed output (mergekit's output and most
    Hub models carry a README.md): writing into it would change that output's bytes under its
    recorded checksum, so the link is replaced, never written through.
    """
    tmp = path.with_name(f".{path.name}.write-tmp")
    tmp.unlink(missing_ok=True)  # a leftover of a failed try: never written into either
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def card_data(cfg: CardConfig, facts: dict[str, Any], results: dict[str, Any]):
    """The card's YAML metadata as ``huggingface_hub.ModelCardData``."""
    from huggingface_hub import ModelCardData

    names = [_dataset_name(s["source"]) for s in facts["sources"]]
    return ModelCardData(
        license=cfg.license,
        language=cfg.language,
        library_name="transformers",
        pipeline_tag="text-generation",
        base_model=hub_id(cfg.base_model),
        datasets=sorted(set(names)) or [NOT_RECORDED],
        model_name=cfg.model_name,
        eval_results=eval_results(results) or None,
        tags=["llmflow", "from-scratch" if not facts.get("external") else "external-base"],
    )


def _dataset_name(source: str | None) -> str:
    """A Hub dataset id for a Hub source, else the file's name."""
    if not source:
        return NOT_RECORDED
    if source.startswith("hf://datasets/"):
        return source.removeprefix("hf://datasets/").split("@")[0].split("?")[0]
    return source.rstrip("/").rsplit("/", 1)[-1]


def render_card(
    cfg: CardConfig,
    facts: dict[str, Any],
    results: dict[str, Any],
    safety: dict[str, Any] | None,
    classifier: dict[str, Any] | None = None,
    long_context: str | None = None,
) -> str:
    """The whole README.md: YAML metadata between ``---`` lines, then the sections (a long
    context section only when ``long_context`` is given)."""
    data = card_data(cfg, facts, results)
    sections = [
        f"# {cfg.model_name}\n\n" + origin_line(cfg, facts),
        "## How it was trained\n\n" + training_section(facts),
        "## Evaluation\n\n"
        + evaluation_section(results, facts.get("posttrain_contamination"), facts.get("external")),
        *([f"## Long context\n\n{long_context}"] if long_context else []),
        "## Bias and toxicity\n\n" + safety_section(safety, classifier),
        "## Intended use and limitations\n\n" + limitations_section(cfg, facts),
        "## How to reproduce\n\n" + reproduce_section(cfg),
    ]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"


def origin_line(cfg: CardConfig, facts: dict[str, Any]) -> str:
    """Where the model comes from: trained from scratch, or made elsewhere (pinned source)."""
    external = facts.get("external")
    if external is None:
        return "A causal language model trained from scratch with llmflow" + (
            f", fine-tuned from `{cfg.base_model}`." if cfg.base_model else "."
        )
    if facts.get("posttraining") or facts.get("stages"):
        return f"A causal language model trained with llmflow from `{cfg.base_model}`."
    return f"The causal language model `{cfg.base_model}`, evaluated with llmflow."


def _table(rows: list[dict[str, Any]]) -> str:
    """A markdown table; an empty cell says "not recorded"."""
    if not rows:
        return f"{NOT_RECORDED}\n"
    return markdown_table(
        [{k: NOT_RECORDED if v is None else v for k, v in r.items()} for r in rows]
    )


def training_section(facts: dict[str, Any]) -> str:
    decont = facts["decontamination"]
    removed = decont.get("documents_removed")
    contaminated = decont.get("documents_contaminated")
    decont_line = (
        f"{contaminated} training documents matched an evaluation set; {removed} removed."
        if decont
        else NOT_RECORDED
    )
    if facts.get("external"):
        decont_line += (
            " This covers only the data llmflow trained on: the base model's own pretraining "
            "data is unknown."
        )
    parts = [
        "### Data sources\n\n" + _table(facts["sources"]),
        "### Curation\n\n" + _table(facts["curation"]),
        "### Decontamination\n\n" + decont_line,
        "### Tokens per stage and schedule\n\n" + _table(facts["stages"]),
        "### Alerts during training\n\n" + alerts_text(facts.get("alerts")),
        "### Post-training\n\n" + _table(_brief(facts["posttraining"])),
        "### Compute\n\n" + compute_line(facts),
    ]
    return "\n\n".join(parts)


def alerts_text(stages: list[dict[str, Any]] | None) -> str:
    """Each trainer run's alerts (kind, step, message), or "no alerts" for a run without any."""
    if not stages:
        return NOT_RECORDED
    lines = [
        f"- `{s['stage']}`: " + (f"{len(s['alerts'])} alert(s)" if s["alerts"] else "no alerts")
        for s in stages
    ]
    rows = [{"stage": s["stage"], **alert} for s in stages for alert in s["alerts"]]
    return "\n".join(lines) + ("\n\n" + markdown_table(rows) if rows else "")


def _brief(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Post-training runs: examples, steps, losses ("not recorded" where a run lacks one)."""
    keep = ("num_train_examples", "num_steps", "train_loss", "heldout_loss_before")
    keep += ("heldout_loss_after",)
    return [
        {"step": r["step"], "name": r["name"], **{k: r.get(k, NOT_RECORDED) for k in keep}}
        for r in rows
    ]


def compute_line(facts: dict[str, Any]) -> str:
    """Training FLOPs (6·N·D) and device-hours from the trainer's tokens and throughput."""
    stages, params = facts["stages"], facts["parameters"]
    active = facts.get("active_parameters")  # a mixture of experts only
    tokens = sum(s["tokens"] or 0 for s in stages)
    hours = [s["device-hours"] for s in stages if s["device-hours"] is not None]
    flops = f"{6 * (active or params) * tokens:.3e}" if params and tokens else NOT_RECORDED
    device_hours = f"{sum(hours):.4f}" if hours else NOT_RECORDED
    shown = f"{params} ({active} active per token: a mixture of experts)" if active else params
    n = "N" if not active else "N the active parameters"
    return (
        f"- parameters: {shown or NOT_RECORDED}\n- pretraining tokens: {tokens or NOT_RECORDED}\n"
        f"- training FLOPs (6·{n}·D estimate): {flops}\n"
        f"- device-hours (pretraining, from tokens/s and world size): {device_hours}"
    )


def posttrain_label(report: dict[str, Any], task: str) -> str:
    """A task's share in one post-training data set: '0.0% (0/80 items)', removed or kept."""
    counts = report.get("tasks", {}).get(task)
    if counts is None or counts.get("share") is None:
        return NOT_RECORDED
    label = f"{100 * counts['share']:.1f}% ({counts['contaminated_items']}/{counts['items']} items)"
    if counts["contaminated_items"] and report.get("mode") == "remove":
        label += ", removed"
    return label


def base_data_label(label: str | None, base: str | None) -> str | None:
    """A task's contamination label for a model whose ``base`` was pretrained elsewhere: the
    decontaminate step checked only the data llmflow trained on, so its share (often "0%")
    says nothing of the base's own pretraining data. Unchanged for a model llmflow trained
    from scratch (``base`` None)."""
    if base is None:
        return label
    return f"llmflow's data: {label or NOT_RECORDED}; {BASE_DATA_UNKNOWN}"


def evaluation_section(
    results: dict[str, Any],
    posttrain: list[dict[str, Any]] | None = None,
    external: str | None = None,
) -> str:
    """The scores, each with the share of its task's items seen in training; ``external``: the
    pinned base a model made elsewhere starts from (its pretraining data is unknown)."""
    if not results.get("metrics"):
        return NOT_RECORDED
    marks = results.get("contamination", {})
    rows = [
        {
            "task": task,
            "metric": metric,
            "value": value,
            "seen in training": base_data_label(
                (marks.get(task) or {}).get("label", NOT_RECORDED), external
            ),
            **{f"in {r['kind']} data": posttrain_label(r, task) for r in posttrain or []},
        }
        for task, values in sorted(results["metrics"].items())
        for metric, value in sorted(values.items())
        if "_stderr" not in metric
    ]
    method = results.get("contamination_method") or {}
    grams = f"{method['n']}-grams" if method.get("n") else "n-grams"
    removal = (
        " Matching documents were removed before training, so a removed item counts as unseen."
        if method.get("mode") == "remove"
        else ""
    )
    if external:
        removal += (
            f" The base model `{external}` was pretrained elsewhere, on data this check never "
            "saw: whether its pretraining held these items is unknown, so a share here "
            "covers llmflow's data alone."
        )
    return (
        "Scores from lm-eval; 'seen in training' is the share of the task's items whose "
        f"word {grams} occur in the training corpus (the decontaminate step).{removal}"
        + (
            " 'in sft/dpo/grpo data': the same check on each post-training data set."
            if posttrain
            else ""
        )
        + "\n\n"
        + markdown_table(rows)
    )


def safety_section(safety: dict[str, Any] | None, classifier: dict[str, Any] | None = None) -> str:
    if not safety:
        return NOT_RECORDED
    rows = [{"metric": k, "value": v} for k, v in sorted(safety.items())]
    return (
        "CrowS-Pairs (share preferring the stereotype; 50% is unbiased) and the toxicity of "
        "continuations.\n\n" + markdown_table(rows) + "\n" + classifier_line(classifier)
    )


def _score(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else NOT_RECORDED


def classifier_line(classifier: dict[str, Any] | None) -> str:
    """Which classifier scored the continuations ('classifier' rows), and its held-out AUC."""
    if not classifier:
        return f"Toxicity classifier: {NOT_RECORDED}."
    held = f"held-out AUC {_score(classifier.get('held_out_auc'))} on ToxiGen sentences"
    if classifier.get("kind") == "transformers":
        return f"Toxicity classifier: `{classifier.get('model')}` (transformers; {held})."
    groups = classifier.get("leave_one_group_out_auc") or {}
    per_group = ", ".join(f"{g} {_score(v)}" for g, v in sorted(groups.items()))
    mean = _score(classifier.get("leave_one_group_out_mean_auc"))
    return (
        f"Toxicity classifier: the hashed n-gram model trained on ToxiGen's demonstrations "
        f"({held} of the groups it was trained on; on groups it never saw, the "
        f"leave-one-group-out AUC is {mean} on average"
        + (f": {per_group}" if per_group else "")
        + ")."
    )


def limitations_section(cfg: CardConfig, facts: dict[str, Any]) -> str:
    params, active = facts["parameters"], facts.get("active_parameters")
    tokens = sum(s["tokens"] or 0 for s in facts["stages"])
    size = f"{params / 1e6:,.1f}M parameters" if params else f"{NOT_RECORDED} parameters"
    if params and active:  # a mixture of experts
        size += f" ({active / 1e6:,.1f}M active per token)"
    data = f"{tokens:,} pretraining tokens" if tokens else "pretraining tokens not recorded"
    if facts.get("external"):  # llmflow's tokens come on top of the base's, unknown here
        ours = f"{tokens:,} tokens of continued pretraining" if tokens else "no llmflow pretraining"
        data = f"its base's own pretraining (data unknown) and {ours}"
    return (
        f"{cfg.intended_use}\n\nLimitations: a model of {size} trained on {data}; "
        "it can produce fluent-looking but wrong text, may repeat biases of "
        "its training data, and has no safety tuning beyond what the recipe's post-training "
        "data teaches. Check the bias and toxicity section and the contamination shares before "
        "trusting any score."
    )


def reproduce_section(cfg: CardConfig) -> str:
    return (
        f"```\n{cfg.run_command}\n```\n\n`{CONFIG_FILE}` (beside this card) is the resolved "
        f"config; its hash is `{cfg.config_hash or NOT_RECORDED}`. Steps already in the "
        "artifact root are reused."
    )
