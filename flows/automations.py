"""Register the Prefect automations of ``deployments/automations.yaml`` (alert notifications).

Each entry is an automation in the shape ``prefect automation create --from-file`` reads, except
that a notification action names its block (``block: llmflow-alerts``) instead of giving the
block's id, which differs on every server. :func:`register_automations` looks the name up,
creates each automation or updates the one of the same name, and returns their ids.
``llmflow serve`` calls it; after ``prefect deploy``, run ``python -m llmflow.flows.automations``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml

from llmflow.tasks.framework.resources import data_dir

AUTOMATIONS_FILE = data_dir("deployments") / "automations.yaml"
ALERT_BLOCK = "llmflow-alerts"  # the notification block the shipped automation sends through

log = logging.getLogger("llmflow.automations")


def automation_specs(path: Path = AUTOMATIONS_FILE) -> list[dict[str, Any]]:
    """The ``automations`` entries of an automations file, as written (blocks by name)."""
    return yaml.safe_load(Path(path).read_text())["automations"]


def save_webhook_block(url: str, name: str = ALERT_BLOCK) -> UUID:
    """Save a Custom Webhook notification block that POSTs ``{"subject", "body"}`` as JSON to
    ``url`` (replacing a block of that name); its id."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = CustomWebhookNotificationBlock(
        name=name, url=url, json_data={"subject": "{{subject}}", "body": "{{body}}"}
    )
    return block.save(name, overwrite=True)


def register_automations(path: Path = AUTOMATIONS_FILE) -> list[UUID]:
    """Create (or update, by name) each automation of ``path`` on the configured Prefect API.

    Returns:
        The automations' ids; none when a block they name does not exist (said in a warning:
        the alerts are still events, log lines and rows of the stage's events.jsonl).
    """
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    specs = automation_specs(path)
    with get_client(sync_client=True) as client:
        blocks = _notification_blocks(client)
        missing = sorted(
            {a["block"] for s in specs for a in s["actions"] if "block" in a} - set(blocks)
        )
        if missing:
            log.warning(
                "automations in %s not registered: no notification block named %s (create one: "
                "a Custom Webhook or Slack Webhook block, or python -m llmflow.flows.automations "
                "--webhook URL)", path, ", ".join(missing),
            )  # fmt: skip
            return []
        ids = []
        for spec in specs:
            automation = AutomationCore.model_validate(_with_block_ids(spec, blocks))
            existing = client.read_automations_by_name(automation.name)
            if existing:
                client.update_automation(existing[0].id, automation)
                ids.append(existing[0].id)
            else:
                ids.append(client.create_automation(automation))
            log.info("automation %r registered (%s)", automation.name, ids[-1])
    return ids


def _notification_blocks(client: Any) -> dict[str, UUID]:
    """The ids of the notification blocks on the server, by name (the first of a name)."""
    found: dict[str, UUID] = {}
    for document in client.read_block_documents(include_secrets=False):
        capabilities = getattr(document.block_schema, "capabilities", None) or []
        if document.name and "notify" in capabilities:
            found.setdefault(document.name, document.id)
    return found


def _with_block_ids(spec: dict[str, Any], blocks: dict[str, UUID]) -> dict[str, Any]:
    """The automation with each action's ``block: NAME`` replaced by its ``block_document_id``."""
    actions = []
    for action in spec["actions"]:
        action = dict(action)
        if "block" in action:
            action["block_document_id"] = str(blocks[action.pop("block")])
        actions.append(action)
    return {**spec, "actions": actions}


def main(argv: list[str] | None = None) -> int:
    """``python -m llmflow.flows.automations [--webhook URL] [--file PATH]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--file", type=Path, default=AUTOMATIONS_FILE, help="automations YAML")
    parser.add_argument(
        "--webhook", help=f"save a Custom Webhook block {ALERT_BLOCK!r} posting to this URL first"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.webhook:
        save_webhook_block(args.webhook)
    return 0 if register_automations(args.file) else 1


if __name__ == "__main__":
    raise SystemExit(main())
