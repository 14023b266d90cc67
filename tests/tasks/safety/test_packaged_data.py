"""The safety data shipped with llmflow (``safety.data_root: packaged``, the default): the public
files unchanged, with their licences and notice, reachable from an install."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

import pytest

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.safety.config import PACKAGED, SafetyConfig
from llmflow.tasks.safety.data import packaged_root, read_crows, read_toxigen, safety_files
from tests.needs import shared_path

REPO = Path(__file__).resolve().parents[3]
LICENSES = {  # licence file -> a line its text must hold
    "CrowS-Pairs-CC-BY-SA-4.0.txt": "Creative Commons Attribution-ShareAlike 4.0 International",
    "LDNOOBW-CC-BY-4.0.txt": "Attribution 4.0 International",
    "ToxiGen-LICENSE.txt": "Community Data License Agreement - Permissive - Version 2.0",
}


def _sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _relative(files: list[str], root: Path) -> list[str]:
    return [Path(f).relative_to(root).as_posix() for f in files]


def test_the_default_is_the_packaged_data_and_every_file_reads():
    assert SafetyConfig().data_root == PACKAGED
    files = safety_files(PACKAGED)
    root = packaged_root()
    assert all(Path(f).is_relative_to(root) for f in files)
    assert len(read_crows(Path(files[0]))) == 1508  # the whole set, as the paper counts it
    demos = read_toxigen(files)
    # 30 files; the two muslim ones and their _sentences twins are one set per kind
    assert len(demos) == 28 and {d.kind for d in demos} == {"hate", "neutral"}


def test_the_packaged_files_are_the_public_ones_byte_for_byte():
    """Same names, same sha256, same order: the steps' addresses do not depend on which copy."""
    shared = shared_path("safety")
    ours, theirs = safety_files(PACKAGED), safety_files(shared)
    assert _relative(ours, packaged_root()) == _relative(theirs, shared)
    assert [_sha256(f) for f in ours] == [_sha256(f) for f in theirs]


def test_licences_and_notice_ship_beside_the_data():
    root = resources.files("llmflow.tasks.safety") / PACKAGED  # as an installed package finds it
    for name, line in LICENSES.items():
        assert line in (root / "LICENSES" / name).read_text(encoding="utf-8"), name
    assert "MIT License" in (root / "LICENSES" / "ToxiGen-LICENSE.txt").read_text()
    notice = (root / "NOTICE.md").read_text(encoding="utf-8")
    for needed in (
        "crows_pairs_anonymized.csv",
        "toxigen_demonstrations/",
        "ldnoobw_en.txt",
        "CC BY-SA 4.0",
        "CC BY 4.0",
        "MIT License",
        "CDLA-Permissive-2.0",
        "https://github.com/nyu-mll/crows-pairs",
        "https://github.com/microsoft/TOXIGEN",
        "https://github.com/LDNOOBW/List-of-Dirty-Naughty-Obscene-and-Otherwise-Bad-Words",
        *LICENSES,
    ):
        assert needed in notice, needed


def test_no_licence_or_notice_file_is_read_as_data():
    names = {Path(f).name for f in safety_files(PACKAGED)}
    assert not names & {"NOTICE.md", *LICENSES}
    assert len(names) == 32  # CrowS-Pairs, the word list, 30 ToxiGen files


def test_a_missing_folder_is_named_with_how_to_turn_safety_on_or_off(tmp_path):
    with pytest.raises(BadInputError, match=f"{tmp_path / 'none'}.*safety.data_root to packaged"):
        safety_files(tmp_path / "none")


@pytest.mark.slow  # builds a wheel from a copy of the checkout: ~15 s
def test_the_wheel_ships_the_safety_data_unchanged(tmp_path):
    source = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info beside setup.py
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("flows", "tasks", "model", "configs", "deployments"):
        shutil.copytree(
            REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "-w", str(tmp_path / "dist"), str(source)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("llmflow-*.whl")
    root = packaged_root()
    expected = sorted(p for p in root.rglob("*") if p.is_file())
    prefix = "llmflow/tasks/safety/packaged/"
    with zipfile.ZipFile(wheel) as archive:
        shipped = {n[len(prefix) :]: archive.read(n) for n in archive.namelist() if prefix in n}
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith("/METADATA")))
    declared = metadata.decode().split("License-Expression: ")[1].splitlines()[0]
    for spdx in ("Apache-2.0", "CC-BY-SA-4.0", "CC-BY-4.0", "MIT", "CDLA-Permissive-2.0"):
        assert spdx in declared.split(" AND "), declared
    assert sorted(shipped) == [p.relative_to(root).as_posix() for p in expected]
    for path in expected:
        assert shipped[path.relative_to(root).as_posix()] == path.read_bytes(), path
