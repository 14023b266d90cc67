"""The curation subflow: per-shard stages fanned out over shards, then global dedup and filters.

The task runner is chosen in config (``runner.kind``): threads (default) or processes locally,
Dask or Ray on a cluster (``pip install llmflow[dask]`` / ``[ray]``).
"""

from __future__ import annotations

from prefect import flow

import llmflow.flows  # noqa: F401
from llmflow.tasks.curation.config import CurateConfig
from llmflow.tasks.curation.steps import stage
from llmflow.tasks.curation.task import (
    exact_dedup_task,
    exact_hashes_task,
    filter_task,
    finalize_task,
    list_shards_task,
    minhash_task,
    near_dedup_task,
    normalize_task,
    quality_model_task,
)
from llmflow.tasks.framework.store import StepResult


def _map(task, cfg: CurateConfig, name: str, per_shard: dict[str, dict], root: str, label: str):
    """Submit ``task`` once per shard (inputs per shard) and wait for all of them."""
    futures = {
        shard: task.submit(
            stage(cfg, name, shard), inputs=inputs, root=root, name=f"{label}-{shard}"
        )
        for shard, inputs in per_shard.items()
    }
    return {shard: future.result() for shard, future in futures.items()}


@flow(name="curate", log_prints=True)
def curate_flow(config: CurateConfig, ingest_uri: str, root: str, name: str) -> list[StepResult]:
    """Curate one ingested corpus; returns every stage's result, the curated corpus last."""
    common = {"root": root, "name": name}
    shards = list_shards_task(ingest_uri, root)
    normalized = _map(
        normalize_task, config, "normalize", {s: {"ingest": ingest_uri} for s in shards}, root, name
    )
    per_norm = {s: {"normalized": r.uri} for s, r in normalized.items()}
    filtered = _map(filter_task, config, "filter", per_norm, root, name)
    hashes = _map(exact_hashes_task, config, "exact_hashes", per_norm, root, name)
    signatures = _map(minhash_task, config, "minhash_signatures", per_norm, root, name)
    kept = [r.uri for r in filtered.values()]
    exact = exact_dedup_task(
        stage(config, "exact_dedup"),
        inputs={"hashes": [r.uri for r in hashes.values()], "filtered": kept},
        **common,
    )
    near = near_dedup_task(
        stage(config, "near_dedup"),
        inputs={
            "signatures": [r.uri for r in signatures.values()],
            "filtered": kept,
            "exact": exact.uri,
        },
        **common,
    )
    quality = quality_model_task(
        stage(config, "quality_model"),
        inputs={"filtered": kept, "exact": exact.uri, "near": near.uri},
        **common,
    )
    curated = finalize_task(
        stage(config, "finalize"),
        inputs={
            "normalized": [r.uri for r in normalized.values()],
            "filtered": kept,
            "exact": exact.uri,
            "near": near.uri,
            "quality": quality.uri,
        },
        **common,
    )
    stages = [*normalized.values(), *filtered.values(), *hashes.values(), *signatures.values()]
    return [*stages, exact, near, quality, curated]
