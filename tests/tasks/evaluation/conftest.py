"""Fixtures for the evaluation tests (helpers in ``eval_fixtures.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from eval_fixtures import make_tiny_model, write_heldout

# NOTE: tests/conftest.py sets HF_HOME to a temp dir and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE.


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="session")
def heldout_dir(tmp_path_factory) -> Path:
    return write_heldout(tmp_path_factory.mktemp("heldout"))


@pytest.fixture(scope="session")
def shared_eval_dir(shared_data: Path) -> Path:
    """The real eval sets; tests using them skip when ../shared/data is absent."""
    from tests.needs import shared_path

    return shared_path("eval").resolve()
