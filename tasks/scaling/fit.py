"""Chinchilla scaling law L(N, D) = E + A/N^alpha + B/D^beta, fitted the way the paper does.

Hoffmann et al. (2022, approach 3) fit the log of the loss: with a = log A, b = log B,
e = log E, the prediction is log L = LSE(a - alpha log N, b - beta log D, e) and the objective is
the Huber loss (delta = 1e-3) of its residual, minimised with L-BFGS from a grid of starting
points (the best local minimum wins). N counts non-embedding parameters (Kaplan et al. 2020):
at ladder scale the embedding is most of the model and does not buy loss the same way.

A fit can be degenerate: the runs do not pin the five constants down (fewer than three distinct
sizes or token counts, losses that do not vary), the law explains less of log-loss than a
constant would, or a constant sits at its bound (E at 0: no loss floor in the runs; an exponent
at 0 or at ``EXPONENT_MAX``, or a term under 1% of every run's loss). Such a law carries the
reason in ``degenerate`` and refuses to predict: a floor of 0 extrapolates to ever lower losses.

The ``scaling-fit`` step reads a ladder of pretrain outputs (each run's ``train_config.json`` and
``summary.json``), fits the law, and writes ``law.json``; ``find_law`` gives the newest fit for a
recipe name, which ``llmflow plan`` uses to predict a run's loss.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, report_table, step
from llmflow.tasks.framework.store import Store
from llmflow.tasks.pretrain.config import TrainConfig

log = logging.getLogger("llmflow.scaling")

LAW_FILE = "law.json"
EXPONENT_MAX = 3.0
"""Upper bound of alpha and beta in the fit (0 is the lower one); Chinchilla's are ~0.3."""
SMALL_SHARE = 0.01
"""A constant or term under this share of the runs' losses counts as at its bound 0."""
MIN_EXPLAINED = 0.5
"""The least share of log-loss variance a law must explain to count as better than a constant."""


