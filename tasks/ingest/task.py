"""Prefect tasks for sample generation and ingest."""

from prefect import task

from tasks.ingest.steps import (
    INGEST_VERSION,
    SAMPLE_VERSION,
    describe_sources,
    ingest_step,
    sample_step,
)
from tasks.prefect_step import step_task

sample_task = step_task("sample", SAMPLE_VERSION, sample_step)
ingest_task = step_task("ingest", INGEST_VERSION, ingest_step, tags=("io",))
describe_sources_task = task(
    describe_sources, name="hash-sources", retries=2, retry_delay_seconds=2
)
