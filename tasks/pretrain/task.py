"""Prefect task for a pretraining stage (the trainer runs in its own process)."""

from llmflow.tasks.framework.prefect_step import step_task
from llmflow.tasks.pretrain.steps import PRETRAIN_VERSION, pretrain_step

pretrain_task = step_task("pretrain", PRETRAIN_VERSION, pretrain_step, tags=("gpu",))
