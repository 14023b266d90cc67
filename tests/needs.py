"""What a test needs that a checkout may lack: the real data sets beside it (``../shared/data``)
and the ``bench`` extra (datatrove, spaCy). Without them a test skips, except where the run says
it must not: CI sets ``LLMFLOW_REQUIRE_SHARED_DATA=1`` (both jobs) and ``LLMFLOW_REQUIRE_BENCH=1``
(the job that installs the extra), so a real-data or datatrove check fails instead of vanishing."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DATA_FLAG, BENCH_FLAG = "LLMFLOW_REQUIRE_SHARED_DATA", "LLMFLOW_REQUIRE_BENCH"


def skip_unless_required(reason: str, flag: str = DATA_FLAG) -> NoReturn:
    """Skip with ``reason``, or fail when ``flag`` is set to 1 in the environment."""
    if os.environ.get(flag) == "1":
        pytest.fail(f"{reason}, and {flag}=1 says this run must not skip it", pytrace=False)
    pytest.skip(reason)


def shared_path(*parts: str) -> Path:
    """A folder or file under ``../shared/data``; skips (or fails, see above) when absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        skip_unless_required(f"{path} is absent")
    return path


def bench_module(name: str) -> ModuleType:
    """Import a module of the ``bench`` extra; skips (or fails, see above) when missing."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        skip_unless_required(f"{name} is not installed (llmflow[bench]): {err}", BENCH_FLAG)
