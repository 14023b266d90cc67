"""Format detection and normalization of chat and preference data."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest

from llmflow.tasks.posttrain.formats import (
    load_preference_pairs,
    load_sft_examples,
    normalize_preference,
    normalize_sft,
    parse_transcript,
    read_records,
)

EXPECTED = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
]


@pytest.mark.parametrize(
    "record",
    [
        {"messages": EXPECTED},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
        {"prompt": "Hi", "completion": "Hello!"},
        {"prompt": [EXPECTED[0]], "completion": [EXPECTED[1]]},
        {"instruction": "Hi", "input": "", "output": "Hello!"},
    ],
)
def test_sft_formats_normalize_to_messages(record):
    assert normalize_sft(record) == {"messages": EXPECTED}


def test_sft_trailing_user_turn_is_trimmed():
    record = {"messages": EXPECTED + [{"role": "user", "content": "Bye"}]}
    assert normalize_sft(record) == {"messages": EXPECTED}


def test_sft_rejects_are_counted_with_reasons(tmp_path):
    records = [
        {"messages": EXPECTED},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "  "}]},
        {"conversations": [{"from": "robot", "value": "Q"}]},
        {"text": "plain text"},
        {"messages": [{"role": "user"}]},
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    examples, rejects = load_sft_examples(path)
    assert examples == [{"messages": EXPECTED}]
    assert [(r["index"], r["reason"]) for r in rejects] == [
        (1, "no_assistant_turn"),
        (2, "empty_response"),
        (3, "unknown_role"),
        (4, "unknown_format"),
        (5, "malformed"),
    ]


def test_transcript_prompt_is_everything_before_the_final_assistant_turn():
    chosen = "\n\nHuman: What is 2+2?\n\nAssistant: 5?\n\nHuman: Sure?\n\nAssistant: It is 4."
    rejected = "\n\nHuman: What is 2+2?\n\nAssistant: 5?\n\nHuman: Sure?\n\nAssistant: Yes, 5."
    pair = normalize_preference({"chosen": chosen, "rejected": rejected})
    assert pair == {
        "prompt": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "5?"},
            {"role": "user", "content": "Sure?"},
        ],
        "chosen": [{"role": "assistant", "content": "It is 4."}],
        "rejected": [{"role": "assistant", "content": "Yes, 5."}],
    }


def test_explicit_and_implicit_prompt_pairs_agree():
    explicit = normalize_preference({"prompt": "Q", "chosen": "good", "rejected": "bad"})
    implicit = normalize_preference(
        {
            "chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "good"}],
            "rejected": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "bad"}],
        }
    )
    assert explicit == implicit


def test_preference_rejects_are_counted_with_reasons(tmp_path):
    records = [
        {"prompt": "Q", "chosen": "good", "rejected": "bad"},
        {"prompt": "Q", "chosen": "same", "rejected": "same"},
        {"prompt": "Q", "chosen": "", "rejected": "bad"},
        {"chosen": "\n\nHuman: Q\n\nAssistant: a", "rejected": "\n\nHuman: other\n\nAssistant: b"},
        {"chosen": "\n\nHuman: Q\n\nAssistant: a\n\nHuman: more", "rejected": "\n\nHuman: Q"},
        {"chosen": "no transcript", "rejected": "here"},
        {"prompt": "Q", "chosen": "good"},
    ]
    path = tmp_path / "pairs.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in records))
    pairs, rejects = load_preference_pairs(path)
    assert len(pairs) == 1
    assert [(r["index"], r["reason"]) for r in rejects] == [
        (1, "chosen_equals_rejected"),
        (2, "empty_response"),
        (3, "prompt_mismatch"),
        (4, "no_assistant_turn"),
        (5, "malformed"),
        (6, "unknown_format"),
    ]


def test_parse_transcript_keeps_inner_newlines():
    messages = parse_transcript("\n\nHuman: a\nb\n\nAssistant: 1.\n\n2.")
    assert messages == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "1.\n\n2."},
    ]


def test_read_records_json_list_and_jsonl_agree(tmp_path):
    records = [{"a": 1}, {"a": 2}]
    (tmp_path / "x.json").write_text(json.dumps(records))
    (tmp_path / "x.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert read_records(tmp_path / "x.json") == read_records(tmp_path / "x.jsonl") == records


def test_real_sharegpt_file_loads(shared_data):
    examples, rejects = load_sft_examples(shared_data / "sft" / "fastchat_dummy_conversation.json")
    assert len(examples) + len(rejects) == 500
    assert len(examples) > 450
    first = examples[0]["messages"]
    assert first[0] == {"role": "user", "content": "Who are you?"}
    assert first[1]["role"] == "assistant" and first[1]["content"].startswith("I am Vicuna")


def test_real_hh_rlhf_file_loads(shared_data):
    pairs, rejects = load_preference_pairs(
        shared_data / "dpo" / "hh_rlhf_harmless_base_test.jsonl.gz"
    )
    assert len(pairs) + len(rejects) == 2312
    assert len(pairs) > 2250
    reasons = Counter(r["reason"] for r in rejects)
    assert set(reasons) <= {"empty_response", "prompt_mismatch", "chosen_equals_rejected"}
    for pair in pairs[:50]:
        assert pair["prompt"][-1]["role"] == "user"
        assert pair["chosen"] != pair["rejected"]
