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
    fns: dict[str, Callable[[], object]], rounds: int, *, warmup: bool = False
) -> dict[str, list[float]]:
    """Wall seconds of each callable per round, called in alternating order.

    Args:
        fns: Side name -> a no-argument callable doing that side's whole work once.
        rounds: Calls per side.
        warmup: Call each side once, untimed, before the rounds (imports, caches).

    Returns:
        Side name -> its ``rounds`` wall times in seconds, in call order.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    if warmup:
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name in order(list(fns), rounds):
        start = time.perf_counter()
        fns[name]()
        times[name].append(time.perf_counter() - start)
    return times


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


def _rounded(value):
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value
