"""Maps the repository's top-level folders into one import name, ``llmflow``.

``flows/`` -> ``llmflow.flows``, ``tasks/`` -> ``llmflow.tasks``, ``model/`` -> ``llmflow.model``,
and the presets (``configs/``, ``deployments/``) ship as package data, so an installed llmflow
works from any directory and never claims a user's own ``tasks`` or ``model`` module. So do the
safety data sets (``tasks/safety/packaged/``, with their licences and NOTICE.md).
Everything else about the distribution lives in ``pyproject.toml``.
"""

from setuptools import find_packages, setup

FOLDERS = ("flows", "tasks", "model")
DATA = {"configs": ["*.yaml", "**/*.yaml"], "deployments": ["**/*.yaml", "**/*.json"]}
TASK_DATA = {"llmflow.tasks.safety": ["packaged/**/*"]}

packages = [f"llmflow.{p}" for p in find_packages(include=[f"{f}*" for f in FOLDERS])]
packages += [f"llmflow.{d}" for d in DATA]
setup(
    packages=packages,
    package_dir={f"llmflow.{f}": f for f in (*FOLDERS, *DATA)},
    package_data={f"llmflow.{d}": globs for d, globs in DATA.items()} | TASK_DATA,
)
