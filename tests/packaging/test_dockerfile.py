"""The Dockerfile parses, names its stages, and copies only paths that exist and are not ignored.

No Docker daemon or registry is needed: the instructions are parsed here (line continuations,
comments, ARG defaults substituted into FROM), as `docker build` would read them.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER",
}  # fmt: skip


def parse(text: str) -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuations joined, comments and blank lines dropped."""
    parsed, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        parsed.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return parsed


def stages(parsed: list[tuple[str, str]]) -> dict[str, str]:
    """Stage name -> base image, with global ARG defaults substituted."""
    args, found = {}, {}
    for keyword, rest in parsed:
        if keyword == "ARG" and not found:
            name, _, default = rest.partition("=")
            args[name] = default.strip('"')
        if keyword == "FROM":
            words = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            assert len(words) == 3 and words[1].upper() == "AS", f"unnamed stage: FROM {rest}"
            found[words[2]] = image
    return found


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore (simple globs, ** anywhere, no ! exceptions) excludes ``path``."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in (p.rstrip("/") for p in patterns):
        plain = pattern.removeprefix("**/")
        if any(
            fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p.split("/")[-1], plain)
            for p in prefixes
        ):
            return True
    return False


def dockerfile() -> list[tuple[str, str]]:
    return parse((REPO / "Dockerfile").read_text())


def test_every_line_is_a_known_instruction_and_stages_are_named():
    parsed = dockerfile()
    assert all(keyword in INSTRUCTIONS for keyword, _ in parsed), [
        k for k, _ in parsed if k not in INSTRUCTIONS
    ]
    assert parsed[0][0] in ("ARG", "FROM")
    found = stages(parsed)
    assert set(found) == {"build", "files", "cpu", "gpu"}
    assert found["gpu"].startswith("nvidia/cuda:") and "runtime" in found["gpu"]
    assert found["cpu"].startswith("python:") and found["cpu"].endswith("-slim")


def test_both_targets_install_llmflow_as_a_package_in_opt_llmflow():
    parsed, current, seen = dockerfile(), None, {None: []}  # None: global ARGs
    for keyword, rest in parsed:
        if keyword == "FROM":
            current = rest.split()[-1]
            seen[current] = []
        else:
            seen[current].append((keyword, rest))
    for target in ("cpu", "gpu"):
        steps = seen[target]
        assert ("WORKDIR", "/opt/llmflow") in steps, target
        runs = " && ".join(rest for keyword, rest in steps if keyword == "RUN")
        assert '"$(ls /wheels/llmflow-*.whl)[${LLMFLOW_EXTRAS}]"' in runs, target
        assert ("ARG", "LLMFLOW_EXTRAS") in steps and "llmflow --help" in runs, target
        copied = [rest for keyword, rest in steps if keyword == "COPY"]
        assert "--from=build /wheels /wheels" in copied, target
        assert "--from=files /opt/llmflow /opt/llmflow" in copied, target
    files = [rest for keyword, rest in seen["files"] if keyword == "COPY"]
    assert {"flows/ flows/", "configs/ configs/", "deployments/ deployments/"} <= set(files)
    assert any("pip wheel" in rest for keyword, rest in seen["build"] if keyword == "RUN")


def test_every_copied_path_exists_and_is_in_the_build_context():
    parsed = dockerfile()
    names = set(stages(parsed))
    patterns = [
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]  # fmt: skip
    checked = 0
    for keyword, rest in parsed:
        if keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(rest)
        flags = [w for w in words if w.startswith("--")]
        sources = [w for w in words if not w.startswith("--")][:-1]
        stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
        if stage is not None:
            assert stage in names, f"COPY --from={stage}: no such stage"
            continue
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: missing from the repository"
            assert not ignored(source.rstrip("/"), patterns), (
                f"COPY {source}: excluded by .dockerignore"
            )
            checked += 1
    assert checked >= 8


