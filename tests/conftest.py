"""Shared test setup: an isolated Prefect home and HF cache, offline, and one Prefect harness."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

_TMP = Path(tempfile.mkdtemp(prefix="llmflow-tests-"))
# NOTE: set before anything imports prefect or transformers; both read these at import time.
os.environ["PREFECT_HOME"] = str(_TMP / "prefect")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
os.environ["HF_HOME"] = str(_TMP / "hf")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["LLMFLOW_CACHE"] = str(_TMP / "cache")
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["WANDB_DISABLED"] = "true"


@pytest.fixture(scope="session")
def prefect_harness():
    """One ephemeral Prefect API for the whole session (it takes seconds to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real public data sets beside the checkout; tests using them skip when absent."""
    from tests.needs import shared_path

    return shared_path()


@pytest.fixture
def on_backend():
    """``on_backend(backend)`` makes ``backend`` the run's for the rest of the test (what a
    step's own units run on, as a run's executor makes its runner's backend); closed after."""
    from llmflow.tasks.framework.backend import active

    with contextlib.ExitStack() as stack:

        def use(backend):
            stack.enter_context(backend)
            stack.enter_context(active(backend))
            return backend

        yield use
