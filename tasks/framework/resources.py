"""Where the presets that ship with llmflow are, installed or in a checkout."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def data_dir(name: str) -> Path:
    """The folder of ``llmflow.<name>`` (``configs`` or ``deployments``) on this machine."""
    spec = importlib.util.find_spec(f"llmflow.{name}")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if Path(location).is_dir():
            return Path(location)
    raise FileNotFoundError(f"llmflow.{name} is not installed with this llmflow")


def preset_path(path: str) -> Path:
    """A preset file named as in the docs (``deployments/accelerate/cpu.yaml``): as given when it
    exists from here, else inside the installed llmflow."""
    given = Path(path)
    if given.is_absolute() or given.exists():
        return given
    shipped = data_dir(given.parts[0]).parent / given
    if not shipped.exists():
        raise FileNotFoundError(f"{path}: no such file here or in the installed llmflow")
    return shipped
