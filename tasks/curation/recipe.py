"""The curate step as a part of the recipe: its stages, each a declared step, added to a graph.

Per-shard stages map over shards; global ones take every shard's output:

1. `normalize_shard`     ``curate-normalize``      per ingested shard   -> normalized shard
2. `filter_shards`       ``curate-filter``         per normalized shard -> filtered shard (+ PII)
3. `exact_hashes`        ``curate-exact-hashes``   per normalized shard -> document hashes
4. `minhash_signatures`  ``curate-minhash``        per normalized shard -> LSH band keys
5. `exact_dedup`         ``curate-exact-dedup``    hashes (+ filtered alive) -> drops
6. `near_dedup`          ``curate-near-dedup``     band keys (+ alive, - exact drops) -> drops
7. `quality_model`       ``curate-quality-model``  filtered (- dedup drops) -> drops, classifier
8. `finalize`            ``curate``                filtered + drops -> per-domain shards, report

Each step's config holds only what it reads, so its hash is exactly its dependencies: hashes
and signatures read normalized shards and their own few fields, so changing a filter threshold
or the near-dup keeper re-runs the filter step and the global ones, never those.
"""

from __future__ import annotations

from llmflow.tasks.curation.config import CorpusConfig, CurateConfig
from llmflow.tasks.curation.exact_dedup import exact_dedup, exact_hashes
from llmflow.tasks.curation.finalize import finalize
from llmflow.tasks.curation.heuristics import filter_shards
from llmflow.tasks.curation.minhash import minhash_signatures, near_dedup
from llmflow.tasks.curation.normalize import normalize_shard
from llmflow.tasks.curation.quality_model import quality_model
from llmflow.tasks.framework.graph import Existing, Graph, Node


def add_curation(
    graph: Graph, cfg: CurateConfig, ingested: Node | Existing, name: str, phase: str = "curate"
) -> Node:
    """Add every curation stage to ``graph``; return the final ``curate`` node.

    Args:
        graph: The recipe to extend.
        cfg: The curate config; each stage gets the part of it that it reads.
        ingested: The ingest output (``shards/*.parquet``), a node or a committed output.
        name: The output label of every stage (mapped stages add the shard's name).
        phase: The phase of every stage (what ``Graph.until`` cuts at).

    Returns:
        The ``curate`` node, whose output holds ``shards/<domain>/*.parquet``,
        ``curation_report.json`` and ``summary.md``.
    """

    def add(step, config, map_over=None, **inputs) -> Node:
        return graph.add(step, config, name, phase=phase, map_over=map_over, **inputs)

    normalized = add(normalize_shard, cfg.normalize, "shard", shard=ingested)
    per_shard = {"map_over": "normalized", "normalized": normalized}
    filtered = add(filter_shards, cfg.filter_config(), **per_shard)
    hashes = add(exact_hashes, cfg.exact_dedup.hash_config(), **per_shard)
    signatures = add(minhash_signatures, cfg.minhash.signature_config(), **per_shard)
    exact = add(exact_dedup, cfg.exact_dedup, hashes=hashes, filtered=filtered)
    near = add(near_dedup, cfg.minhash, signatures=signatures, filtered=filtered, exact=exact)
    quality = add(quality_model, cfg.quality_model, filtered=filtered, exact=exact, near=near)
    return add(
        finalize,
        CorpusConfig(),
        normalized=normalized,
        filtered=filtered,
        exact=exact,
        near=near,
        quality=quality,
    )
