"""Where data units run (``backend.py``): a failing unit on the process pool leaves nothing running.

Ingest's workers spill into a scratch folder inside the output, which the caller removes once the
stream ends; a unit still running then would write into the output after that (and a committed
output could keep the folder).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llmflow.tasks.framework.backend import (
    LocalBackend,
    ProcessBackend,
    ThreadBackend,
    active,
    make_backend,
)

SLOW_S = 2.0


def _unit(folder: str, item: int) -> int:
    """Item 0 fails at once; every other item writes its file into ``folder`` after SLOW_S."""
    if item == 0:
        raise ValueError("unit 0 failed")
    time.sleep(SLOW_S)
    (Path(folder) / f"unit-{item}").write_text("spilled")
    return item


def test_a_failing_unit_on_a_shared_pool_leaves_no_unit_running(tmp_path):
    """The run's backend is shared by its steps, so its close does not wait here."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with ProcessBackend(2) as backend:
        backend.pool.submit(int).result()  # the workers are started: no unit waits for a spawn
        with pytest.raises(ValueError, match="unit 0 failed"):
            for _ in backend.stream(_unit, str(scratch), list(range(6))):
                pass
        written = sorted(p.name for p in scratch.iterdir())
        time.sleep(SLOW_S + 1.0)
        assert sorted(p.name for p in scratch.iterdir()) == written, "written after the stream"


def _times(job: int, item: int) -> int:
    if item == 5:
        raise ValueError("item 5 failed")
    return job * item


@pytest.mark.parametrize("kind", ["local", "threads", "processes"])
def test_every_backend_gives_results_in_order_and_an_error_in_its_place(kind):
    backends = {"local": LocalBackend, "threads": ThreadBackend, "processes": ProcessBackend}
    with backends[kind](*([] if kind == "local" else [2])) as backend:
        assert list(backend.stream(_times, 10, range(5))) == [0, 10, 20, 30, 40]
        assert backend.map(abs, [-3, 2, -1]) == [3, 2, 1]
        with pytest.raises(ValueError, match="item 5 failed"):
            list(backend.stream(_times, 10, range(9)))
        values = list(backend.stream(_times, 10, range(40), errors=True))
    # with errors: the failure in its place, no unit started after it (a bounded few were in
    # flight and finished), and the stream ends there
    assert values[:5] == [0, 10, 20, 30, 40] and isinstance(values[5], ValueError)
    assert len(values) <= 6 + 2 * backend.workers


class Units(ThreadBackend):
    """Threads in units of 4 items (as Ray's tasks)."""

    def unit_size(self, items: int) -> int:
        return 4


def test_a_unit_stops_at_its_first_error_and_the_rest_of_it_yields_none():
    with Units(1) as backend:
        values = list(backend.stream(_times, 1, range(12), errors=True))
    assert values[:5] == [0, 1, 2, 3, 4] and isinstance(values[5], ValueError)
    assert values[6:8] == [None, None]  # items 6 and 7 of unit 1 never started


def test_the_runner_config_alone_builds_the_backend_and_a_run_makes_it_current():
    from llmflow.tasks.config import RunnerConfig
    from llmflow.tasks.framework import backend as backend_module

    assert backend_module.current().kind == "local"
    with make_backend(RunnerConfig(kind="processes", max_workers=2)) as backend:
        assert backend.kind == "processes" and backend.workers == 2
        with active(backend):
            assert backend_module.current() is backend
        assert backend_module.current().kind == "local"
    with make_backend(RunnerConfig(kind="threads")) as backend, active(backend):
        assert backend_module.current().kind == "local"  # a step's units stay in this process
