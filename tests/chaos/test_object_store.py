"""Faults of the object store (issue 26): moto's S3 server behind a fault-injecting proxy.

Each test runs a step through ``Store`` with the fault, then without it, and asserts that the
committed output is bit-identical to a fault-free run, or that nothing looks complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel

from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.framework.store import COMMIT_MARKER, Store
from tests.chaos.s3_proxy import Request, S3FaultProxy
from tests.integration import servers
from tests.integration.servers import REPO, S3

pytestmark = pytest.mark.slow
BUCKET = "llmflow-chaos"
MULTIPART_BYTES = 101 * 2**20  # s3fs uploads a file of 2 x 50 MiB or more in parts
UNHASHED_FILES = {"lineage.json", COMMIT_MARKER}  # timestamps and run ids, not data


class BlobConfig(BaseModel):
    num_bytes: int = MULTIPART_BYTES
    num_shards: int = 4


@step("chaos-blob")
def blob(cfg: BlobConfig, out: Path) -> Metrics:
    """Seeded random bytes: one large file (a multipart upload) and a few small shards."""
    rng = np.random.default_rng(0)
    (out / "blob.bin").write_bytes(rng.bytes(cfg.num_bytes))
    (out / "shards").mkdir(exist_ok=True)  # a retry finds the last attempt's files
    for i in range(cfg.num_shards):
        (out / "shards" / f"shard-{i:05d}.parquet").write_bytes(rng.bytes(1000 + i))
    return {"num_shards": cfg.num_shards}


class DigestConfig(BaseModel):
    algorithm: str = "sha256"


@step("chaos-digest")
def digest_blob(cfg: DigestConfig, blob: Path, out: Path) -> Metrics:
    """The sha256 of each data file of its input (a step downstream of ``blob``)."""
    (out / "digests.json").write_text(json.dumps(digests(blob), indent=1))
    return {"num_files": len(digests(blob))}


def commit_blob(root: str, num_bytes: int = MULTIPART_BYTES) -> str:
    """Run the blob step through a store at ``root`` (also the entry point of a killed child)."""
    return blob.run(Store(root), BlobConfig(num_bytes=num_bytes), "chaos").uri


def digests(folder: Path) -> dict[str, str]:
    """sha256 of each data file of an output (lineage and marker left out)."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in UNHASHED_FILES
    }


