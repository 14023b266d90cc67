"""benchmarks/common.py: paired rounds keep a pair's two sides adjacent, and the per-round ratio
is reported with its median and range (a margin smaller than the spread must show)."""

from __future__ import annotations

from benchmarks.common import alternate, paired_order, per_round_ratios


def test_paired_order_runs_each_pairs_sides_back_to_back_and_swaps_who_goes_first():
    calls = paired_order([("a1", "b1"), ("a2", "b2"), ("a3", "b3")], rounds=4)
    assert len(calls) == 4 * 6
    rounds = [calls[i : i + 6] for i in range(0, len(calls), 6)]
    for r, calls_in_round in enumerate(rounds):
        pairs = [tuple(calls_in_round[i : i + 2]) for i in range(0, 6, 2)]
        for first, second in pairs:  # the same pair, adjacent
            assert first[1] == second[1] and first[0] != second[0]
        assert all(first[0] == ("a" if r % 2 == 0 else "b") for first, _ in pairs)
    # the pairs rotate: each pair leads a round
    assert [rnd[0][1] for rnd in rounds[:3]] == ["1", "2", "3"]


def test_per_round_ratios_are_the_median_and_range_of_each_rounds_ratio():
    times = {"peer": [2.0, 3.0, 1.0, 4.0], "ours": [1.0, 2.0, 1.0, 2.0]}
    # rounds: 2.0, 1.5, 1.0, 2.0 -> median 1.75 (the ratio of medians would be 2.5 / 1.5 = 1.667)
    out = per_round_ratios(times, "peer", "ours")
    assert out == {"median": 1.75, "range": [1.0, 2.0], "rounds": [2.0, 1.5, 1.0, 2.0]}


def test_alternate_follows_the_given_call_order():
    seen: list[str] = []
    fns = {name: (lambda n=name: seen.append(n)) for name in ("x", "y")}
    times = alternate(fns, rounds=2, calls=paired_order([("x", "y")], 2))
    assert seen == ["x", "y", "y", "x"] and [len(t) for t in times.values()] == [2, 2]
