"""Retry settings of every S3 client: botocore's own retries, configured once, in one place.

Every ``s3://`` access (the store, raw data and its lineage records, eval sets, lineage walks,
post-training data) gets its filesystem from ``filesystem(url)``; no other module builds one, so
none talks to S3 with botocore's defaults (``tests/tasks/framework/test_s3_clients.py``).

Object stores throttle (503 SlowDown) and drop connections under load. botocore already knows
which errors are transient and retries them with backoff; it only needs room to do so. Its default
(legacy mode, 5 attempts) gives up within seconds of a throttling burst. ``filesystem`` asks for
``adaptive`` mode (standard retries plus a client-side rate limiter that slows down after a
throttle) with 10 attempts per request, unless ``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS`` say
otherwise, as botocore documents them. s3fs retries a request that still fails on top of that
(``S3FileSystem.retries``, 5). Every request llmflow makes is idempotent (a whole object, one
part of a multipart upload, a listing), so a retried request never duplicates data.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

RETRY_MODE = "adaptive"
MAX_ATTEMPTS = 10
S3_PROTOCOLS = ("s3", "s3a")


def retry_config() -> dict[str, Any]:
    """botocore's ``Config(retries=...)``: the environment's AWS_RETRY_MODE/AWS_MAX_ATTEMPTS win."""
    return {
        "mode": os.environ.get("AWS_RETRY_MODE") or RETRY_MODE,
        # NOTE: Config's "max_attempts" counts retries; "total_max_attempts" counts the first
        # try too, as AWS_MAX_ATTEMPTS does.
        "total_max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or MAX_ATTEMPTS),
    }


def storage_options(url: str) -> dict[str, Any]:
    """fsspec keyword arguments for the filesystem of ``url`` (none unless it is on S3)."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol not in S3_PROTOCOLS:
        return {}
    return {"config_kwargs": {"retries": retry_config()}}


def filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem of ``url`` and the path within it, with the retry settings above
    when it is on S3: the one way llmflow opens a filesystem for a URI or a local path."""
    import fsspec

    return fsspec.core.url_to_fs(url, **storage_options(url))
