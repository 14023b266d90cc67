"""Maps the repository's top-level folders into one import name, ``llmflow``.

``flows/`` -> ``llmflow.flows``, ``tasks/`` -> ``llmflow.tasks``, ``model/`` -> ``llmflow.model``,
and the presets (``configs/``, ``deployments/``) ship as package data, so an installed llmflow
works from any directory and never claims a user's own ``tasks`` or ``model`` module.
Everything else about the distribution lives in ``pyproject.toml``.
"""

from setuptools import find_packages, setup

FOLDERS = ("flows", "tasks", "model")
DATA = {"configs": ["*.yaml", "**/*.yaml"], "deployments": ["**/*.yaml", "**/*.json"]}

packages = [f"llmflow.{p}" for p in find_packages(include=[f"{f}*" for f in FOLDERS])]
packages += [f"llmflow.{d}" for d in DATA]
setup(
    packages=packages,
    package_dir={f"llmflow.{f}": f for f in (*FOLDERS, *DATA)},
    package_data={f"llmflow.{d}": globs for d, globs in DATA.items()},
)
