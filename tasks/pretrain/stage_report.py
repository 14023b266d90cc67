"""A training stage's report: plots of its metric rows and its alerts, as one markdown artifact.

Read from the stage's run folder (``metrics.jsonl``, ``events.jsonl``, ``evaluations.jsonl``),
so it is the same for a running stage and a finished one. Four plots, each a PNG embedded in the
markdown as a ``data:`` URI (the Prefect UI renders them inline; nothing to host):

- loss: training loss and held-out loss (per domain too, when the rows have it) by step;
- throughput: tokens/s (and MFU) by step, and where a step's time goes (the ``time_*`` fields);
- gradient norms by layer (and update-to-weight ratios), lines for a few layers, a heatmap for
  many;
- evaluations against the reference, by tokens seen.

A plot whose fields no row has yet is left out, with a line saying so: the fields come from
trainer components a recipe may turn off.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from llmflow.tasks.pretrain.alerts import EVENTS

METRICS = "metrics.jsonl"
EVALUATIONS = "evaluations.jsonl"  # one row per evaluated checkpoint (the running evaluation)
RUNNING_RESULTS = "running-evaluation"  # flows/evaluate_running.py's score files, <root>/...
TIME_FIELDS = {
    "time_data_s": "data wait",
    "time_compute_s": "forward+backward",
    "time_optimizer_s": "optimizer",
    "time_checkpoint_s": "checkpoint",
    "time_validation_s": "validation",
}
PLOTS = ("loss", "throughput", "layers", "evaluations")
MAX_LINES = 12  # more layers than this: a heatmap
ALERTS_SHOWN = 20
log = logging.getLogger("llmflow.pretrain")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete, parseable rows of a JSON-lines file another process may be appending to
    (a half-written last line is skipped); [] when it does not exist."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def alerts(out_dir: Path) -> list[dict[str, Any]]:
    """The stage's alert rows, oldest first."""
    return [r for r in read_jsonl(Path(out_dir) / EVENTS) if r.get("event") == "alert"]


def artifact_key(label: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) for a stage's label."""
    key = re.sub(r"[^a-z0-9-]+", "-", f"stage-{label}".lower())
    return re.sub(r"-{2,}", "-", key).strip("-")


# ------------------------------------------------------------------------------------ plots
def _figure(rows: int = 1, height: float = 3.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, height * rows), dpi=90, layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, axes


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _series(rows: Iterable[dict[str, Any]], key: str, x: str = "step") -> tuple[list, list]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and x in row and math.isfinite(value):
            xs.append(row[x])
            ys.append(value)
    return xs, ys


def _layer_order(name: str) -> tuple:
    """embed first, then blocks by index, then the rest (final norm, lm_head) by name."""
    found = re.search(r"(\d+)", name)
    if "embed" in name:
        return (0, 0, name)
    return (1, int(found.group(1)), name) if found else (2, 0, name)


def _marker(xs: list) -> str | None:
    """Dots while a series has few points (a line of one point draws nothing)."""
    return "." if len(xs) < 40 else None


