"""Curate step: normalize, heuristic filters + PII, exact and MinHash dedup, model-based quality
filter, per-domain output and report. Each stage is a declared step; `recipe.add_curation` adds
them all to a graph."""
