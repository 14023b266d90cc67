"""Chinchilla scaling law L(N, D) = E + A/N^alpha + B/D^beta, fitted the way the paper does.

Hoffmann et al. (2022, approach 3) fit the log of the loss: with a = log A, b = log B,
e = log E, the prediction is log L = LSE(a - alpha log N, b - beta log D, e) and the objective is
the Huber loss (delta = 1e-3) of its residual, minimised with L-BFGS from a grid of starting
points (the best local minimum wins). N counts non-embedding parameters (Kaplan et al. 2020):
at ladder scale the embedding is most of the model and does not buy loss the same way.

The ``scaling-fit`` step reads a ladder of pretrain outputs (each run's ``train_config.json`` and
``summary.json``), fits the law, and writes ``law.json``; ``find_law`` gives the newest fit for a
recipe name, which ``llmflow plan`` uses to predict a run's loss.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, report_table, step
from llmflow.tasks.framework.store import Store
from llmflow.tasks.pretrain.config import TrainConfig

LAW_FILE = "law.json"


@dataclass
class ScalingLaw:
    """Fitted constants of L(N, D) = E + A/N^alpha + B/D^beta (N: non-embedding parameters)."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def predict(self, n: float, d: float) -> float:
        """Predicted loss of a model of ``n`` non-embedding parameters trained on ``d`` tokens."""
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

    Every grid point is scored first; L-BFGS-B refines the ``top_k`` best and the lowest
    objective wins.
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
            options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 5000},  # the gradient is ~delta
        )
        if best is None or found.fun < best.fun:
            best = found
    a, b, e, alpha, beta = best.x
    return ScalingLaw(
        E=math.exp(e), A=math.exp(a), alpha=float(alpha), B=math.exp(b), beta=float(beta)
    )


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


@step("scaling-fit")
def scaling_fit(cfg: ScalingFitConfig, runs: list[Path], out: Path) -> Metrics:
    """Fit L(N, D) to a ladder of runs; law.json holds the constants and the points."""
    points = [run_point(r) for r in runs]
    law = fit_law(
        [p["n"] for p in points], [p["d"] for p in points], [p["loss"] for p in points],
        cfg.huber_delta,
    )  # fmt: skip
    rows = [{**p, "fitted": law.predict(p["n"], p["d"])} for p in points]
    (out / LAW_FILE).write_text(json.dumps({"law": asdict(law), "points": rows}, indent=1))
    report_table("scaling-fit", rows, "Ladder runs: validation loss and the fitted law's value")
    worst = max(abs(r["fitted"] - r["loss"]) / r["loss"] for r in rows)
    return {**asdict(law), "num_runs": len(rows), "max_fit_error": worst}


def find_law(root: str, name: str) -> ScalingLaw | None:
    """The newest scaling law fitted for the recipe ``name`` under ``root``, if any."""
    store = Store(root)
    for uri in store.list_outputs(scaling_fit.name):
        if Store.address_of(uri)[1] == name:
            with store.fs.open(f"{uri}/{LAW_FILE}") as f:
                return ScalingLaw(**json.load(f)["law"])
    return None
