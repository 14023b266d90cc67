"""record_alert: the shared alert row and log line."""

from __future__ import annotations

import json
import logging

import pytest

from llmflow.tasks.pretrain.alerts import read_alerts, record_alert


def test_record_alert_row_and_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="llmflow.alert"):
        row = record_alert(tmp_path, "stall", 7, "pretrain-x", "batch waited 3.0s", "data wait",
                           {"waited_s": 3.0}, extra={"policy": "skip", "event": "guard"})  # fmt: skip
    written = json.loads((tmp_path / "events.jsonl").read_text())
    assert written == row
    assert set(row) == {"event", "kind", "step", "stage", "message", "cause", "details", "time",
                        "policy"}  # fmt: skip
    assert (row["event"], row["kind"], row["step"], row["stage"]) == ("alert", "stall", 7,
                                                                       "pretrain-x")  # fmt: skip
    assert row["details"] == {"waited_s": 3.0} and row["cause"] == "data wait"
    assert "llmflow alert [stall] stage pretrain-x step 7: batch waited 3.0s" in caplog.text
    assert read_alerts(tmp_path) == [row]
    with pytest.raises(ValueError, match="kind"):
        record_alert(tmp_path, "oops", 1, "s", "m")
