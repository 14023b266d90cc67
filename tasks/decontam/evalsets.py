"""The items of every evaluation set the evaluate step runs, as (question, gold answers).

Bundled synthetic sets are generated as the suite generates them; the real sets are read from
their files (the step's raw input); any other task, and the custom lm-eval task YAMLs given by
path, are loaded through lm-eval itself (its ``doc_to_text`` is the question, its gold target or
gold choice the answer). A set that cannot be read raises ``BadInputError`` naming it: nothing
is ever silently left out of the index. The held-out perplexity tasks are the one exception by
construction: their documents are split from this very corpus after decontamination.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from llmflow.tasks.decontam.config import DecontamConfig
from llmflow.tasks.decontam.ngrams import Item
from llmflow.tasks.evaluation.suite import PPL_TAG, REAL_SET_FILES, SYNTHETIC_SETS, WIKITEXT_TITLE
from llmflow.tasks.framework.errors import BadInputError

HELD_OUT_REASON = "held-out documents are split from this corpus after decontamination"


class EvalSetError(BadInputError):
    """An evaluation set to decontaminate against cannot be read."""


def eval_items(
    cfg: DecontamConfig, files: list[Path]
) -> tuple[dict[str, list[Item]], dict[str, str]]:
    """Every task's items, and the tasks left out with the reason (held-out perplexity only).

    Args:
        cfg: The task names and the synthetic sets' size and seed.
        files: The real sets' files (matched by name: ``piqa_valid.jsonl``, ...).
    """
    by_name = {Path(f).name: Path(f) for f in files}
    items: dict[str, list[Item]] = {}
    skipped: dict[str, str] = {}
    others = []
    for task in cfg.tasks:
        if task == PPL_TAG or task.startswith("ppl_"):
            skipped[task] = HELD_OUT_REASON
        elif _synthetic_set(task) is not None:
            items[task] = synthetic_items(task, cfg.num_items, cfg.seed)
        elif task in REAL_SET_FILES:
            items[task] = real_set_items(task, by_name)
        else:
            others.append(task)
    if others or cfg.custom_tasks:
        items.update(lm_eval_items(others, cfg.custom_tasks))
    for task, found in items.items():
        if not found:
            raise EvalSetError(f"eval set {task!r} has no items: nothing to decontaminate against")
    return items, skipped


def _synthetic_set(task: str) -> str | None:
    prefix, _, name = task.partition("_")
    return name if prefix in ("cf", "mcf", "gen") and name in SYNTHETIC_SETS else None


def synthetic_items(task: str, num_items: int, seed: int) -> list[Item]:
    """The bundled set's items (the same for its cf_, mcf_ and gen_ tasks): question, answer."""
    rows = SYNTHETIC_SETS[_synthetic_set(task)](num_items, seed)
    return [Item(task, i, r["question"], (r["answer"],)) for i, r in enumerate(rows)]


def real_set_items(task: str, files: dict[str, Path]) -> list[Item]:
    """PIQA (goal, gold solution), GSM8K (question, worked answer), WikiText-2 (whole pages)."""
    missing = [name for name in REAL_SET_FILES[task] if name not in files]
    if missing:
        raise EvalSetError(f"eval set {task!r} cannot be read: {', '.join(missing)} not given")
    try:
        return READERS[task](task, files)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, IndexError) as exc:
        raise EvalSetError(f"eval set {task!r} cannot be read: {exc!r}") from exc


def _piqa(task: str, files: dict[str, Path]) -> list[Item]:
    questions = _jsonl(files["piqa_valid.jsonl"])
    labels = [int(x) for x in _lines(files["piqa_valid_labels.lst"])]
    if len(questions) != len(labels):
        raise ValueError(f"{len(questions)} PIQA questions but {len(labels)} labels")
    return [
        Item(task, i, q["goal"], ((q["sol1"], q["sol2"])[label],))
        for i, (q, label) in enumerate(zip(questions, labels, strict=True))
    ]


def _gsm8k(task: str, files: dict[str, Path]) -> list[Item]:
    rows = _jsonl(files["gsm8k_test.jsonl"])
    return [Item(task, i, r["question"], (r["answer"],)) for i, r in enumerate(rows)]


def _wikitext(task: str, files: dict[str, Path]) -> list[Item]:
    pages: list[list[str]] = []
    text = files["wikitext2_test.txt"].read_text(encoding="utf-8")
    for line in text.splitlines(True):
        if WIKITEXT_TITLE.match(line.rstrip("\n")) or not pages:
            pages.append([])
        pages[-1].append(line)
    docs = ["".join(p) for p in pages if "".join(p).strip()]
    return [Item(task, i, None, (page,)) for i, page in enumerate(docs)]


