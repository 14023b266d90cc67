"""Prefect tasks for SFT and DPO."""

from llmflow.tasks.framework.prefect_step import step_task
from llmflow.tasks.posttrain.steps import DPO_VERSION, SFT_VERSION, dpo_step, sft_step

sft_task = step_task("sft", SFT_VERSION, sft_step, tags=("gpu",))
dpo_task = step_task("dpo", DPO_VERSION, dpo_step, tags=("gpu",))
