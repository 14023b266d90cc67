"""Shared timing and reporting for the benchmarks: alternating wall-time rounds, one JSON line.

A benchmark compares our code with a peer on a shared, noisy machine. Timing the two sides in
alternating rounds (A B B A A B ...) makes a change of load hit both alike; the ratio of the
medians of the rounds is the headline. Every benchmark prints ONE JSON line with the ratio,
the rounds, the load average and whether both sides did identical work.

    from benchmarks.common import alternate, emit, ratio

    times = alternate({"peer": run_peer, "ours": run_ours}, rounds=3)
    emit("tokenize_and_pack", ratio=ratio(times, "peer", "ours"), rounds=3,
         identical_work=same, seconds=times)

Import it as ``benchmarks.common`` with the repository root on ``sys.path`` (the benchmarks
run from the root: ``python benchmarks/bench_x.py`` puts ``benchmarks/`` on the path, so a
plain ``from common import ...`` works too).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable


def order(names: list[str], rounds: int) -> list[str]:
    """The call order of alternating rounds: ABBA for two sides (A B, B A, A B, ...).

    With more than two sides each round rotates the order by one, so every side is first as
    often as the others.
    """
    calls: list[str] = []
    for r in range(rounds):
        if len(names) == 2:
            calls += names if r % 2 == 0 else names[::-1]
        else:
            shift = r % len(names)
            calls += names[shift:] + names[:shift]
    return calls


def alternate(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    *,
    warmup: bool = False,
    calls: list[str] | None = None,
) -> dict[str, list[float]]:
    """Wall seconds of each callable per round, called in alternating order.

    Args:
        fns: Side name -> a no-argument callable doing that side's whole work once.
        rounds: Calls per side.
        warmup: Call each side once, untimed, before the rounds (imports, caches).
        calls: The call order (default ``order(list(fns), rounds)``), e.g. ``paired_order``.

    Returns:
        Side name -> its ``rounds`` wall times in seconds, in call order.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    if warmup:
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name in calls if calls is not None else order(list(fns), rounds):
        start = time.perf_counter()
        fns[name]()
        times[name].append(time.perf_counter() - start)
    return times


def paired_order(pairs: list[tuple[str, str]], rounds: int) -> list[str]:
    """The call order of paired rounds: in each round every pair's two sides run back to back.

    The pairs rotate by one each round and a pair's two sides swap each round (A B, then B A),
    so the two sides of a pair always see the same load, and a per-round ratio compares like
    with like.
    """
    calls: list[str] = []
    for r in range(rounds):
        shift = r % len(pairs)
        for a, b in pairs[shift:] + pairs[:shift]:
            calls += [a, b] if r % 2 == 0 else [b, a]
    return calls


def per_round_ratios(times: dict[str, list[float]], peer: str, ours: str) -> dict:
    """The peer's time over ours in each round: their median and range (above 1: ours faster).

    A ratio of medians hides how much the rounds disagree; the median of per-round ratios,
    with their smallest and largest, says whether a margin is larger than the spread.
    """
    rounds = [p / o for p, o in zip(times[peer], times[ours], strict=True)]
    return {
        "median": round(statistics.median(rounds), 3),
        "range": [round(min(rounds), 3), round(max(rounds), 3)],
        "rounds": [round(x, 3) for x in rounds],
    }


def ratio(times: dict[str, list[float]], peer: str, ours: str) -> float:
    """Peer's median wall time over ours: above 1 means ours is faster."""
    return round(statistics.median(times[peer]) / statistics.median(times[ours]), 3)


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded (the machine is shared)."""
    return [round(x, 2) for x in os.getloadavg()]


def emit(name: str, **fields) -> dict:
    """Print ONE JSON line: the benchmark's name, its fields and the load average now.

    Lists of seconds are rounded to milliseconds. Returns the printed record.
    """
    record = {"bench": name, **{k: _rounded(v) for k, v in fields.items()}}
    record["load_avg"] = load_average()
    print(json.dumps(record), flush=True)
    return record


def append_results(path: str | None, records: list[dict]) -> None:
    """Append ``records`` (``emit``'s) to the JSON-lines results file ``path``, if given."""
    if path:
        with open(path, "a") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")


def _rounded(value):
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def hf_adamw(model, optim, fused: bool = False):
    """``torch.optim.AdamW`` over a transformers model with our trainer's groups: no weight
    decay on embeddings and norms (``optim``: an ``OptimizerConfig``), as the peer's side of a
    train-step comparison."""
    import torch

    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    groups = [{"params": decay, "weight_decay": optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip
    return torch.optim.AdamW(
        groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, fused=fused or None
    )