READERS = {"piqa_local": _piqa, "gsm8k_local": _gsm8k, "wikitext2_local": _wikitext}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in _lines(path)]


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# -- lm-eval tasks --------------------------------------------------------------------------
def lm_eval_items(names: list[str], custom: list[str]) -> dict[str, list[Item]]:
    """Items of lm-eval tasks by name, and of every task defined in the custom YAML paths."""
    from lm_eval.tasks import TaskManager

    for path in custom:
        if not Path(path).exists():
            raise EvalSetError(f"custom eval task path {path!r} does not exist")
    # lm-eval indexes folders; a file's task is picked from its folder by name below
    folders = sorted({str(p if Path(p).is_dir() else Path(p).parent) for p in custom})
    manager = TaskManager(include_path=folders or None, include_defaults=bool(names))
    wanted = list(names) + [t for t in _custom_task_names(custom) if t not in names]
    out: dict[str, list[Item]] = {}
    for name in wanted:
        if name not in manager.all_tasks:
            raise EvalSetError(f"eval set {name!r} is not a task lm-eval knows: cannot index it")
        try:
            loaded = manager.load([name])["tasks"]
            for leaf, task in loaded.items():
                out[leaf] = task_items(leaf, task)
        except EvalSetError:
            raise
        except Exception as exc:  # datasets raises many types when data is unreachable
            raise EvalSetError(f"eval set {name!r} cannot be read: {exc}") from exc
    return out


def _custom_task_names(paths: list[str]) -> list[str]:
    """The ``task:`` names defined in the custom YAML files (or folders of them)."""
    import yaml

    names = []
    for path in paths:
        files = sorted(Path(path).rglob("*.yaml")) if Path(path).is_dir() else [Path(path)]
        for file in files:
            text = file.read_text(encoding="utf-8")
            kept = "\n".join(line for line in text.splitlines() if "!function" not in line)
            spec = yaml.safe_load(kept) or {}
            if isinstance(spec, dict) and isinstance(spec.get("task"), str):
                names.append(spec["task"])
    return names


def task_items(name: str, task) -> list[Item]:
    """One lm-eval task's evaluation documents as items: what a web page holding the item would
    contain, not the prompt. The template's own text (``Question:`` ... ``Answer:``, constant
    across documents) is cut from the rendered ``doc_to_text``, lettered option lines
    (``A. ...``) are taken out of the question, and a gold that is an option's letter becomes
    that option's text."""
    output_type = task.config.output_type
    docs = list(task.eval_docs)
    if output_type == "loglikelihood_rolling":
        return [Item(name, i, None, (str(task.doc_to_target(d)),)) for i, d in enumerate(docs)]
    rendered = [str(task.doc_to_text(doc)) for doc in docs]
    prefix, suffix = template_text(task.config.doc_to_text, rendered)
    items = []
    for index, (doc, text) in enumerate(zip(docs, rendered, strict=True)):
        question, options = split_options(text)
        question = _cut(question, prefix, suffix)
        target = task.doc_to_target(doc)
        golds = _golds(task, doc, target, output_type)
        golds = tuple(options.get(g.strip(), g) for g in golds)
        items.append(Item(name, index, question or None, golds))
    return items


OPTION_LINE = re.compile(r"^\s*\(?([A-Za-z]|[0-9]{1,2})[.):]\s+(\S.*?)\s*$")


def split_options(text: str) -> tuple[str, dict[str, str]]:
    """The text less its lettered or numbered option lines (two or more, ``A. ...``), and the
    options by label."""
    kept, options = [], {}
    for line in text.split("\n"):
        match = OPTION_LINE.match(line)
        if match:
            options[match.group(1)] = match.group(2)
        else:
            kept.append(line)
    if len(options) < 2:
        return text, {}
    return "\n".join(kept), options


def template_text(template, rendered: list[str]) -> tuple[str, str]:
    """The text every rendering starts and ends with that is the template's, not a field's.

    A Jinja template says it: the literal text before its first and after its last
    expression. A template written as a function cannot say it: the text common to every
    rendering (cut at whitespace) is taken instead, when there are several documents."""
    if isinstance(template, str) and "{{" in template:
        first = min(i for i in (template.find("{{"), template.find("{%")) if i >= 0)
        last = max(template.rfind("}}"), template.rfind("%}")) + 2
        return template[:first], template[last:]
    if callable(template) and len(rendered) > 1:
        prefix = os.path.commonprefix(rendered)
        suffix = os.path.commonprefix([r[::-1] for r in rendered])[::-1]
        prefix = prefix[: max(prefix.rfind(" "), prefix.rfind("\n")) + 1]
        cut = min(i for i in (suffix.find(" "), suffix.find("\n"), len(suffix)) if i >= 0)
        return prefix, suffix[cut:]
    return "", ""


def _cut(text: str, prefix: str, suffix: str) -> str:
    if prefix.strip() and text.startswith(prefix):
        text = text[len(prefix) :]
    if suffix.strip() and text.endswith(suffix):
        text = text[: len(text) - len(suffix)]
    return text.strip()


def _golds(task, doc, target, output_type: str) -> tuple[str, ...]:
    """The gold answer text(s): a multiple-choice target is an index into the choices."""
    if output_type != "multiple_choice":
        return (str(target),)
    choices = task.doc_to_choice(doc)
    targets = target if isinstance(target, list) else [target]
    return tuple(str(choices[t]) if isinstance(t, int) else str(t) for t in targets)
