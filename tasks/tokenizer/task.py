"""Prefect task for tokenizer training."""

from tasks.prefect_step import step_task
from tasks.tokenizer.steps import TOKENIZER_VERSION, tokenizer_step

tokenizer_task = step_task("tokenizer", TOKENIZER_VERSION, tokenizer_step)
