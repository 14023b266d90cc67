"""Prefect tasks for the curation stages."""

from prefect import task

from llmflow.tasks.curation import steps
from llmflow.tasks.framework.prefect_step import step_task

V = steps.CURATE_VERSION
normalize_task = step_task("curate-normalize", V, steps.normalize_step)
filter_task = step_task("curate-filter", V, steps.filter_step)
exact_hashes_task = step_task("curate-exact-hashes", V, steps.exact_hashes_step)
minhash_task = step_task("curate-minhash", V, steps.minhash_step)
exact_dedup_task = step_task("curate-exact-dedup", V, steps.exact_dedup_step)
near_dedup_task = step_task("curate-near-dedup", V, steps.near_dedup_step)
quality_model_task = step_task("curate-quality-model", V, steps.quality_model_step)
finalize_task = step_task("curate", V, steps.finalize_step)


@task(name="list-shards", retries=2, retry_delay_seconds=2)
def list_shards_task(ingest_uri: str, root: str) -> list[str]:
    """The ingested shard names (reads the input's listing through the store)."""
    from llmflow.tasks.framework.store import Store

    return steps.shard_names(Store(root).local_path(ingest_uri))