@dataclass
class ScalingLaw:
    """Fitted constants of L(N, D) = E + A/N^alpha + B/D^beta (N: non-embedding parameters)."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float
    degenerate: str | None = None
    """Why the fit cannot be trusted ("fit degenerate: ..."), or None for a well-posed fit."""

    def predict(self, n: float, d: float) -> float:
        """Predicted loss of a model of ``n`` non-embedding parameters trained on ``d`` tokens.

        Raises:
            ValueError: the fit is degenerate (the message says why).
        """
        if self.degenerate:
            raise ValueError(self.degenerate)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def optimal_split(self, flops: float) -> tuple[float, float]:
        """Compute-optimal (N, D) for C = 6ND (the paper's closed form)."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        n = g * (flops / 6) ** (self.beta / (self.alpha + self.beta))
        return n, flops / (6 * n)


def _huber(r: np.ndarray, delta: float) -> np.ndarray:
    small = np.abs(r) <= delta
    return np.where(small, 0.5 * r**2, delta * (np.abs(r) - 0.5 * delta))


def _objective(theta: np.ndarray, log_n, log_d, log_l, delta: float):
    """Huber loss of the log-space residuals and its gradient (for L-BFGS)."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    r = top + np.log(total) - log_l
    soft = weights / total  # d LSE / d term
    dr = np.clip(r, -delta, delta)  # d huber / d r
    grad = np.array(
        [
            (dr * soft[0]).sum(),
            (dr * soft[1]).sum(),
            (dr * soft[2]).sum(),
            -(dr * soft[0] * log_n).sum(),
            -(dr * soft[1] * log_d).sum(),
        ]
    )
    return _huber(r, delta).sum(), grad


def _grid() -> list[np.ndarray]:
    """Chinchilla's starting points, coarsened (the fit keeps the best local minimum)."""
    axes = [
        range(0, 26, 5),
        range(0, 26, 5),
        (-1.0, 0.0, 1.0),
        (0.0, 0.5, 1.0, 1.5),
        (0.0, 0.5, 1.0, 1.5),
    ]
    return [np.array(p, dtype=float) for p in itertools.product(*axes)]


def _grid_objective(grid: np.ndarray, log_n, log_d, log_l, delta: float) -> np.ndarray:
    """The objective at every starting point at once (points x runs)."""
    a, b, e, alpha, beta = (grid[:, i : i + 1] for i in range(5))
    first, second = a - alpha * log_n, b - beta * log_d
    predicted = np.logaddexp(np.logaddexp(first, second), np.broadcast_to(e, first.shape))
    return _huber(predicted - log_l, delta).sum(axis=1)


def fit_law(
    n: list[float], d: list[float], loss: list[float], delta: float = 1e-3, top_k: int = 4
) -> ScalingLaw:
    """Fit the law to runs (``n`` non-embedding parameters, ``d`` tokens, ``loss``).

    Every grid point is scored first; L-BFGS-B refines the ``top_k`` best (exponents within
    [0, EXPONENT_MAX]) and the lowest objective wins. A fit that cannot be trusted comes back
    with ``degenerate`` set (see ``degeneracy``).
    """
    from scipy.optimize import minimize

    if len(loss) < 5:
        raise BadInputError(f"a 5-parameter law needs at least 5 runs, got {len(loss)}")
    log_n, log_d, log_l = (np.log(np.asarray(x, dtype=float)) for x in (n, d, loss))
    grid = np.array(_grid())
    starts = grid[np.argsort(_grid_objective(grid, log_n, log_d, log_l, delta))]
    best = None
    for theta in starts[:top_k]:
        found = minimize(
            _objective,
            theta,
            args=(log_n, log_d, log_l, delta),
            jac=True,
            method="L-BFGS-B",
            bounds=[(None, None)] * 3 + [(0.0, EXPONENT_MAX)] * 2,
            options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 5000},  # the gradient is ~delta
        )
        if best is None or found.fun < best.fun:
            best = found
    a, b, e, alpha, beta = best.x
    law = ScalingLaw(
        E=math.exp(e), A=math.exp(a), alpha=float(alpha), B=math.exp(b), beta=float(beta)
    )
    law.degenerate = degeneracy(law, n, d, loss)
    return law


def _distinct(values: list[float], what: str, constants: str) -> str | None:
    """Why one axis of the runs cannot fit its term, or None (it has 3 or more values)."""
    found = sorted(set(values))
    if len(found) >= 3:
        return None
    plural = "" if len(found) == 1 else "s"
    listed = ", ".join(f"{v:.3g}" for v in found)
    return (
        f"fit degenerate: the runs saw {len(found)} distinct {what}{plural} ({listed}); "
        f"{constants} and E need 3 or more"
    )