def fault_free(tmp_path_factory: pytest.TempPathFactory, num_bytes: int) -> dict[str, str]:
    """The blob step's files from a fault-free run on local disk."""
    out = tmp_path_factory.mktemp("reference")
    blob(BlobConfig(num_bytes=num_bytes), out=out)
    return digests(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return fault_free(tmp_path_factory, MULTIPART_BYTES)


@contextlib.contextmanager
def moto_server() -> Iterator[S3]:
    """moto's S3 server on 127.0.0.1 with one bucket (also used by test_orchestrator.py)."""
    with servers.moto_server(BUCKET, secret_prefix="chaos-") as s3:
        yield s3


@pytest.fixture(scope="module")
def moto() -> Iterator[S3]:
    with moto_server() as s3:
        yield s3


@pytest.fixture()
def proxy(moto: S3, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3FaultProxy]:
    """A fault proxy in front of moto; this process's S3 clients go through it."""
    from s3fs import S3FileSystem

    with S3FaultProxy(moto.endpoint) as proxy:
        for key, value in {**moto.env, "AWS_ENDPOINT_URL": proxy.endpoint}.items():
            monkeypatch.setenv(key, value)
        S3FileSystem.clear_instance_cache()  # a cached client would still talk to the last proxy
        try:
            yield proxy
        finally:
            S3FileSystem.clear_instance_cache()


def test_store_asks_botocore_for_adaptive_retries(moto: S3, monkeypatch: pytest.MonkeyPatch):
    """Retries are botocore's, configured in the store; the AWS_* variables still win."""
    from s3fs import S3FileSystem

    for key, value in moto.env.items():
        monkeypatch.setenv(key, value)

    def retries() -> dict:
        S3FileSystem.clear_instance_cache()
        store = Store(f"s3://{BUCKET}/config")
        store.fs.connect()
        return store.fs.s3.meta.config.retries

    assert retries() == {"mode": "adaptive", "total_max_attempts": 10}
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    assert retries() == {"mode": "standard", "total_max_attempts": 4}
    S3FileSystem.clear_instance_cache()


def _key(uri: str) -> str:
    return uri.removeprefix(f"s3://{BUCKET}/")


def _fetched(uri: str, cache: Path) -> dict[str, str]:
    """The data files of a committed output, downloaded by a fresh store (another node)."""
    return digests(Store(uri.rsplit("/", 2)[0], cache_dir=cache).local_path(uri))


def test_throttling_and_connection_resets_commit_identical_outputs(
    proxy: S3FaultProxy, moto: S3, reference: dict[str, str], tmp_path: Path
):
    """Two steps, the second reading the first's output: every request may be throttled."""
    proxy.throttle(every=6, burst=2, max_faults=12)  # bursts of two 503 SlowDown
    proxy.reset_upload_parts(max_faults=2)
    proxy.reset(lambda r: r.method == "GET" and r.key.endswith(".parquet"), max_faults=2)
    store = Store(f"s3://{BUCKET}/throttled", cache_dir=tmp_path / "a")
    uploaded = blob.run(store, BlobConfig(), "chaos")
    digested = digest_blob.run(store, DigestConfig(), "chaos", {"blob": uploaded.uri})
    assert proxy.injected["slowdown"] == 12 and proxy.injected["reset"] == 4, proxy.injected
    proxy.clear()
    assert _fetched(uploaded.uri, tmp_path / "b") == reference
    fetched = Store(store.root, cache_dir=tmp_path / "c").local_path(digested.uri)
    assert json.loads((fetched / "digests.json").read_text()) == reference
    assert not moto.client().list_multipart_uploads(Bucket=BUCKET).get("Uploads")
    assert not [k for k in moto.keys("throttled/") if "/.partial/" in k]


def _is_marker(request: Request) -> bool:
    return request.method == "PUT" and request.key.endswith(f"/{COMMIT_MARKER}")


def _is_multipart_commit(request: Request) -> bool:
    return request.method == "POST" and "uploadId" in request.query


@pytest.mark.parametrize(
    "held, num_bytes",
    [(_is_marker, 2000), (_is_multipart_commit, MULTIPART_BYTES)],
    ids=["marker", "multipart"],
)
def test_upload_killed_before_its_marker_looks_incomplete_and_a_rerun_completes(
    held, num_bytes: int, proxy: S3FaultProxy, moto: S3, tmp_path_factory, tmp_path: Path
):
    reference = fault_free(tmp_path_factory, num_bytes)
    config = BlobConfig(num_bytes=num_bytes)
    root = f"s3://{BUCKET}/killed-{held.__name__.strip('_')}"
    hold = proxy.hold(held)
    env = {**os.environ, "LLMFLOW_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    code = (
        f"from tests.chaos.test_object_store import commit_blob; commit_blob({root!r}, {num_bytes})"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        reached = hold.reached.wait(180)
        assert reached, child.stdout.read().decode()[-3000:] if child.poll() is not None else ""
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)
        proxy.clear()

    store = Store(root, cache_dir=tmp_path / "cache")
    uri = blob.address(store, config, "chaos", {})[0]
    keys = moto.keys(_key(root) + "/")
    assert not [k for k in keys if k.endswith(COMMIT_MARKER)]
    assert not store.is_complete(uri) and store.list_outputs("chaos-blob") == []
    if held is _is_marker:  # every data file is up; only the marker is missing
        assert {k.removeprefix(_key(uri) + "/") for k in keys} == set(reference) | {"lineage.json"}
    else:  # the large file's parts are stored but never assembled into an object
        assert f"{_key(uri)}/blob.bin" not in keys
        uploads = moto.client().list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
        assert [u["Key"] for u in uploads] == [f"{_key(uri)}/blob.bin"]
        moto.client().abort_multipart_upload(
            Bucket=BUCKET, Key=uploads[0]["Key"], UploadId=uploads[0]["UploadId"]
        )

    rerun = blob.run(store, config, "chaos")  # same cache: a retry on the same node
    assert rerun.uri == uri and not rerun.cached
    assert store.is_complete(uri)
    assert _fetched(uri, tmp_path / "fresh") == reference


def _with_listing_cut_short(proxy: S3FaultProxy, moto: S3, tmp_path: Path):
    """A committed output, an incomplete one beside it, then a store per listing cut short.

    Yields ``(keep, store, uri, incomplete_uri, expected_digests)`` for each number of keys
    kept from every ListObjectsV2 page under the root (0 to all but one).
    """
    root = f"s3://{BUCKET}/listed-{tmp_path.name}"
    uri = commit_blob(root, num_bytes=2000)
    expected = _fetched(uri, tmp_path / "expected")
    assert len(expected) == 5
    incomplete = f"{_key(root)}/chaos-blob/other-0123456789abcdef"
    for name in ("blob.bin", "lineage.json", "shards/shard-00000.parquet"):
        moto.client().put_object(Bucket=BUCKET, Key=f"{incomplete}/{name}", Body=b"x")
    for keep in range(len(moto.keys(_key(root) + "/"))):
        proxy.clear()
        proxy.truncate_listing(f"{_key(root)}/", keep=keep)
        store = Store(root, cache_dir=tmp_path / f"cache-{keep}")
        yield keep, store, uri, f"s3://{BUCKET}/{incomplete}", expected


def test_partial_listing_never_makes_an_output_look_committed_or_not(
    proxy: S3FaultProxy, moto: S3, tmp_path: Path
):
    for keep, store, uri, incomplete, _ in _with_listing_cut_short(proxy, moto, tmp_path):
        assert store.is_complete(uri), keep  # the marker is read by its key, not listed
        assert not store.is_complete(incomplete), keep
        assert set(store.list_outputs("chaos-blob")) <= {uri}, keep
    assert proxy.injected["truncated-listing"] > 0


def test_partial_listing_never_loses_files_of_a_committed_output(
    proxy: S3FaultProxy, moto: S3, tmp_path: Path
):
    for keep, store, uri, _, expected in _with_listing_cut_short(proxy, moto, tmp_path):
        shards = sorted(k.split("/")[1] for k in expected if "/" in k)
        try:
            listed = store.listdir(uri, "shards")
        except OSError:  # a clear error is as good as the full list
            listed = shards
        assert listed == shards, f"keep={keep}: {listed}"
        try:
            fetched = digests(store.local_path(uri))
        except OSError:
            fetched = expected
        assert fetched == expected, f"keep={keep}: {sorted(fetched)}"
    # a committed output's files come from its lineage, by key: no listing is read, cut or not
    assert proxy.injected["truncated-listing"] == 0


def test_a_committed_output_missing_or_short_a_file_is_an_error_naming_it(
    moto: S3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """local_path fetches what the lineage lists; a lost or cut file is never a complete copy."""
    from s3fs import S3FileSystem

    for key, value in moto.env.items():
        monkeypatch.setenv(key, value)
    S3FileSystem.clear_instance_cache()  # a cached client would talk to another test's server
    monkeypatch.setattr(S3FileSystem, "_cache", {})  # and this one must not outlive the test
    root = f"s3://{BUCKET}/damaged-{tmp_path.name}"
    uri = commit_blob(root, num_bytes=2000)
    client, prefix = moto.client(), _key(uri)
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/shards/shard-00002.parquet")
    store = Store(root, cache_dir=tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="shards/shard-00002.parquet"):
        store.local_path(uri)
    assert not list((tmp_path / "missing").rglob(COMMIT_MARKER))
    assert store.listdir(uri, "shards") == [f"shard-{i:05d}.parquet" for i in range(4)]

    client.put_object(Bucket=BUCKET, Key=f"{prefix}/shards/shard-00002.parquet", Body=b"short")
    store = Store(root, cache_dir=tmp_path / "short")
    with pytest.raises(OSError, match="shard-00002.parquet: downloaded 5 bytes.* records 1002"):
        store.local_path(uri)
    assert not list((tmp_path / "short").rglob(COMMIT_MARKER))

    # an output committed before lineage listed its files is still read by listing it
    record = json.loads(
        client.get_object(Bucket=BUCKET, Key=f"{prefix}/lineage.json")["Body"].read()
    )
    del record["files"]
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/lineage.json", Body=json.dumps(record).encode())
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/shards/shard-00002.parquet")
    store = Store(root, cache_dir=tmp_path / "old")
    assert store.listdir(uri, "shards") == [
        "shard-00000.parquet",
        "shard-00001.parquet",
        "shard-00003.parquet",
    ]
    assert sorted(digests(store.local_path(uri))) == [
        "blob.bin",
        "shards/shard-00000.parquet",
        "shards/shard-00001.parquet",
        "shards/shard-00003.parquet",
    ]
