"""Prefect tasks for export, evaluation and the leaderboard."""

from llmflow.tasks.evaluation import steps
from llmflow.tasks.framework.prefect_step import step_task

export_task = step_task("export", steps.EXPORT_VERSION, steps.export_step)
evaluate_task = step_task("evaluate", steps.EVALUATE_VERSION, steps.evaluate_step, tags=("gpu",))
leaderboard_task = step_task("leaderboard", steps.LEADERBOARD_VERSION, steps.leaderboard_step)
