"""Where data units run (``units.py``): a failing unit on the process pool leaves nothing running.

Ingest's workers spill into a scratch folder inside the output, which the caller removes once the
stream ends; a unit still running then would write into the output after that (and a committed
output could keep the folder).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llmflow.tasks.dataprep.units import process_pool, process_stream

SLOW_S = 2.0


def _unit(folder: str, item: int) -> int:
    """Item 0 fails at once; every other item writes its file into ``folder`` after SLOW_S."""
    if item == 0:
        raise ValueError("unit 0 failed")
    time.sleep(SLOW_S)
    (Path(folder) / f"unit-{item}").write_text("spilled")
    return item


def test_a_failing_unit_on_a_shared_pool_leaves_no_unit_running(tmp_path):
    """The data units' pool is shared (``data_units``), so its shutdown does not wait here."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with process_pool(2) as pool:
        pool.submit(int).result()  # the workers are started: no unit waits for a spawn
        with pytest.raises(ValueError, match="unit 0 failed"):
            for _ in process_stream(_unit, str(scratch), list(range(6)), 2, pool):
                pass
        written = sorted(p.name for p in scratch.iterdir())
        time.sleep(SLOW_S + 1.0)
        assert sorted(p.name for p in scratch.iterdir()) == written, "written after the stream"
