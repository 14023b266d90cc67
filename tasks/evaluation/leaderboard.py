"""The ``leaderboard`` step: every evaluated model x task, plots, each task's signal quality.

Signal quality answers "is this task worth watching at this scale?":

- ``monotonicity``: Spearman correlation of the metric with tokens seen, signed so that +1 means
  "improves steadily with training" (perplexity falls, accuracy rises); averaged over seeds.
- ``seed_std``: the standard deviation across seeds at the same point of training, averaged
  over the points that several seeds share.
- ``snr``: the metric's range over training divided by ``seed_std``; a task whose training
  trend is smaller than its seed noise cannot rank checkpoints or runs.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.evaluation.harness import RESULTS_FILE
from llmflow.tasks.evaluation.models import read_progress
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, report_markdown, step

MIN_MONOTONICITY = 0.5  # Spearman below this: the task does not track training (yet)
MIN_SNR = 2.0  # a training trend under twice the seed noise cannot rank runs
MODEL_METRICS = "leaderboard_metrics.json"  # a model output's own scores (GRPO writes them)


class LeaderboardConfig(BaseModel):
    """Which evaluations make one leaderboard, with their labels in order."""

    model_config = ConfigDict(extra="forbid")

    labels: list[str] = Field(description="One label per evaluated model, in input order.")


@step("leaderboard", version=2)  # 2: models.json names each base and its unknown data
def leaderboard(
    cfg: LeaderboardConfig,
    evaluations: list[Path],
    models: list[Path],
    out: Path,
    cards: list[Path] | None = None,
    long_context: list[Path] | None = None,
) -> Metrics:
    """Every evaluated model x task in one table, plots against tokens seen, signal quality;
    ``long_context``: outputs scoring one of the models (RULER), each its row's extra tasks."""
    if not len(cfg.labels) == len(evaluations) == len(models):
        raise BadInputError(
            f"leaderboard: {len(cfg.labels)} labels, {len(evaluations)} evaluations and "
            f"{len(models)} models; give one label and one model per evaluation"
        )
    records = [
        _record(label, evaluation, model)
        for label, evaluation, model in zip(cfg.labels, evaluations, models, strict=True)
    ]
    for output in long_context or []:
        add_labelled_metrics(records, cfg.labels, output)
    summary = build_leaderboard(records, out)
    wide = json.loads((out / "leaderboard.json").read_text())
    quality = (out / "signal_quality.md").read_text()
    trust = markdown_table(model_cards(cfg.labels, records, cards, out, models))
    report_markdown(
        "leaderboard",
        f"## Leaderboard\n\n{markdown_table(wide)}\n\n## Signal quality\n\n{quality}"
        f"\n\n## Model cards and contamination\n\n{trust}",
        "Every model x task, and which tasks are worth watching",
    )
    return summary


def model_cards(
    labels: list[str],
    records: list[dict],
    cards: list[Path] | None,
    out: Path,
    models: list[Path] | None = None,
) -> list[dict[str, Any]]:
    """One row per model: a link to its card, its base, and per task the share of the task's
    items seen in its training corpus (``models.json`` / ``models.md``). For a model whose base
    was pretrained elsewhere (found through ``models``' lineage) that share covers llmflow's
    data alone, and the row says the base's own pretraining data is unknown."""
    # NOTE: imported here: card.py imports this module (markdown_table)
    from llmflow.tasks.evaluation.card import base_data_label, external_source

    rows = []
    for index, (label, record) in enumerate(zip(labels, records, strict=True)):
        card = cards[index] / "hf" / "README.md" if cards and index < len(cards) else None
        base = external_source(models[index]) if models and index < len(models) else None
        row = {"model": label, "card": f"[README.md]({card})" if card else "not written"}
        if models:
            row["base"] = base or "none (trained from scratch)"
        for task, mark in sorted(record.get("contamination", {}).items()):
            row[f"{task} contamination"] = base_data_label(mark.get("label"), base)
        rows.append(row)
    (out / "models.json").write_text(json.dumps(rows, indent=1))
    (out / "models.md").write_text(markdown_table(rows))
    return rows


def _record(label: str, evaluation: Path, model: Path) -> dict[str, Any]:
    """One evaluation's results with the model's label and progress (its progress.json)."""
    record = json.loads((evaluation / RESULTS_FILE).read_text())
    record["checkpoint"] = {"key": label, "seed": None, **read_progress(model)}
    add_model_metrics(record, model)
    return record


