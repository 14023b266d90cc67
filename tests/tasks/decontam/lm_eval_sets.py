"""Eval sets defined by lm-eval's own task YAMLs, pointed at local data, planted in a corpus.

lm-eval's built-in definitions of ARC-Easy, PIQA, HellaSwag, GSM8K and MMLU (astronomy) are
``include``d unchanged except for where their data comes from (a JSON Lines file written here,
in the schema each task reads), plus one custom task with a template (``Question: {{q}}`` ...
``Answer:``), as a user writes one. The items are real public text: PIQA goals and solutions and
GSM8K problems (``../shared/data/eval``), a different slice for each task.

The corpus plants each item as a web page holding it would: the question and the gold answer's
text (never the prompt's ``Question:``/``Answer:``), verbatim and edited (case, punctuation,
whitespace, line breaks), inside clean prose; and adds clean documents and near misses (the
item's words in runs of at most 6, or its first 7 words alone).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from llmflow.tasks.decontam.ngrams import words

PER_TASK = 50
LETTERS = "ABCD"


def builtin_yaml(relative: str) -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent / relative


@dataclass(frozen=True)
class Planted:
    """One eval item as the tests know it from its raw fields (not through the code tested)."""

    task: str
    index: int
    question: str
    answer: str

    @property
    def web_text(self) -> str:
        return f"{self.question} {self.answer}"


def _read(eval_dir: Path) -> tuple[list[dict], list[dict]]:
    piqa = [json.loads(x) for x in (eval_dir / "piqa_valid.jsonl").read_text().splitlines()]
    labels = [int(x) for x in (eval_dir / "piqa_valid_labels.lst").read_text().split()]
    for row, label in zip(piqa, labels, strict=True):
        row["label"] = label
    gsm8k = [json.loads(x) for x in (eval_dir / "gsm8k_test.jsonl").read_text().splitlines()]
    for row in gsm8k:
        row["final"] = row["answer"].rsplit("####", 1)[-1].strip()
    return piqa, gsm8k


def _choices(final: str, rng: random.Random) -> tuple[list[str], int]:
    """Four numeric options, the right one at a random place."""
    value = int(final.replace(",", "")) if final.replace(",", "").isdigit() else 7
    options = [str(value)] + [str(value + d) for d in rng.sample([1, 2, 3, 5, 10, 11], 3)]
    rng.shuffle(options)
    return options, options.index(str(value))


def write_tasks(eval_dir: Path, folder: Path, per_task: int = PER_TASK) -> list[Planted]:
    """The task YAMLs and their data files under ``folder``; every item as planted text."""
    rng = random.Random(0)
    piqa, gsm8k = _read(eval_dir)
    folder.mkdir(parents=True, exist_ok=True)
    planted: list[Planted] = []
    p = [piqa[i * per_task : (i + 1) * per_task] for i in range(3)]
    g = [gsm8k[i * per_task : (i + 1) * per_task] for i in range(3)]

    def task(name: str, include: str | None, rows: list[dict], extra: str = "") -> None:
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        head = f"include: {builtin_yaml(include)}\n" if include else ""
        (folder / f"{name}.yaml").write_text(
            f"{head}task: {name}\ndataset_path: json\ndataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
            "test_split: test\nvalidation_split: null\ntraining_split: null\n"
            "fewshot_split: null\n" + extra
        )

    arc = []
    for i, row in enumerate(p[0]):
        texts = [row["sol1"], row["sol2"]]
        arc.append({"id": f"arc-{i}", "question": row["goal"], "answerKey": "AB"[row["label"]],
                    "choices": {"text": texts, "label": ["A", "B"]}})  # fmt: skip
        planted.append(Planted("arc_easy_local", i, row["goal"], texts[row["label"]]))
    task("arc_easy_local", "arc/arc_easy.yaml", arc)

    hella = []
    for i, row in enumerate(p[1]):
        endings = [row["sol1"], row["sol2"], "They give up.", "Nothing happens."]
        hella.append({"ind": i, "activity_label": "Everyday tasks", "ctx_a": row["goal"],
                      "ctx_b": "", "endings": endings, "label": str(row["label"]),
                      "split": "val", "split_type": "indomain", "source_id": f"h{i}",
                      "ctx": row["goal"]})  # fmt: skip
        planted.append(Planted("hellaswag_local", i, row["goal"], endings[row["label"]]))
    task("hellaswag_local", "hellaswag/hellaswag.yaml", hella)

    piqa_rows = [{k: r[k] for k in ("goal", "sol1", "sol2", "label")} for r in p[2]]
    for i, row in enumerate(piqa_rows):
        gold = (row["sol1"], row["sol2"])[row["label"]]
        planted.append(Planted("piqa_local_yaml", i, row["goal"], gold))
    task("piqa_local_yaml", "piqa/piqa.yaml", piqa_rows)

    for i, row in enumerate(g[0]):
        planted.append(Planted("gsm8k_local_yaml", i, row["question"], row["answer"]))
    task("gsm8k_local_yaml", "gsm8k/gsm8k.yaml",
         [{"question": r["question"], "answer": r["answer"]} for r in g[0]])  # fmt: skip

    mmlu = []
    for i, row in enumerate(g[1]):
        options, gold = _choices(row["final"], rng)
        mmlu.append({"question": row["question"], "subject": "astronomy", "choices": options,
                     "answer": gold})  # fmt: skip
        planted.append(Planted("mmlu_astronomy_local", i, row["question"], options[gold]))
    task("mmlu_astronomy_local", "mmlu/default/mmlu_astronomy.yaml", mmlu)

    custom = []
    for i, row in enumerate(g[2]):
        options, gold = _choices(row["final"], rng)
        custom.append({"q": row["question"], "options": options, "gold": gold})
        planted.append(Planted("templated_qa", i, row["question"], options[gold]))
    task(
        "templated_qa",
        None,
        custom,
        'output_type: multiple_choice\ndoc_to_text: "Question: {{q}}\\nAnswer:"\n'
        'doc_to_choice: "{{options}}"\ndoc_to_target: "{{gold}}"\n'
        "metric_list: [{metric: acc}]\n",
    )
    return planted


def edit(text: str, rng: random.Random) -> str:
    """Case, punctuation, whitespace and line breaks changed; the words kept."""
    text = text.lower() if rng.random() < 0.5 else text.upper()
    text = re.sub(r"[?.!,;:]", lambda _: rng.choice([" ", "; ", " - ", "!", ""]), text)
    tokens = text.split()
    return "".join(t + rng.choice([" ", "  ", "\n", " \n\n", "\t"]) for t in tokens).strip()


def clean_passages(text_dir: Path) -> list[str]:
    """WikiText-2 validation paragraphs and Shakespeare passages of about 120 words."""
    wiki = (text_dir / "wikitext2_valid.txt").read_text(encoding="utf-8").splitlines()
    passages = [line.strip() for line in wiki if len(line.split()) >= 40]
    tokens = (text_dir / "tinyshakespeare.txt").read_text(encoding="utf-8").split(" ")
    passages += [" ".join(tokens[i : i + 120]) for i in range(0, len(tokens) - 120, 120)]
    return passages


def corpus(planted: list[Planted], text_dir: Path, num_clean: int = 420, seed: int = 0):
    """Documents ``{id, text, domain, source}``: clean-*, exact-*, edited-*, near-*."""
    rng = random.Random(seed)
    passages = clean_passages(text_dir)
    rng.shuffle(passages)
    clean, hosts = passages[:num_clean], iter(passages[num_clean:])
    filler = [w for w in " ".join(clean[:40]).split() if w.isalpha() and len(w) > 3]
    docs = [_doc(f"clean-{i}", text) for i, text in enumerate(clean)]
    for item in planted:
        key = f"{item.task}-{item.index}"
        docs.append(_doc(f"exact-{key}", f"{next(hosts)}\n\n{item.web_text}\n\n{next(hosts)}"))
        docs.append(_doc(f"edited-{key}", f"{next(hosts)} {edit(item.web_text, rng)}"))
        runs = words(item.web_text)
        near = []
        for start in range(0, len(runs), 6):
            near += runs[start : start + 6] + rng.sample(filler, 3)
        docs.append(_doc(f"near-{key}", " ".join(near)))
        docs.append(_doc(f"stem-{key}", " ".join(runs[:7]) + " " + next(hosts)))
    rng.shuffle(docs)
    return docs


def _doc(doc_id: str, text: str) -> dict:
    return {"id": doc_id, "text": text, "domain": "prose", "source": "planted"}


def recall_table(planted: list[Planted], matches: list[dict], flagged: set[str], n: int):
    """Per task: items of >= n words found verbatim and edited, shorter ones too, and the clean
    documents (near misses included) flagged. ``matches``: (doc_id, task, item) records."""
    found = {(m["doc_id"], m["task"], m["item"]) for m in matches}
    rows = {}
    for item in planted:
        row = rows.setdefault(item.task, {"task": item.task, "long": 0, "short": 0,
                                          "exact": 0, "edited": 0, "exact_short": 0,
                                          "edited_short": 0})  # fmt: skip
        long = len(words(item.web_text)) >= n
        suffix = "" if long else "_short"
        row["long" if long else "short"] += 1
        key = f"{item.task}-{item.index}"
        for kind in ("exact", "edited"):
            row[kind + suffix] += (f"{kind}-{key}", item.task, item.index) in found
    clean = {d for d in flagged if d.split("-", 1)[0] in ("clean", "near", "stem")}
    return list(rows.values()), sorted(clean)
