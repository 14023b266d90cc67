"""Shared pieces of the GPU suite: the trainer-test helpers of tests/tasks/pretrain/conftest.py
(loaded by path, so this folder needs no package), the skip marker, and bf16's unit roundoff.
No conftest.py here: it would shadow the ``conftest`` module the trainer tests import from when
both folders are collected in one run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

U = 2.0**-8
"""bf16's unit roundoff: 8 significant bits."""

REPO = Path(__file__).resolve().parents[2]

GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
"""Every module's ``pytestmark``: in the ``gpu`` suite (``pytest -m gpu``), skipped without CUDA."""


def _pretrain_helpers():
    path = REPO / "tests" / "tasks" / "pretrain" / "conftest.py"
    spec = importlib.util.spec_from_file_location("llmflow_gpu_pretrain_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_helpers = _pretrain_helpers()
TINY_MODEL = _helpers.TINY_MODEL
make_packed = _helpers.make_packed
tiny_config = _helpers.tiny_config
run_trainer = _helpers.run_trainer
read_jsonl = _helpers.read_jsonl
losses_by_step = _helpers.losses_by_step
