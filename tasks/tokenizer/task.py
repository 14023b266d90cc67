"""Prefect task for tokenizer training."""

from llmflow.tasks.framework.prefect_step import step_task
from llmflow.tasks.tokenizer.steps import TOKENIZER_VERSION, tokenizer_step

tokenizer_task = step_task("tokenizer", TOKENIZER_VERSION, tokenizer_step)
