"""Prefect tasks for sample generation and ingest."""

from prefect import task

from llmflow.tasks.framework.prefect_step import step_task
from llmflow.tasks.ingest.steps import (
    INGEST_VERSION,
    SAMPLE_VERSION,
    describe_sources,
    ingest_step,
    sample_step,
)

sample_task = step_task("sample", SAMPLE_VERSION, sample_step)
ingest_task = step_task("ingest", INGEST_VERSION, ingest_step, tags=("io",))
describe_sources_task = task(
    describe_sources, name="hash-sources", retries=2, retry_delay_seconds=2
)
