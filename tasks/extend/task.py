"""Prefect task for the long-context evaluation (extension stages run as pretrain tasks)."""

from llmflow.tasks.extend.steps import LONGCTX_VERSION, longctx_step
from llmflow.tasks.framework.prefect_step import step_task

longctx_task = step_task("longctx", LONGCTX_VERSION, longctx_step)
