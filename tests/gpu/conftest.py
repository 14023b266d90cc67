"""Fixtures of the GPU suite: the tiny packed datasets the trainer tests use."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_helpers import make_packed


@pytest.fixture(scope="session")
def gpu_train_data(tmp_path_factory) -> Path:
    return make_packed(tmp_path_factory.mktemp("data") / "train", num_docs=300, seed=0)


@pytest.fixture(scope="session")
def gpu_val_data(tmp_path_factory) -> Path:
    return make_packed(tmp_path_factory.mktemp("data") / "val", num_docs=60, seed=1)
