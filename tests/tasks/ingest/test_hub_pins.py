"""A commit-pinned Hub dataset read from a mirror: the mirror must prove it holds that commit.

``huggingface-cli download --repo-type dataset --local-dir DIR`` records, for each file, the
commit it came from and its etag (the sha256 of an LFS file, the git blob id of any other) in
``DIR/.cache/huggingface/download/<file>.metadata``. A recipe pinned online to a commit and run
offline reads the mirror only when every file's record names that commit and matches its bytes.
"""

from __future__ import annotations

import hashlib
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.ingest import hub
from llmflow.tasks.ingest.ingest import IngestConfig, ingest

PINNED = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"
README = "---\nconfigs:\n- config_name: default\n  data_files: data/*.parquet\n---\n"


def uri(revision: str | None = PINNED) -> str:
    at = f"@{revision}" if revision else ""
    return f"hf://datasets/acme/web{at}?split=train&domain=web"


def record(folder, name: str, commit: str, etag: str | None = None) -> None:
    """The record ``huggingface_hub`` writes beside a ``--local-dir`` download."""
    data = (folder / name).read_bytes()
    if etag is None:  # LFS files (Parquet) carry their sha256, others their git blob id
        lfs = name.endswith(".parquet")
        blob = b"blob %d\0" % len(data) + data
        etag = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(blob).hexdigest()
    meta = folder / ".cache" / "huggingface" / "download" / f"{name}.metadata"
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(f"{commit}\n{etag}\n{time.time()}\n")


@pytest.fixture
def web(tmp_path, monkeypatch):
    """acme/web downloaded at commit OTHER: a README and one Parquet shard of 30 rows."""
    folder = tmp_path / "mirror" / "acme" / "web"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text(README)
    rows = [f"snapshot page {i}" for i in range(30)]
    pq.write_table(pa.table({"text": rows}), folder / "data" / "train-0.parquet")
    for name in ("README.md", "data/train-0.parquet"):
        record(folder, name, OTHER)
    monkeypatch.setenv(hub.MIRROR_ENV, str(tmp_path / "mirror"))
    return folder


def test_a_mirror_of_another_commit_fails_before_compute_naming_both(web, tmp_path):
    message = rf"acme/web@{PINNED}.*pinned to commit {PINNED}.*records commit {OTHER}"
    with pytest.raises(BadInputError, match=message):
        hub.pin(uri())  # what the recipe does when it is built
    out = tmp_path / "out"
    with pytest.raises(BadInputError, match=message):
        ingest(IngestConfig(), [], out, [uri()])
    assert not (out / "shards").exists() or not list((out / "shards").iterdir())


def test_a_mirror_that_records_the_pinned_commit_serves_it_under_that_commit(web, tmp_path):
    for name in ("README.md", "data/train-0.parquet"):
        record(web, name, PINNED)
    assert hub.pin(uri()) == hub.parse_uri(uri()).uri  # the commit stays the address
    metrics = ingest(IngestConfig(), [], tmp_path / "out", [uri()])
    assert metrics["documents"] == 30 and metrics["hub_taken"] == {hub.parse_uri(uri()).uri: 30}


def test_a_mirror_without_download_records_cannot_prove_a_commit(web):
    import shutil

    shutil.rmtree(web / ".cache")
    with pytest.raises(BadInputError, match=rf"pinned to commit {PINNED}.*records none"):
        hub.pin(uri())


def test_a_file_changed_or_added_since_the_download_is_no_proof(web):
    for name in ("README.md", "data/train-0.parquet"):
        record(web, name, PINNED)
    shard = web / "data" / "train-0.parquet"
    pq.write_table(pa.table({"text": [f"other page {i}" for i in range(30)]}), shard)
    with pytest.raises(BadInputError, match=r"data/train-0.parquet \(changed since"):
        hub.pin(uri())
    record(web, "data/train-0.parquet", PINNED)
    assert hub.pin(uri()) == hub.parse_uri(uri()).uri
    pq.write_table(pa.table({"text": ["extra"]}), web / "data" / "train-1.parquet")
    with pytest.raises(BadInputError, match=r"data/train-1.parquet \(no download record"):
        hub.pin(uri())


def test_a_named_revision_cannot_be_told_from_a_mirror(web):
    with pytest.raises(BadInputError, match=r"revision 'v1.0'.*records commit " + OTHER):
        hub.pin(uri("v1.0"))
    # no revision, or main: the folder as it is, pinned to its fingerprint
    assert hub.parse_uri(hub.pin(uri(None))).revision == hub.folder_fingerprint(web)
    assert hub.parse_uri(hub.pin(uri("main"))).revision == hub.folder_fingerprint(web)