def test_dockerignore_keeps_the_context_small_but_not_the_sources():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for heavy in (".git", ".venv", "runs", "tests", "tasks/x/__pycache__"):
        assert ignored(heavy, patterns), heavy
    for needed in ("tasks/ingest/ingest.py", "configs/smollm3-1.7b.yaml", "setup.py", "README.md"):
        assert not ignored(needed, patterns), needed


# --- the image's extras cover what every recipe and manifest runs -------------------------------

EXTRA_FEATURES = ("merge", "ray", "sweep", "trackers")
"""The extras that turn on a feature (test and bench are for development)."""


def image_extras() -> set[str]:
    """The extras the image installs (the global ARG LLMFLOW_EXTRAS default)."""
    for keyword, rest in dockerfile():
        if keyword == "ARG" and rest.startswith("LLMFLOW_EXTRAS="):
            return set(rest.partition("=")[2].strip('"').split(","))
    raise AssertionError("the Dockerfile declares no ARG LLMFLOW_EXTRAS")


def extra_modules(extra: str) -> set[str]:
    """Top-level import names of the distributions an extra lists (from pyproject.toml)."""
    import importlib.metadata as md

    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    dists = {re.split(r"[\[<>=~!; ]", d, maxsplit=1)[0].lower().replace("_", "-")
             for d in project["optional-dependencies"][extra]}  # fmt: skip
    return {
        module
        for module, owners in md.packages_distributions().items()
        if not module.startswith("_") and any(o.lower().replace("_", "-") in dists for o in owners)
    }


RECIPES = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name", RECIPES)
def test_the_image_extras_cover_each_recipe(name):
    from llmflow.tasks.config import load_config, required_extras

    missing = required_extras(load_config(REPO / "configs" / name)) - image_extras()
    assert not missing, f"{name} needs llmflow[{','.join(sorted(missing))}], not in the image"


def test_every_recipe_graph_builds_with_only_the_image_extras(tmp_path):
    """Build each recipe's graph with the modules of every other extra made unimportable."""
    from llmflow.tasks.config import load_config
    from tests.flows.hub_models import save_hub_model

    hidden = set().union(*(extra_modules(e) for e in EXTRA_FEATURES if e not in image_extras()))
    # a recipe starting from a Hub model gets a tiny Llama under its name in an offline mirror
    for name in RECIPES:
        init = load_config(REPO / "configs" / name).init
        if init:
            repo = init.removeprefix("hf://models/").split("@")[0]
            folder = save_hub_model(tmp_path / "mirror", repo, "llama")
            config = json.loads((folder / "config.json").read_text())
            config["max_position_embeddings"] = 65536  # the recipes' long stages fit it
            (folder / "config.json").write_text(json.dumps(config))
    script = f"""
import importlib.abc, sys
HIDDEN = {sorted(hidden)!r}
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ImportError("hidden: " + name)
sys.meta_path.insert(0, Hide())
import importlib.util
real_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda n, *a: None if n.split(".")[0] in HIDDEN else real_find_spec(n, *a)
from llmflow.flows.recipe import recipe
from llmflow.tasks.config import load_config
for name in {RECIPES!r}:
    # the recipe as the image runs it, on the offline sample instead of its Hub data
    # (and the generated post-training data instead of files the user exports)
    overrides = ["data=[]", "sft.data=quickstart", "dpo.data=quickstart", "grpo.data=quickstart"]
    recipe(load_config({str(REPO / "configs")!r} + "/" + name, overrides))
"""
    env = {**os.environ, "LLMFLOW_HUB_MIRROR": str(tmp_path / "mirror")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_kuberay_manifest_runs_on_an_image_with_ray():
    manifests = (REPO / "deployments" / "kubernetes").glob("*.yaml")
    ray_manifests = [p.name for p in manifests if "kind: RayCluster" in p.read_text()]
    assert ray_manifests and "ray" in image_extras()
    assert {"ray", "prefect_ray"} <= extra_modules("ray")