def add_model_metrics(record: dict[str, Any], model: Path) -> None:
    """Tasks a training step scored itself (GRPO's held-out verifiable rewards) join the
    model's row: ``leaderboard_metrics.json`` beside the model holds ``metrics`` and
    ``higher_is_better`` per task, like ``results.json``."""
    path = Path(model) / MODEL_METRICS
    if path.exists():
        _merge_metrics(record, json.loads(path.read_text()))


def add_labelled_metrics(records: list[dict[str, Any]], labels: list[str], output: Path) -> None:
    """Tasks another step scored on one of the models (the ruler step's RULER scores of the
    extended checkpoint) join that model's row: ``leaderboard_metrics.json`` in ``output``,
    with the model's ``label`` beside ``metrics`` and ``higher_is_better``."""
    extra = json.loads((Path(output) / MODEL_METRICS).read_text())
    if extra["label"] not in labels:
        raise BadInputError(
            f"leaderboard: {output} scores the model {extra['label']!r}, not one of {labels}"
        )
    _merge_metrics(records[labels.index(extra["label"])], extra)


def _merge_metrics(record: dict[str, Any], extra: dict[str, Any]) -> None:
    record["metrics"] = {**record["metrics"], **extra["metrics"]}
    higher = record.setdefault("higher_is_better", {})
    higher.update(extra.get("higher_is_better", {}))


def leaderboard_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Long format: one row per checkpoint, task and metric (stderrs left out)."""
    rows = []
    for rec in records:
        ckpt = rec.get("checkpoint") or {}
        for task, values in sorted(rec["metrics"].items()):
            higher = rec.get("higher_is_better", {}).get(task, {})
            for metric, value in sorted(values.items()):
                if "_stderr" in metric:
                    continue
                rows.append(
                    {
                        "checkpoint": ckpt.get("key", rec.get("model_dir")),
                        "suite_key": rec["suite_key"],
                        "step": ckpt.get("step"),
                        "tokens_seen": ckpt.get("tokens_seen"),
                        "seed": ckpt.get("seed"),
                        "task": task,
                        "metric": metric,
                        "value": value,
                        "higher_is_better": higher.get(metric.split(":")[0]),
                    }
                )
    return rows


def build_leaderboard(records: list[dict[str, Any]], out_dir: Path) -> dict[str, Any]:
    """Write the leaderboard (JSON, CSV, markdown), plots and signal quality into ``out_dir``.

    Args:
        records: ``results.json`` records, each with a ``checkpoint`` entry (``key``,
            ``tokens_seen``, ``step``, ``seed``).
        out_dir: An existing directory. Files: ``leaderboard.json`` / ``.csv`` / ``.md``
            (checkpoint x task:metric), ``leaderboard_long.csv``, ``signal_quality.csv`` /
            ``.md``, ``plots/<task>__<metric>.png``.

    Returns:
        Counts and the number of metrics worth watching (JSON scalars).
    """
    out_dir = Path(out_dir)
    rows = leaderboard_rows(records)
    _write_csv(out_dir / "leaderboard_long.csv", rows)
    wide = wide_table(rows)
    (out_dir / "leaderboard.json").write_text(json.dumps(wide, indent=1))
    _write_csv(out_dir / "leaderboard.csv", wide)
    (out_dir / "leaderboard.md").write_text(markdown_table(wide))
    quality = signal_quality(rows)
    _write_csv(out_dir / "signal_quality.csv", quality)
    (out_dir / "signal_quality.md").write_text(markdown_table(quality))
    return {
        "num_models": len({(r["suite_key"], r["checkpoint"]) for r in rows}),
        "num_metrics": len(quality),
        "num_worth_watching": sum(1 for q in quality if q["worth_watching"]),
        "num_plots": plot_metrics(rows, out_dir / "plots"),
    }


def wide_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per checkpoint (ordered by training progress), one column per task:metric."""
    table: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        key = (r["suite_key"], r["checkpoint"])
        row = table.setdefault(
            key,
            {k: r[k] for k in ("checkpoint", "suite_key", "step", "tokens_seen", "seed")},
        )
        row[f"{r['task']}/{r['metric']}"] = r["value"]
    columns = sorted({f"{r['task']}/{r['metric']}" for r in rows})
    ordered = sorted(table.values(), key=lambda r: (r["suite_key"], _progress(r), r["checkpoint"]))
    meta = ("checkpoint", "suite_key", "step", "tokens_seen", "seed")
    return [{**{k: r[k] for k in meta}, **{c: r.get(c) for c in columns}} for r in ordered]


