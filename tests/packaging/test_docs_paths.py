"""Every repository path the docs name exists, and the README stays a one-screen front page.

The docs are README.md, docs/*.md and benchmarks/README.md. A path is a repo-relative name that
starts with one of the repository's top-level entries (`tasks/framework/step.py`,
`configs/quickstart.yaml`, `setup.sh`): in an inline code span, in a fenced block (not a
```diff, whose example adds a file on purpose), a Markdown link (resolved from the doc's
folder), or a bare mention of another doc (`docs/CLUSTER.md`) in the prose. A name cut at a
placeholder (`tasks/<area>/`, `run-*.jsonl`) must begin some existing path; names relative to something else
(`hf/README.md` in an output, `data/...` in an upstream repository) do not start with a
top-level entry and are not checked.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks/README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BARE_DOC = re.compile(r"(?<![\w./`-])((?:docs/[A-Za-z_]+|benchmarks/README)\.md)")
# The two commands .ci/run and the quickstart's readers rely on, and the phrase the
# quickstart's measured duration replaces.
COMMANDS = (
    "bash setup.sh && .venv/bin/llmflow run",
    "bash setup.sh && .venv/bin/python -m pytest -q",
)


def top_level() -> list[str]:
    """The repository's top-level tracked entries (`tasks`, `setup.sh`, `.ci`, ...)."""
    listed = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return sorted({name.split("/")[0] for name in listed}, key=len, reverse=True)


def named_paths(text: str, roots: list[str]) -> set[str]:
    """Repo-relative paths named in one doc's code spans and non-diff fenced blocks."""
    alternatives = "|".join(re.escape(r) for r in roots)
    # a root, then path characters; not preceded by a path character (`a/flows/x.py`,
    # `hf://models/...`, `../shared/data` are not repo-relative)
    path = re.compile(rf"(?<![\w./:-])((?:{alternatives})(?:/[\w.-]*)*)([*<{{]?)")
    blocks = [body for lang, body in FENCE.findall(text) if lang != "diff"]
    prose = FENCE.sub("", text)
    spans = SPAN.findall(prose) + blocks
    found = set()
    for span in spans:
        for name, placeholder in path.findall(span):
            found.add(name.rstrip(".") + ("*" if placeholder else ""))
    return found


def exists(name: str) -> bool:
    """Whether a named path exists; `run-*` (cut at a placeholder) matches any completion."""
    return any(REPO.glob(name)) if name.endswith("*") else (REPO / name).exists()


def linked_paths(doc: Path) -> set[Path]:
    """Files a doc links to or mentions by name (other docs), resolved to absolute paths."""
    prose = FENCE.sub("", doc.read_text())
    found = set()
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        found.add((doc.parent / target.split("#")[0]).resolve())
    for name in BARE_DOC.findall(SPAN.sub("", prose)):
        found.add(REPO / name)
    return found


def test_every_path_a_doc_names_exists():
    roots = top_level()
    missing = []
    for doc in DOCS:
        assert doc.is_file(), f"{doc.relative_to(REPO)} is missing"
        for name in sorted(named_paths(doc.read_text(), roots)):
            if not exists(name):
                missing.append(f"{doc.relative_to(REPO)}: `{name}`")
        for target in sorted(linked_paths(doc)):
            if not target.exists():
                missing.append(f"{doc.relative_to(REPO)}: link to {target}")
    assert not missing, "docs name paths that do not exist:\n" + "\n".join(missing)


def test_the_checker_finds_what_it_should_and_only_that():
    roots = ["tasks", "configs", "setup.sh", ".ci"]
    text = (
        "see `tasks/concurrency.py: gpu_slot()` and `flows/x.py` with `--set a=configs/x.yaml`,\n"
        "`hf://models/tasks/a`, `{root}/tasks/b`, `../shared/data`, `tasks/<area>/`, `setup.sh`\n"
        "and `.ci/run`.\n```bash\nbash setup.sh --x configs/y.yaml\n```\n"
        "```diff\n+++ b/tasks/new.py\n+see tasks/new.py\n```\n"
    )
    assert named_paths(text, roots) == {
        "tasks/concurrency.py", "configs/x.yaml", "tasks/*", "setup.sh", ".ci/run", "configs/y.yaml",
    }  # fmt: skip


def test_the_readme_fits_a_screen_and_keeps_its_two_commands():
    readme = (REPO / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 130, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    for command in COMMANDS:
        assert f"\n{command}\n" in readme, command
    assert "10 minutes" not in readme  # the quickstart's time is measured, not guessed
    for doc in ("PIPELINE", "RECIPES", "EXPERIMENTS", "CLUSTER", "ARCHITECTURE"):
        assert f"docs/{doc}.md" in readme, doc
    assert "benchmarks/README.md" in readme
    order = [readme.index(name) for name in (
        "flows/recipe.py", "tasks/framework/step.py", "tasks/pretrain/train.py",
        "model/transformer.py",
    )]  # fmt: skip
    assert order == sorted(order), "the reading order is recipe, step, train, transformer"
