"""Chat and preference data in the formats people have, normalized to conversational messages.

SFT examples become ``{"messages": [{"role", "content"}, ...]}`` from any of:

- ``messages``: a list of ``{role, content}`` (OpenAI / TRL conversational);
- ``conversations``: ShareGPT ``{from, value}`` turns (``human``/``gpt``/``system``);
- ``prompt`` + ``completion``: strings or message lists;
- ``instruction`` (+ ``input``) + ``output``: Alpaca.

Preference pairs become ``{"prompt": [messages], "chosen": [assistant], "rejected": [assistant]}``
from explicit ``prompt``/``chosen``/``rejected`` (strings or messages), implicit-prompt message
lists, or Anthropic hh-rlhf transcripts (``\\n\\nHuman: ...\\n\\nAssistant: ...``), whose prompt
is everything up to the final assistant turn.

Records that cannot be used are returned as rejects, ``{"index", "reason", "detail"}``, never
silently dropped.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

Message = dict[str, str]
Record = dict[str, Any]

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names seen in the wild (FastChat, Vicuna, OpenHermes).
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}
TRANSCRIPT_TURN = re.compile(r"\n\n(Human|Assistant):")
TRANSCRIPT_ROLES = {"Human": "user", "Assistant": "assistant"}


class RecordError(ValueError):
    """A record that cannot be used; ``reason`` is the short tag written to rejects.jsonl."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def read_records(path: Path) -> list[Record]:
    """Read a JSON list or JSON Lines file, optionally gzip-compressed (``.gz``).

    Args:
        path: A ``.json``, ``.jsonl`` (or ``.json.gz`` / ``.jsonl.gz``) file.

    Returns:
        The records, in file order.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        return json.loads(stripped)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _message(raw: Any, role_key: str = "role", content_key: str = "content") -> Message:
    if not isinstance(raw, dict) or role_key not in raw or content_key not in raw:
        raise RecordError("malformed", f"turn {str(raw)[:80]!r} lacks {role_key!r}/{content_key!r}")
    content = raw[content_key]
    if not isinstance(content, str):
        raise RecordError("malformed", f"content is {type(content).__name__}, not a string")
    return {"role": str(raw[role_key]), "content": content}


def _messages(raw: Any) -> list[Message]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise RecordError("malformed", f"expected a list of messages, got {type(raw).__name__}")
    messages = [_message(m) for m in raw]
    for m in messages:
        if m["role"] not in ROLES:
            raise RecordError("unknown_role", m["role"])
    return messages


def _sharegpt(turns: Any) -> list[Message]:
    if not isinstance(turns, list):
        raise RecordError("malformed", "'conversations' is not a list")
    messages = []
    for turn in turns:
        m = _message(turn, "from", "value")
        if m["role"].lower() not in SHAREGPT_ROLES:
            raise RecordError("unknown_role", m["role"])
        messages.append({"role": SHAREGPT_ROLES[m["role"].lower()], "content": m["content"]})
    return messages


def _as_response(raw: Any) -> list[Message]:
    """A completion/chosen/rejected field as assistant messages."""
    if isinstance(raw, str):
        return [{"role": "assistant", "content": raw}]
    return _messages(raw)


def _check_conversation(messages: list[Message]) -> list[Message]:
    """Trim trailing non-assistant turns; require a non-empty assistant turn."""
    while messages and messages[-1]["role"] != "assistant":
        messages = messages[:-1]
    if not messages:
        raise RecordError("no_assistant_turn")
    for m in messages:
        if m["role"] == "assistant" and not m["content"].strip():
            raise RecordError("empty_response")
    return messages


def normalize_sft(record: Record) -> Record:
    """One SFT record in any supported format as ``{"messages": [...]}``.

    Raises:
        RecordError: the record has no usable assistant turn or is malformed.
    """
    if not isinstance(record, dict):
        raise RecordError("malformed", f"record is {type(record).__name__}, not an object")
    if "messages" in record:
        messages = _messages(record["messages"])
    elif "conversations" in record:
        messages = _sharegpt(record["conversations"])
    elif "prompt" in record and "completion" in record:
        messages = _messages(record["prompt"]) + _as_response(record["completion"])
    elif "instruction" in record and "output" in record:
        user = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        messages = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": record["output"]},
        ]
    else:
        raise RecordError("unknown_format", f"keys {sorted(record)}")
    return {"messages": _check_conversation(messages)}


def parse_transcript(text: str) -> list[Message]:
    """An Anthropic hh-rlhf transcript (``\\n\\nHuman: ...\\n\\nAssistant: ...``) as messages."""
    parts = TRANSCRIPT_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise RecordError("malformed", "not a '\\n\\nHuman: ... \\n\\nAssistant: ...' transcript")
    speakers, contents = parts[1::2], parts[2::2]
    return [
        {"role": TRANSCRIPT_ROLES[s], "content": c.strip()}
        for s, c in zip(speakers, contents, strict=True)
    ]


def _split_final_turn(messages: list[Message]) -> tuple[list[Message], Message]:
    if not messages or messages[-1]["role"] != "assistant":
        raise RecordError(
            "no_assistant_turn", "the conversation does not end with an assistant turn"
        )
    return messages[:-1], messages[-1]


def _implicit_prompt(
    chosen: Any, rejected: Any
) -> tuple[list[Message], list[Message], list[Message]]:
    """Split two full conversations into the shared prompt and their final assistant turns."""
    if isinstance(chosen, str) and isinstance(rejected, str):
        chosen, rejected = parse_transcript(chosen), parse_transcript(rejected)
    else:
        chosen, rejected = _messages(chosen), _messages(rejected)
    prompt, chosen_turn = _split_final_turn(chosen)
    rejected_prompt, rejected_turn = _split_final_turn(rejected)
    if prompt != rejected_prompt:
        raise RecordError("prompt_mismatch", "chosen and rejected differ before the final turn")
    return prompt, [chosen_turn], [rejected_turn]


def normalize_preference(record: Record) -> Record:
    """One preference record as ``{"prompt": [...], "chosen": [...], "rejected": [...]}``.

    Raises:
        RecordError: empty responses, identical responses, no prompt, or malformed input.
    """
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        raise RecordError("unknown_format", "a preference record needs 'chosen' and 'rejected'")
    if "prompt" in record:
        prompt = _messages(record["prompt"])
        chosen, rejected = _as_response(record["chosen"]), _as_response(record["rejected"])
    else:
        prompt, chosen, rejected = _implicit_prompt(record["chosen"], record["rejected"])
    if not any(m["role"] == "user" for m in prompt):
        raise RecordError("no_prompt", "the prompt has no user turn")
    for response in (chosen, rejected):
        if not response or any(m["role"] != "assistant" for m in response):
            raise RecordError("no_assistant_turn", "responses must be assistant turns")
        if not "".join(m["content"] for m in response).strip():
            raise RecordError("empty_response")
    if chosen == rejected:
        raise RecordError("chosen_equals_rejected")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def normalize_records(
    records: list[Record], normalize: Callable[[Record], Record]
) -> tuple[list[Record], list[int], list[Record]]:
    """Normalize every record; keep each survivor's position in the source for later rejects.

    Returns:
        ``(kept, kept_indices, rejects)``; ``kept_indices[i]`` is ``kept[i]``'s source position.
    """
    kept, kept_indices, rejects = [], [], []
    for index, record in enumerate(records):
        try:
            kept.append(normalize(record))
            kept_indices.append(index)
        except RecordError as error:
            rejects.append({"index": index, "reason": error.reason, "detail": error.detail})
    return kept, kept_indices, rejects


def load_sft_examples(path: Path) -> tuple[list[Record], list[Record]]:
    """Load SFT examples from a file, format detected per record.

    Args:
        path: JSON list or JSON Lines file (``.gz`` allowed).

    Returns:
        ``(examples, rejects)``: examples as ``{"messages": [...]}``; rejects as
        ``{"index", "reason", "detail"}`` with ``index`` the record's position in the file.
    """
    examples, _, rejects = normalize_records(read_records(path), normalize_sft)
    return examples, rejects


def load_preference_pairs(path: Path) -> tuple[list[Record], list[Record]]:
    """Load preference pairs from a file, format detected per record.

    Args:
        path: JSON list or JSON Lines file (``.gz`` allowed).

    Returns:
        ``(pairs, rejects)``: pairs as conversational ``{"prompt", "chosen", "rejected"}``;
        rejects as ``{"index", "reason", "detail"}``.
    """
    pairs, _, rejects = normalize_records(read_records(path), normalize_preference)
    return pairs, rejects


def write_jsonl(path: Path, records: list[Record]) -> None:
    """Write records as JSON Lines (UTF-8, one object a line)."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
