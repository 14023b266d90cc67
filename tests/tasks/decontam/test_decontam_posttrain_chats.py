"""Post-training decontamination finds short eval items in chats: a PIQA goal as the user's
message and its gold solution as the assistant's (each under 13 words), matched across the turn
boundary as the item reads, whether the pair makes a 13-gram or is matched whole (8-12 words);
an item inside one message; and not a chat that only shares common words with the items.

The items are real PIQA validation items (``../shared/data/eval``), picked by their raw fields'
word counts; their positions are fixed here so the test does not go through the code it tests.
"""

from __future__ import annotations

import json

from llmflow.tasks.decontam.config import DecontamConfig
from llmflow.tasks.decontam.ngrams import words
from llmflow.tasks.decontam.posttrain import (
    EXAMPLES_FILE,
    PostTrainDecontConfig,
    decontaminate_posttrain,
)
from llmflow.tasks.framework.step import RawFiles
from llmflow.tasks.posttrain.formats import write_jsonl
from tests.needs import shared_path

PIQA_FILES = ("piqa_valid.jsonl", "piqa_valid_labels.lst")
OVERLAP = 5  # "Remove soap scum from shower door." + 7 words: 13, one n-gram across the turns
WHOLE = 24  # "Make a bulletin board." + 7 words: 11, matched whole
INSIDE = 52  # "Kill fruit flies easily." + 6 words: 10, matched whole inside one message


def piqa_item(index: int) -> tuple[str, str]:
    """PIQA item ``index``: its goal and its gold solution, read from the raw files."""
    eval_dir = shared_path("eval")
    rows = (eval_dir / PIQA_FILES[0]).read_text().splitlines()
    label = int((eval_dir / PIQA_FILES[1]).read_text().split()[index])
    row = json.loads(rows[index])
    return row["goal"], (row["sol1"], row["sol2"])[label]


def chat(*turns: str) -> dict:
    roles = ("user", "assistant")
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


def check(tmp_path, kind: str, records: list) -> dict[str, list]:
    """The step run on ``records`` against PIQA: matched records by position, with their items."""
    eval_dir = shared_path("eval")
    data = tmp_path / f"{kind}.jsonl"
    write_jsonl(data, records)
    decont = DecontamConfig(tasks=["piqa_local"], mode="remove")
    cfg = PostTrainDecontConfig(kind=kind, data=str(data), decontam=decont)
    out = tmp_path / "check"
    out.mkdir()
    files = RawFiles([str(eval_dir / name) for name in PIQA_FILES])
    decontaminate_posttrain(cfg, out, RawFiles([str(data)]), files)
    return json.loads((out / EXAMPLES_FILE).read_text())["records"]


def test_the_items_are_as_short_as_the_test_says():
    for index, (goal, answer) in {OVERLAP: (6, 7), WHOLE: (4, 7), INSIDE: (4, 6)}.items():
        assert (len(words(piqa_item(index)[0])), len(words(piqa_item(index)[1]))) == (goal, answer)


def test_a_short_question_and_answer_in_two_turns_are_found(tmp_path):
    overlap, whole, inside = piqa_item(OVERLAP), piqa_item(WHOLE), piqa_item(INSIDE)
    records = [
        chat(*overlap),
        chat(*whole),
        chat("Any pantry tips?", f"Sure. {inside[0]} {inside[1]} It works every time."),
        # common words of the items, none of their runs: clean
        chat("How do I make the kitchen door smell nice?", "Add a little bit of soap."),
        chat("Hello!", "Hi, how can I help?", *whole),  # a later turn of a longer chat
    ]
    found = check(tmp_path, "sft", records)
    assert found == {
        "0": [["piqa_local", OVERLAP]],
        "1": [["piqa_local", WHOLE]],
        "2": [["piqa_local", INSIDE]],
        "4": [["piqa_local", WHOLE]],
    }


def test_preference_pairs_match_the_prompt_with_each_reply(tmp_path):
    overlap, whole = piqa_item(OVERLAP), piqa_item(WHOLE)
    records = [
        {"prompt": overlap[0], "chosen": overlap[1], "rejected": "Use a wire brush."},
        {"prompt": whole[0], "chosen": "Buy one at a shop.", "rejected": whole[1]},
        # an hh-rlhf transcript pair: the item is the prompt and the chosen reply
        {
            "chosen": f"\n\nHuman: {whole[0]}\n\nAssistant: {whole[1]}",
            "rejected": "\n\nHuman: " + whole[0] + "\n\nAssistant: No idea.",
        },
        # the question and the answer never read one after the other: clean
        {"prompt": "Tell me a joke.", "chosen": whole[0], "rejected": whole[1]},
    ]
    found = check(tmp_path, "dpo", records)
    assert found == {
        "0": [["piqa_local", OVERLAP]],
        "1": [["piqa_local", WHOLE]],
        "2": [["piqa_local", WHOLE]],
    }


def test_grpo_prompts_match_with_their_reference_answer(tmp_path):
    overlap, whole = piqa_item(OVERLAP), piqa_item(WHOLE)
    records = [
        {"prompt": [{"role": "user", "content": whole[0]}], "answer": whole[1]},
        {"question": overlap[0], "answer": overlap[1]},
        {"prompt": "What is 2 + 3?", "answer": "5"},
    ]
    found = check(tmp_path, "grpo", records)
    assert found == {"0": [["piqa_local", WHOLE]], "1": [["piqa_local", OVERLAP]]}
