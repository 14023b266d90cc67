"""The steps' logs reach the Prefect API in a worker's flow-run process (it loads Prefect first).

A process worker starts ``python -m prefect.engine``: Prefect sets its logging up on import, before
the flow's module imports ``llmflow.flows`` (whose default ``PREFECT_LOGGING_EXTRA_LOGGERS`` comes
too late there). tests/chaos/test_worker_deployment_kill.py checks it through a real worker.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHECK = """
import logging
import prefect.main  # what the engine's entry point loads: Prefect's logging set up
from prefect.logging.handlers import APILogHandler
import llmflow.flows
handlers = logging.getLogger("llmflow").handlers
print(sum(isinstance(h, APILogHandler) for h in handlers))
"""


def _api_handlers(**env: str) -> int:
    base = {k: v for k, v in os.environ.items() if k != "PREFECT_LOGGING_EXTRA_LOGGERS"}
    base.pop("PREFECT__FLOW_RUN_ID", None)
    out = subprocess.run(
        [sys.executable, "-c", CHECK],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"PREFECT__FLOW_RUN_ID": "00000000-0000-0000-0000-000000000001"}, 1),  # a worker's run
        ({}, 0),  # not a flow-run process: nothing changes (no API handler outside a run)
        ({"PREFECT__FLOW_RUN_ID": "x", "PREFECT_LOGGING_EXTRA_LOGGERS": "mine"}, 0),  # user's
        ({"PREFECT__FLOW_RUN_ID": "x", "PREFECT_LOGGING_EXTRA_LOGGERS": "llmflow"}, 1),  # once
    ],
    ids=["flow-run-process", "other-process", "user-setting-wins", "set-already-no-duplicate"],
)
def test_the_llmflow_logger_ships_to_the_api_in_a_flow_run_process(env, expected):
    assert _api_handlers(**env) == expected
