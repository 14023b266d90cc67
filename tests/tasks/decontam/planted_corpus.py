"""A training corpus with planted evaluation items, for the decontamination test and benchmark.

Documents, each ``{"id", "text", "domain", "source"}``:

- ``clean-*``: Shakespeare passages (no eval item in them);
- ``exact-<task>-<item>``: an eval item (question and gold answer) copied into clean text;
- ``edited-<task>-<item>``: the same, with small edits: case, punctuation, whitespace, other
  numbers, and (items of at least 2n words) the first word replaced;
- ``near-<task>-<item>``: a clean near miss: the item's words in runs of at most 6, each run
  followed by three Shakespeare words, so it shares only short n-grams with the item.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from llmflow.tasks.decontam.ngrams import Item, words

NEAR_RUN = 6


def clean_passages(text_dir: Path, count: int, words_per_doc: int = 150) -> list[str]:
    """Consecutive Shakespeare passages of about ``words_per_doc`` words."""
    tokens = (Path(text_dir) / "tinyshakespeare.txt").read_text(encoding="utf-8").split(" ")
    return [" ".join(tokens[i * words_per_doc : (i + 1) * words_per_doc]) for i in range(count)]


def eval_items(eval_dir: Path) -> dict[str, list[Item]]:
    """PIQA (goal, gold solution), GSM8K (question, answer), WikiText-2 test paragraphs."""
    eval_dir = Path(eval_dir)
    piqa = [json.loads(x) for x in (eval_dir / "piqa_valid.jsonl").read_text().splitlines()]
    labels = [int(x) for x in (eval_dir / "piqa_valid_labels.lst").read_text().split()]
    gsm8k = [json.loads(x) for x in (eval_dir / "gsm8k_test.jsonl").read_text().splitlines()]
    lines = (eval_dir / "wikitext2_test.txt").read_text(encoding="utf-8").splitlines()
    paragraphs = [line for line in lines if len(line.split()) >= 60]
    return {
        "piqa_local": [
            Item("piqa_local", i, q["goal"], ((q["sol1"], q["sol2"])[y],))
            for i, (q, y) in enumerate(zip(piqa, labels, strict=True))
        ],
        "gsm8k_local": [
            Item("gsm8k_local", i, r["question"], (r["answer"],)) for i, r in enumerate(gsm8k)
        ],
        "wikitext2_local": [
            Item("wikitext2_local", i, None, (p,)) for i, p in enumerate(paragraphs)
        ],
    }


def item_text(item: Item) -> str:
    return f"{item.query}\n{item.golds[0]}" if item.query else item.golds[0]


def indexable(item: Item, n: int) -> bool:
    """An item the n-gram method can see: at least n words of question and answer."""
    return len(words(item_text(item))) >= n and len(words(item.golds[0])) >= 1


def edit(text: str, rng: random.Random, n: int) -> str:
    """Small edits: some words upper-cased, punctuation added, whitespace doubled, numbers
    changed, and, in a long text, its first word replaced."""
    tokens = text.split()
    if len(words(text)) >= 2 * n:
        tokens[0] = "Xylophone"
    out = []
    for token in tokens:
        token = re.sub(r"\d", lambda m: str((int(m.group()) + 3) % 10), token)
        if rng.random() < 0.2:
            token = token.upper()
        if rng.random() < 0.1:
            token += ","
        out.append(token + ("  " if rng.random() < 0.2 else " "))
    return "".join(out).strip()


def near_miss(item: Item, filler: list[str], rng: random.Random) -> str:
    """The item's words in runs of at most ``NEAR_RUN``, each followed by three other words.

    Runs count normalized words: GSM8K's ``<<16-3-4=9>>9`` is one token but five words."""
    tokens = words(item_text(item))
    out = []
    for start in range(0, len(tokens), NEAR_RUN):
        out += tokens[start : start + NEAR_RUN]
        out += rng.sample(filler, 3)
    return " ".join(out)


def planted_corpus(
    eval_dir: Path, text_dir: Path, per_set: int = 40, num_clean: int = 300, n: int = 13, seed=0
) -> tuple[list[dict], dict[str, list[Item]]]:
    """The corpus (clean, exact, edited and near-miss documents, shuffled) and the eval sets."""
    rng = random.Random(seed)
    sets = eval_items(eval_dir)
    clean = clean_passages(text_dir, num_clean + 2 * per_set * len(sets))
    filler = [w for w in " ".join(clean[:50]).split() if w.isalpha() and len(w) > 3]
    docs = [_doc(f"clean-{i}", clean[i]) for i in range(num_clean)]
    wrappers = iter(clean[num_clean:])
    for task, items in sets.items():
        for item in rng.sample([it for it in items if indexable(it, n)], per_set):
            text, key = item_text(item), f"{task}-{item.index}"
            docs.append(_doc(f"exact-{key}", f"{next(wrappers)}\n\n{text}\n\nThe end."))
            docs.append(_doc(f"edited-{key}", f"{edit(text, rng, n)}\n\n{next(wrappers)}"))
            docs.append(_doc(f"near-{key}", near_miss(item, filler, rng)))
    rng.shuffle(docs)
    return docs, sets


def _doc(doc_id: str, text: str) -> dict:
    return {"id": doc_id, "text": text, "domain": "prose", "source": "planted"}


def reference_flags(docs: list[dict], items: list[Item], n: int) -> set[str]:
    """Documents sharing an indexed n-gram with an item, by the plainest code: Python sets of
    word tuples, the windows taken as datatrove's indexer takes them (answer, question→answer)."""
    grams: set[tuple[str, ...]] = set()
    for item in items:
        query = words(item.query) if item.query else None
        for gold in item.golds:
            label = words(gold)
            grams.update(tuple(label[i : i + n]) for i in range(len(label) - n + 1))
            if query is not None:
                grams.update(
                    tuple(query[-n + 1 + i :] + label[: i + 1])
                    for i in range(n - 1)
                    if len(query) >= n - 1 - i and len(label) >= i + 1
                )
    flagged = set()
    for doc in docs:
        tokens = words(doc["text"])
        if any(tuple(tokens[i : i + n]) in grams for i in range(len(tokens) - n + 1)):
            flagged.add(doc["id"])
    return flagged
