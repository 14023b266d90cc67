"""Curate step: normalize, heuristic filters + PII, exact and MinHash dedup, model-based quality
filter, per-domain output and report. Stage functions live in `tasks.curation.pipeline`."""
