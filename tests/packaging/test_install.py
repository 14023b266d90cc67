"""The installed distribution: one top-level name, ``llmflow``, working from any directory.

A fresh venv gets a non-editable install of this checkout (its dependencies come from the test
venv through a ``.pth`` line, so nothing is downloaded but the build backend), then runs the CLI
from an empty directory elsewhere.
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
NOT_SOURCE = (".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", "*_cache")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv holding a plain (non-editable) install of llmflow; returns its python."""
    home = tmp_path_factory.mktemp("venv")
    venv.create(home, with_pip=True)
    python = home / "bin" / "python"
    target = subprocess.run(
        [python, "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(target, "llmflow-deps.pth").write_text(site.getsitepackages()[0] + "\n")
    source = tmp_path_factory.mktemp("source") / "llmflow"  # the build writes build/ beside it
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", str(source)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return python


def _run(python: Path, cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([python, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_only_llmflow_is_importable_and_presets_ship(installed, tmp_path):
    probe = (
        "import importlib.util, json, llmflow.tasks.config as c;"
        "print(json.dumps({'names': [n for n in ('tasks', 'model', 'flows', 'configs')"
        " if importlib.util.find_spec(n)], 'file': c.__file__, 'preset': str(c.DEFAULT_CONFIG),"
        " 'exists': c.DEFAULT_CONFIG.exists()}))"
    )
    out = _run(installed, tmp_path, "-c", probe)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout)
    assert found["names"] == []  # no top-level tasks/model/flows to shadow a user's own
    assert str(REPO) not in found["file"] and "site-packages/llmflow/" in found["file"]
    assert found["exists"] and "site-packages/llmflow/configs" in found["preset"]


def test_cli_runs_from_another_directory(installed, tmp_path):
    root = tmp_path / "runs"
    out = _run(
        installed,
        tmp_path,
        "-m",
        "llmflow.flows.cli",
        "run",
        "--root",
        str(root),
        "--until",
        "ingest",
        "--set",
        "sample.num_code_files=4",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (ingested,) = [p for p in (root / "ingest").iterdir() if not p.name.startswith(".")]
    assert (ingested / "_COMMITTED").exists()
    assert json.loads((ingested / "lineage.json").read_text())["metrics"]["documents"] > 0
    bad = _run(installed, tmp_path, "-m", "llmflow.flows.cli", "run", "--data", "/no/such/file")
    assert bad.returncode == 2 and "does not exist: /no/such/file" in bad.stderr
