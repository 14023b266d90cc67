"""The Launcher protocol moved no output: every pretrain stage of the quickstart
under each launch setting, and the multi-GPU recipes' stage runs, keep the address (and world
size) that the commit before it gave, computed by the same code in a checkout of that commit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkouts import helper_output, helper_output_at

BEFORE = "09418631b6783de8c45ec00926a634c9abe58f57"  # main before the Launcher protocol (77c16d7)
HELPER = Path(__file__).with_name("launch_addresses.py")


@pytest.mark.slow
def test_no_pretrain_address_moves(tmp_path):
    before = helper_output_at(BEFORE, HELPER, tmp_path)
    now = helper_output(HELPER)
    assert now == before
    # The settings do reach the address: 1, 2, 4 and 8 ranks give four different ones.
    firsts = {
        now[k][0][1]: now[k][0][2] for k in ("quickstart", "torchrun-2", "ray-4", "accelerate-8")
    }
    assert sorted(firsts) == [1, 2, 4, 8] and len(set(firsts.values())) == 4
