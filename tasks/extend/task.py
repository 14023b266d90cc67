"""Prefect task for the long-context evaluation (extension stages run as pretrain tasks)."""

from tasks.extend.steps import LONGCTX_VERSION, longctx_step
from tasks.prefect_step import step_task

longctx_task = step_task("longctx", LONGCTX_VERSION, longctx_step)
