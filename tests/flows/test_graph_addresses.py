"""The data backend's redesign (one Backend, ``runner.fan_out: shard`` and ``kind: dask``
removed) and the planner's split moved no output: every address of the quickstart's graph is
the one the commit before them gave, computed by the same code in a checkout of that commit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkouts import helper_output, helper_output_at

BEFORE = "0cd082204fada9a8ecf30893f64d817e6eb73719"  # main before the backend redesign
HELPER = Path(__file__).with_name("graph_addresses.py")


@pytest.mark.slow
def test_no_quickstart_address_moves(tmp_path):
    before = helper_output_at(BEFORE, HELPER, tmp_path, timeout=300)
    now = helper_output(HELPER, timeout=300)
    assert len(now) > 50 and {step for step, _, _ in now} >= {"ingest", "pretrain", "card"}
    assert now == before