def signal_quality(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Monotonicity, seed spread and their ratio for each (suite, task, metric)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["value"] is not None:
            groups[(r["suite_key"], r["task"], r["metric"])].append(r)
    out = []
    for (suite, task, metric), group in sorted(groups.items()):
        x_name, points = _points(group)
        by_seed = _by_seed(points)
        correlations = [
            c for c in (spearman(*zip(*p, strict=True)) for p in by_seed.values()) if c is not None
        ]
        sign = -1.0 if group[0]["higher_is_better"] is False else 1.0
        mono = sign * float(np.mean(correlations)) if correlations else None
        seed_std = seed_spread(points)
        means = [float(np.mean(v)) for _, v in sorted(_by_x(points).items())]
        trend = max(means) - min(means) if means else None
        snr = trend / seed_std if seed_std and trend is not None else None
        out.append(
            {
                "suite_key": suite,
                "task": task,
                "metric": metric,
                "x": x_name,
                "num_checkpoints": len(points),
                "num_seeds": len(by_seed),
                "monotonicity": _finite(mono),
                "seed_std": _finite(seed_std),
                "snr": _finite(snr),
                "worth_watching": bool(
                    mono is not None
                    and mono >= MIN_MONOTONICITY
                    and (snr is None or snr >= MIN_SNR)
                ),
            }
        )
    return out


def spearman(x: tuple | list, y: tuple | list) -> float | None:
    """Spearman rank correlation (ties get average ranks); None when undefined."""
    if len(x) < 2:
        return None
    rx, ry = _ranks(x), _ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def seed_spread(points: list[tuple[float, float, Any]]) -> float | None:
    """Mean over shared training points of the sample std across seeds; None if no sharing."""
    stds = [float(np.std(v, ddof=1)) for v in _by_x(points).values() if len(v) >= 2]
    return float(np.mean(stds)) if stds else None


def _by_task_metric(rows: list[dict[str, Any]]) -> dict[tuple, list[dict]]:
    """The rows that have a value, grouped by (task, metric)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["value"] is not None:
            groups[(r["task"], r["metric"])].append(r)
    return groups


def plot_metrics(rows: list[dict[str, Any]], plot_dir: Path) -> int:
    """One PNG per (task, metric): the metric against tokens seen (or step), a line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    groups = _by_task_metric(rows)
    for (task, metric), group in sorted(groups.items()):
        x_name, points = _points(group)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for seed, pts in sorted(_by_seed(points).items(), key=lambda kv: str(kv[0])):
            xs, ys = zip(*sorted(pts), strict=True)
            ax.plot(xs, ys, marker="o", label=f"seed {seed}")
        ax.set(xlabel=x_name, ylabel=metric, title=task)
        if ax.get_legend_handles_labels()[0]:  # no points (every x unknown): no empty legend
            ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(plot_dir / f"{_safe(task)}__{_safe(metric)}.png", dpi=80)
        plt.close(fig)
    return len(groups)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """A GitHub markdown table of ``rows`` (columns from the first row)."""
    if not rows:
        return "_no results yet_\n"
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


# -- helpers --------------------------------------------------------------------------------
def _points(group: list[dict]) -> tuple[str, list[tuple[float, float, Any]]]:
    """``(x_name, [(x, value, seed)])``: tokens seen when every row has it, else step."""
    x_name = "tokens_seen" if all(r["tokens_seen"] is not None for r in group) else "step"
    points = [
        (float(r[x_name]), float(r["value"]), r["seed"]) for r in group if r[x_name] is not None
    ]
    return x_name, points


def _by_seed(points: list[tuple[float, float, Any]]) -> dict[Any, list[tuple[float, float]]]:
    out: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for x, y, seed in points:
        out[seed].append((x, y))
    return out


def _by_x(points: list[tuple[float, float, Any]]) -> dict[float, list[float]]:
    out: dict[float, list[float]] = defaultdict(list)
    for x, y, _ in points:
        out[x].append(y)
    return out


def _ranks(values) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    ranks = np.empty(len(values))
    ranks[np.argsort(values, kind="mergesort")] = np.arange(len(values), dtype=float)
    for v in np.unique(values):
        tied = values == v
        ranks[tied] = ranks[tied].mean()
    return ranks


def _progress(row: dict[str, Any]) -> tuple:
    return (row.get("tokens_seen") or 0, row.get("step") or 0)


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value).replace("|", "\\|")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", name)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns = list(rows[0]) if rows else []
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
