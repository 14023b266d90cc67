"""A real Prefect server: the shipped alert automation turns a planted alert into a webhook call.

The alert goes the way a training stage's does: a row in a stage's events.jsonl, sent as an event
by ``forward_alerts`` from a separate process (the stage task's), over the server's websocket;
the automation of deployments/automations.yaml (registered as ``llmflow serve`` does) calls the
Custom Webhook block, whose URL is a tiny HTTP server in this test.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from .servers import REPO, PrefectServer, free_port, wait_until

pytestmark = pytest.mark.integration
NOTIFY_TIMEOUT_S = 45
PLANT = """
import sys
from pathlib import Path
from prefect.events.worker import EventsWorker
from llmflow.tasks.pretrain.alert_events import forward_alerts
from llmflow.tasks.pretrain.alerts import record_alert

out = Path(sys.argv[1])
with forward_alerts(out, run="it-run", poll_s=0.2):
    record_alert(out, "throughput", 40, "quickstart-stage1",
                 "tokens/s fell to 0.10x the median of the last 8 rows", cause="data wait")
EventsWorker.drain_all()
"""


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[dict]]]:
    """A webhook receiver on 127.0.0.1: its URL and the JSON bodies POSTed to it."""
    received: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            length = int(self.headers.get("Content-Length") or 0)
            received.append(json.loads(self.rfile.read(length) or b"{}"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:  # quiet
            pass

    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/alerts", received
    finally:
        server.shutdown()
        server.server_close()


def test_the_shipped_automation_notifies_a_webhook_of_a_planted_alert(
    prefect_server: PrefectServer, receiver, tmp_path
):
    from prefect.automations import Automation

    from llmflow.flows.automations import ALERT_BLOCK, register_automations, save_webhook_block

    url, received = receiver
    started = time.monotonic()
    assert register_automations() == [], "registered without its notification block"
    save_webhook_block(url)
    (automation_id,) = register_automations()
    assert register_automations() == [automation_id]  # again: updated by name, not duplicated
    automation = Automation.read(id=automation_id)
    assert automation.trigger.expect == {"llmflow.alert.*"}
    assert automation.actions[0].type == "send-notification"

    plant = subprocess.run(
        [sys.executable, "-c", PLANT, str(tmp_path / "stage")],
        cwd=REPO,
        env=prefect_server.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plant.returncode == 0, plant.stdout[-3000:] + plant.stderr[-3000:]
    assert (tmp_path / "stage" / "alerts_emitted.jsonl").exists()

    wait_until(lambda: received, NOTIFY_TIMEOUT_S, "the webhook notification", interval_s=0.5)
    (notification,) = received
    assert notification["subject"] == "llmflow alert [throughput] quickstart-stage1 step 40"
    body = notification["body"]
    assert "stage quickstart-stage1 step 40: tokens/s fell to 0.10x the median" in body
    assert "cause: data wait" in body and "run: it-run" in body
    assert "llmflow.alert.throughput" in body
    print(f"alert to notification: {time.monotonic() - started:.1f} s (block {ALERT_BLOCK})")
