"""Normalization of bad input (nothing crashes a shard, nothing disappears) and PII scrubbing."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from llmflow.tasks.curation.config import NormalizeConfig, PIIConfig
from llmflow.tasks.curation.normalize import normalize_shard
from llmflow.tasks.curation.pii import scrub_pii
from llmflow.tasks.curation.shards import read_column, read_json, read_jsonl


def _write(path, ids, texts, text_type=None):
    text_type = text_type or pa.string()
    table = pa.table(
        {
            "id": pa.array(ids, pa.string()),
            "text": pa.array(texts, text_type),
            "domain": pa.array(["web"] * len(ids)),
            "source": pa.array(["t"] * len(ids)),
        }
    )
    pq.write_table(table, path)


def test_bad_documents_are_counted_and_rejected_with_reasons(tmp_path):
    ids = ["ok", "empty", "blank", "binary", "long", "oneline", "null", "dup", "ok"]
    texts = [
        "Caf\u0065\u0301  au lait.\r\n",
        "",
        " \n\t \u200b",
        "\x00\x01\x02abc\x03" * 10,
        "x " * 600_000,
        "y" * 200_000,
        None,
        "fine text",
        "again",
    ]
    shard = tmp_path / "shard-00000.parquet"
    _write(shard, ids, texts)
    out = tmp_path / "out"
    out.mkdir()
    metrics = normalize_shard(NormalizeConfig(), shard, out)
    rejects = {r["id"] + ":" + r["reason"] for r in read_jsonl(out / "shard-00000.rejects.jsonl")}
    assert rejects == {
        "empty:empty",
        "blank:whitespace_only",
        "binary:binary",
        "long:too_long",
        "oneline:long_line",
        "null:null",
        "ok:duplicate_id",
    }
    assert metrics == {"documents_in": 9, "documents_out": 2, "rejected": 7}
    assert read_column(out / "shard-00000.parquet", "text") == ["Caf\u00e9 au lait.", "fine text"]
    stats = read_json(out / "shard-00000.stats.json")
    assert stats["domains"]["web"]["in"]["docs"] == 9
    assert stats["cleaned"] == {"unicode": 1, "whitespace": 1}
    json.dumps(metrics)


def test_non_utf8_bytes_are_cleaned_or_rejected(tmp_path):
    mostly_ok = b"good text " * 200 + b"\xff"
    garbage = bytes(range(128, 256)) * 4
    shard = tmp_path / "shard-00000.parquet"
    _write(shard, ["a", "b"], [mostly_ok, garbage], pa.binary())
    out = tmp_path / "out"
    out.mkdir()
    normalize_shard(NormalizeConfig(), shard, out)
    assert [r["reason"] for r in read_jsonl(out / "shard-00000.rejects.jsonl")] == ["non_utf8"]
    kept = read_column(out / "shard-00000.parquet", "text")
    assert len(kept) == 1 and kept[0].endswith("\ufffd")
    assert read_json(out / "shard-00000.stats.json")["cleaned"] == {"invalid_utf8_replaced": 1}


def test_pii_is_replaced_and_counted():
    text = (
        "Write to jane.doe@example.org or call (555) 123-4567 / +44 20 7946 0958; "
        "server 192.168.0.12 and 2001:db8:0:0:0:0:2:1. In 1999 about 1,234,567 people; v3.2."
    )
    scrubbed, counts = scrub_pii(PIIConfig(), text)
    assert counts == {"email": 1, "ip_address": 2, "phone": 2}
    assert "jane" not in scrubbed and "192.168" not in scrubbed and "7946" not in scrubbed
    assert "1999" in scrubbed and "1,234,567" in scrubbed and "v3.2" in scrubbed
    assert scrubbed.count("<EMAIL>") == 1 and scrubbed.count("<PHONE>") == 2


def test_invalid_ip_is_kept():
    assert scrub_pii(PIIConfig(), "999.10.10.10")[1]["ip_address"] == 0