def degeneracy(law: ScalingLaw, n: list[float], d: list[float], loss: list[float]) -> str | None:
    """Why a law fitted to these runs cannot predict ("fit degenerate: ..."), or None.

    In order: an axis with under 3 distinct values (a power law and E meet two levels: any
    exponent fits), losses that do not vary, a law explaining under ``MIN_EXPLAINED`` of the
    variance of log-loss (no better than a constant), E under ``SMALL_SHARE`` of the lowest loss
    (at its bound 0), an exponent at a bound or a term under ``SMALL_SHARE`` of every loss.
    """
    for reason in (
        _distinct(n, "model size", "A, alpha"),
        _distinct(d, "token count", "B, beta"),
    ):
        if reason:
            return reason
    if max(loss) == min(loss):
        return (
            f"fit degenerate: every run's loss is {loss[0]:.4g}, so no law improves on a constant"
        )
    log_l = np.log(np.asarray(loss, dtype=float))
    runs = zip(n, d, strict=True)
    fitted = np.log([law.E + law.A / x**law.alpha + law.B / y**law.beta for x, y in runs])
    explained = 1 - ((log_l - fitted) ** 2).sum() / ((log_l - log_l.mean()) ** 2).sum()
    if explained < MIN_EXPLAINED:
        return (
            f"fit degenerate: the law explains {max(explained, 0):.0%} of the variance of log-loss "
            f"(under {MIN_EXPLAINED:.0%}), no better than a constant"
        )
    lowest = min(loss)
    if law.E < SMALL_SHARE * lowest:
        return (
            f"fit degenerate: E = {law.E:.3g} is at its bound 0 (under {SMALL_SHARE:.0%} of the "
            f"lowest loss, {lowest:.4g}): the runs show no loss floor, and a law without one "
            "predicts ever lower losses"
        )
    terms = (
        ("alpha", law.alpha, "A/N^alpha", [law.A / x**law.alpha for x in n]),
        ("beta", law.beta, "B/D^beta", [law.B / y**law.beta for y in d]),
    )
    for name, exponent, term, values in terms:
        if not 1e-3 < exponent < EXPONENT_MAX - 1e-3:
            bound = 0 if exponent <= 1e-3 else EXPONENT_MAX
            return (
                f"fit degenerate: {name} = {exponent:.3g} is at its bound {bound:g}, so "
                f"{term} is no power law of the runs"
            )
        if max(v / x for v, x in zip(values, loss, strict=True)) < SMALL_SHARE:
            return (
                f"fit degenerate: {term} is under {SMALL_SHARE:.0%} of every run's loss: the "
                f"runs do not show its effect"
            )
    return None


def run_point(run: Path) -> dict[str, float]:
    """(N, D, loss) of one pretrain output: non-embedding parameters, tokens, validation loss."""
    cfg = TrainConfig.load(Path(run) / "train_config.json")
    summary = json.loads((Path(run) / "summary.json").read_text())
    if summary.get("val_loss") is None:
        raise BadInputError(f"{run}: the run has no validation loss (trained without validation)")
    return {
        "n": cfg.model_config_obj().num_parameters(non_embedding=True),
        "d": summary["total_tokens_seen"],
        "loss": summary["val_loss"],
    }


class ScalingFitConfig(BaseModel):
    """How to fit: the Huber threshold on log-loss residuals (the paper's 1e-3)."""

    model_config = ConfigDict(extra="forbid")

    huber_delta: float = Field(1e-3, gt=0, description="Huber threshold of the log residual.")


@step("scaling-fit", version=2)
def scaling_fit(cfg: ScalingFitConfig, runs: list[Path], out: Path) -> Metrics:
    """Fit L(N, D) to a ladder of runs; law.json holds the constants and the points.

    A degenerate fit is written with its reason and no fitted values (``fitted``: null).
    """
    points = [run_point(r) for r in runs]
    law = fit_law(
        [p["n"] for p in points], [p["d"] for p in points], [p["loss"] for p in points],
        cfg.huber_delta,
    )  # fmt: skip
    fitted = (lambda p: None) if law.degenerate else (lambda p: law.predict(p["n"], p["d"]))
    rows = [{**p, "fitted": fitted(p)} for p in points]
    (out / LAW_FILE).write_text(json.dumps({"law": asdict(law), "points": rows}, indent=1))
    title = law.degenerate or "Ladder runs: validation loss and the fitted law's value"
    report_table("scaling-fit", rows, title)
    worst = None if law.degenerate else max(abs(r["fitted"] - r["loss"]) / r["loss"] for r in rows)
    return {**asdict(law), "num_runs": len(rows), "max_fit_error": worst}


def find_law(root: str, name: str) -> ScalingLaw | None:
    """The newest scaling law fitted for the recipe ``name`` under ``root``, if any.

    None too when the newest fit is degenerate (logged with its reason): it predicts nothing.
    """
    store = Store(root)
    for uri in store.list_outputs(scaling_fit.name):
        if Store.address_of(uri)[1] == name:
            with store.fs.open(f"{uri}/{LAW_FILE}") as f:
                law = ScalingLaw(**json.load(f)["law"])
            if law.degenerate:
                log.warning("the newest scaling law of %s (%s): %s", name, uri, law.degenerate)
                return None
            return law
    return None
