"""A step's Prefect cache entry belongs to its store root: the same step and config committed
under two roots must each be served from their own root.

Found running ``benchmarks/bench_sweep.py --root R2`` after an earlier run at another root R1
had been deleted: R2's ``sample`` step was Cached with R1's result, and ``ingest`` then failed
with ``input R1/sample/... is not a complete output``. The cache key was the step's content
hash alone, so Prefect handed back whichever root's result was persisted under it first.
"""

from __future__ import annotations

import shutil

from tests.flows.test_task_runners import _last, _mapped_graph


def _run(root) -> tuple[int, str]:
    from prefect import flow

    from llmflow.tasks.framework.executor import PrefectExecutor

    @flow(name="cache-roots")
    def run():
        outcome = PrefectExecutor(str(root)).run(_mapped_graph())
        shards = next(n for n in outcome.results if n.step.name == "runner-shards")
        return outcome.results[_last(outcome)].metrics["total"], outcome.results[shards].uri

    return run()


def test_a_second_root_is_served_its_own_outputs_not_another_roots(prefect_harness, tmp_path):
    expected = sum(n * n for n in range(1, 13))
    first, second = tmp_path / "first", tmp_path / "second"
    for _ in range(2):  # the second run at a complete root is Cached: its result is persisted
        assert _run(first)[0] == expected
    shutil.rmtree(first)
    for _ in range(2):
        total, uri = _run(second)
        assert total == expected
        assert str(uri).startswith(str(second)), uri