def plot_loss(rows: list[dict[str, Any]]) -> bytes | None:
    steps, loss = _series(rows, "loss")
    if not steps:
        return None
    fig, (ax,) = _figure(height=3.2)
    ax.plot(steps, loss, lw=1, marker=_marker(steps), label="train loss")
    val_steps, val = _series(rows, "val_loss")
    if val_steps:
        ax.plot(val_steps, val, "o-", ms=3, lw=1.5, label="held-out loss")
    domains = sorted({d for r in rows for d in (r.get("val_loss_by_domain") or {})})
    for domain in domains:
        pts = [
            (r["step"], r["val_loss_by_domain"][domain])
            for r in rows
            if isinstance(r.get("val_loss_by_domain"), dict) and domain in r["val_loss_by_domain"]
        ]
        ax.plot(*zip(*pts, strict=True), ".--", ms=3, lw=0.8, label=f"held-out {domain}")
    ax.set(xlabel="step", ylabel="loss", title="Loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _png(fig)


def _plot_time_split(ax, rows: list[dict[str, Any]], split: dict[str, str]) -> None:
    """The step time's parts (the ``split`` fields, labelled by their values), stacked."""
    timed = [r for r in rows if "step" in r and any(k in r for k in split)]
    xs = [r["step"] for r in timed]
    parts = [[float(r.get(k) or 0.0) for r in timed] for k in split]
    ax.stackplot(xs, parts, labels=list(split.values()), alpha=0.85)
    ax.set(ylabel="seconds per log interval", title="Where the step time goes")
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    ax.grid(alpha=0.3)


def plot_throughput(rows: list[dict[str, Any]]) -> bytes | None:
    steps, tps = _series(rows, "tokens_per_s")
    if not steps:
        return None
    split = {k: v for k, v in TIME_FIELDS.items() if any(k in r for r in rows)}
    fig, axes = _figure(rows=2 if split else 1, height=2.6)
    ax = axes[0]
    ax.plot(steps, tps, lw=1, marker=_marker(steps), color="C0")
    ax.set(ylabel="tokens/s", title="Throughput")
    ax.grid(alpha=0.3)
    mfu_steps, mfu = _series(rows, "mfu")
    if mfu_steps:
        twin = ax.twinx()
        twin.plot(mfu_steps, [100 * m for m in mfu], lw=0.8, color="C3")
        twin.set_ylabel("MFU %", color="C3")
    if split:
        _plot_time_split(axes[1], rows, split)
    axes[-1].set_xlabel("step")
    return _png(fig)


def _by_layer(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[str], list[list]]:
    """(steps, layers, values[layer][i]) of the rows holding ``key`` ({layer: value})."""
    held = [r for r in rows if isinstance(r.get(key), dict) and r[key] and "step" in r]
    layers = sorted({name for r in held for name in r[key]}, key=_layer_order)
    values = [[_finite(r[key].get(name)) for r in held] for name in layers]
    return [r["step"] for r in held], layers, values


def _finite(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else math.nan


def plot_layers(rows: list[dict[str, Any]]) -> bytes | None:
    panels = [
        (key, title)
        for key, title in (
            ("grad_norm_by_layer", "Gradient norm by layer"),
            ("update_ratio_by_layer", "Update-to-weight ratio by layer"),
        )
        if _by_layer(rows, key)[0]
    ]
    if not panels:
        return None
    fig, axes = _figure(rows=len(panels), height=3.0)
    every = sorted({n for key, _ in panels for n in _by_layer(rows, key)[1]}, key=_layer_order)
    color = {layer: f"C{i % 10}" for i, layer in enumerate(every)}  # one colour per layer
    for ax, (key, title) in zip(axes, panels, strict=True):
        steps, layers, values = _by_layer(rows, key)
        if len(layers) > MAX_LINES or len(steps) == 1:
            _heatmap(fig, ax, steps, layers, values)
        else:
            for layer, ys in zip(layers, values, strict=True):
                ax.plot(steps, ys, lw=1, marker=_marker(steps), label=layer, color=color[layer])
            ax.set_yscale("log")
            ax.legend(fontsize=6, ncol=4)
            ax.grid(alpha=0.3)
        ax.set_title(title)
    axes[-1].set_xlabel("step")
    return _png(fig)


def _heatmap(fig, ax, steps: list[int], layers: list[str], values: list[list]) -> None:
    import numpy as np
    from matplotlib.colors import LogNorm

    grid = np.array(values, dtype=float)
    positive = grid[np.isfinite(grid) & (grid > 0)]
    norm = LogNorm(positive.min(), positive.max()) if positive.size else None
    image = ax.imshow(
        np.where(grid > 0, grid, np.nan),
        aspect="auto",
        interpolation="nearest",
        norm=norm,
        extent=(steps[0] - 0.5, steps[-1] + 0.5, len(layers) - 0.5, -0.5),
    )
    every = max(1, len(layers) // 16)
    ax.set_yticks(range(0, len(layers), every), layers[::every], fontsize=6)
    fig.colorbar(image, ax=ax)


def evaluation_points(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat points ``{"tokens", "metric", "value", "source"}`` of evaluation rows.

    A row is a scored checkpoint, ``{"tokens_seen": N, "metrics": {name: value}}`` (the running
    evaluation's score files), or one point ``{"tokens": N, "metric": name, "value": v}``; either
    may carry ``"source": "reference"`` (a point of the reference curve) and, for a point,
    ``"reference": v``, the reference's value at the same tokens.
    """
    points = []
    for row in rows:
        tokens = row.get("tokens_seen", row.get("tokens"))
        if not isinstance(tokens, (int, float)):
            continue
        source = "reference" if row.get("source") == "reference" else "run"
        values = row.get("metrics") if isinstance(row.get("metrics"), dict) else {}
        if "metric" in row:
            values = {**values, row["metric"]: row.get("value")}
        for metric, value in values.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                points.append(
                    {"tokens": tokens, "metric": metric, "value": value, "source": source}
                )
            reference = row.get("reference")
            if "metric" in row and isinstance(reference, (int, float)):
                points.append(
                    {"tokens": tokens, "metric": metric, "value": reference, "source": "reference"}
                )
    return points


def plot_evaluations(rows: list[dict[str, Any]]) -> bytes | None:
    """One panel per metric: the run's scores and the reference's, by tokens seen."""
    points = evaluation_points(rows)
    metrics = sorted({p["metric"] for p in points})
    if not metrics:
        return None
    fig, axes = _figure(rows=len(metrics), height=2.4)
    for ax, metric in zip(axes, metrics, strict=True):
        mine = sorted((p for p in points if p["metric"] == metric), key=lambda p: p["tokens"])
        for source, style, color in (("run", "o-", "C0"), ("reference", "s--", "grey")):
            xs = [p["tokens"] for p in mine if p["source"] == source]
            ys = [p["value"] for p in mine if p["source"] == source]
            if xs:
                ax.plot(xs, ys, style, ms=3, color=color, label=source)
        ax.set(ylabel=metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title("Evaluations against the reference")
    axes[-1].set_xlabel("tokens seen")
    return _png(fig)


def stage_plots(out_dir: Path) -> dict[str, bytes | None]:
    """Every plot of the stage at ``out_dir`` by name (None: no row has its fields yet)."""
    out_dir = Path(out_dir)
    rows = read_jsonl(out_dir / METRICS)
    return {
        "loss": plot_loss(rows),
        "throughput": plot_throughput(rows),
        "layers": plot_layers(rows),
        "evaluations": plot_evaluations(
            read_jsonl(out_dir / EVALUATIONS) + running_evaluation_rows(out_dir)
        ),
    }


def running_evaluation_rows(out_dir: Path) -> list[dict[str, Any]]:
    """The running evaluation's scores of this stage and of its reference, from the flow's
    default results folder (``<root>/running-evaluation``: one JSON file per checkpoint, under
    the stage's folder name, the reference's under ``reference*``)."""
    out_dir = Path(out_dir)
    results = next(
        (p / RUNNING_RESULTS for p in list(out_dir.parents)[:3] if (p / RUNNING_RESULTS).is_dir()),
        None,
    )
    if results is None:
        return []
    rows = []
    for pattern, source in ((f"{out_dir.name}/*.json", "run"), ("reference*/*.json", "reference")):
        for path in sorted(results.glob(pattern)):
            try:
                row = json.loads(path.read_text())
            except (OSError, ValueError):  # NOTE: being replaced by the flow: next refresh
                continue
            rows.append({**row, "source": source})
    return rows


# --------------------------------------------------------------------------------- markdown
_CAPTIONS = {
    "loss": "Loss",
    "throughput": "Throughput and step time split",
    "layers": "Gradient norms by layer",
    "evaluations": "Evaluations against the reference",
}
_MISSING = {
    "loss": "no metric row yet",
    "throughput": "no tokens/s logged yet",
    "layers": "no per-layer gradient norms logged (per-layer statistics are off or not due yet)",
    "evaluations": "no evaluated checkpoint yet (the running evaluation writes them)",
}


def _fmt(value: Any, spec: str = ".4g") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def stage_markdown(out_dir: Path, label: str) -> str:
    """The stage's report: its latest numbers, its alerts and its plots (PNG data URIs)."""
    out_dir = Path(out_dir)
    rows = read_jsonl(out_dir / METRICS)
    last = rows[-1] if rows else {}
    val = next((r for r in reversed(rows) if "val_loss" in r), {})
    summary = (
        json.loads((out_dir / "summary.json").read_text())
        if (out_dir / "summary.json").exists()
        else None
    )
    state = "finished" if summary is not None else "running"
    lines = [f"# Stage {label}", "", f"{state}, as of step {last.get('step', 0)}", ""]
    lines += ["| step | loss | held-out loss | tokens/s | data share | MFU | tokens seen |"]
    lines += ["|---|---|---|---|---|---|---|"]
    lines += [
        f"| {last.get('step', '-')} | {_fmt(last.get('loss'))} | {_fmt(val.get('val_loss'))} "
        f"| {_fmt(last.get('tokens_per_s'), ',.0f')} | {_fmt(last.get('data_share'), '.1%')} "
        f"| {_fmt(last.get('mfu'), '.1%')} | {_fmt(last.get('tokens_seen'), ',')} |",
        "",
    ]
    found = alerts(out_dir)
    lines += [f"## Alerts ({len(found)})", ""]
    if found:
        lines += ["| step | kind | cause | message |", "|---|---|---|---|"]
        for a in found[-ALERTS_SHOWN:]:
            message = str(a.get("message", "")).replace("|", "\\|")
            lines.append(
                f"| {a.get('step')} | {a.get('kind')} | {a.get('cause') or '-'} | {message} |"
            )
    else:
        lines.append("no alerts")
    lines.append("")
    for name, png in stage_plots(out_dir).items():
        lines += [f"## {_CAPTIONS[name]}", ""]
        if png is None:
            lines += [f"_{_MISSING[name]}_", ""]
            continue
        data = base64.b64encode(png).decode("ascii")
        lines += [f"![{name}](data:image/png;base64,{data})", ""]
    return "\n".join(lines)


def write_plots(out_dir: Path, folder: Path) -> list[Path]:
    """The stage's plots as PNG files in ``folder`` (the ones with data); their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, png in stage_plots(out_dir).items():
        if png is not None:
            (folder / f"{name}.png").write_bytes(png)
            written.append(folder / f"{name}.png")
    return written


# ------------------------------------------------------------------------------- publishing
def describe(label: str) -> str:
    return f"Training stage {label}: loss, throughput, layers, evaluations, alerts"


def publish_stage_report(out_dir: Path, label: str) -> None:
    """The stage's report with its output (a Prefect markdown artifact under the executor).

    A report that cannot be drawn is logged, never raised: the stage it describes trained.
    """
    from llmflow.tasks.framework.step import report_markdown

    try:
        markdown = stage_markdown(out_dir, label)
    except Exception as exc:  # NOTE: a plotting bug must not fail a trained stage
        log.warning("stage report of %s not drawn: %s: %s", label, type(exc).__name__, exc)
        return
    report_markdown(artifact_key(label), markdown, describe(label))


class LiveReport:
    """Republishes a running stage's report from its trainer's metric lines, at most once per
    ``every_s`` (the first line publishes at once), when a Prefect task run is the caller.

    ``follow(on_line)`` wraps the launcher's line callback: each line still goes to ``on_line``.
    """

    def __init__(self, out_dir: Path, label: str, every_s: float = 300.0) -> None:
        self.out_dir, self.label, self.every_s = Path(out_dir), label, every_s
        self.last = -math.inf

    def follow(self, on_line: Callable[[str], Any]) -> Callable[[str], None]:
        def line(text: str) -> None:
            on_line(text)
            if text.startswith("step ") and time.monotonic() - self.last >= self.every_s:
                self.last = time.monotonic()
                self.publish()

        return line

    def publish(self) -> None:
        try:
            from llmflow.tasks.framework import live

            if not live.in_task_run():
                return
            markdown = stage_markdown(self.out_dir, self.label)
            live.publish_markdown(artifact_key(self.label), markdown, describe(self.label))
        except Exception as exc:  # NOTE: a report must never stop the training it follows
            log.warning(
                "live report of %s not published: %s: %s", self.label, type(exc).__name__, exc
            )
