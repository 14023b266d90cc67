"""The shipped automations file: valid Prefect automations once its blocks are named by id."""

from __future__ import annotations

import uuid

from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import AutomationCore, EventTrigger

from llmflow.flows.automations import ALERT_BLOCK, _with_block_ids, automation_specs


def test_the_shipped_alert_automation_is_a_valid_prefect_automation():
    block_id = uuid.uuid4()
    (spec,) = automation_specs()
    automation = AutomationCore.model_validate(_with_block_ids(spec, {ALERT_BLOCK: block_id}))
    trigger = automation.trigger
    assert isinstance(trigger, EventTrigger)
    assert trigger.expect == {"llmflow.alert.*"} and trigger.threshold == 1
    assert trigger.match.root == {"prefect.resource.id": "llmflow.stage.*"}
    (action,) = automation.actions
    assert isinstance(action, SendNotification) and action.block_document_id == block_id
    for label in ("kind", "stage", "step", "message", "cause"):
        assert f"event.resource.{label}" in action.body
