"""Prefect tasks for tokenization, mixtures and the validation set."""

from llmflow.tasks.dataprep.steps import (
    MIXTURE_VERSION,
    TOKENIZE_VERSION,
    VALIDATION_VERSION,
    mixture_step,
    tokenize_step,
    validation_step,
)
from llmflow.tasks.framework.prefect_step import step_task

tokenize_task = step_task("tokenize", TOKENIZE_VERSION, tokenize_step)
mixture_task = step_task("mixture", MIXTURE_VERSION, mixture_step)
validation_task = step_task("validation", VALIDATION_VERSION, validation_step)
