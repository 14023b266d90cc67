"""Two writers of one shard: a committed shard is never removed or rewritten.

The second writer (another host, or a run that computed the shard while the first committed it)
finds the shard committed, keeps it and drops its own files; the row it hands the stage is the
committed one, so the stage's recorded checksums are those of the files that stay.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from llmflow.tasks.framework.lineage import FILES_KEY, file_manifest
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.framework.store import COMMIT_MARKER, Store
from tests.integration.servers import moto_server

BUCKET = "llmflow-shard-commit"


def _work(folder: Path, text: str) -> Path:
    """A finished shard working directory whose file holds ``text``."""
    folder.mkdir(parents=True)
    (folder / "value.txt").write_text(text)
    return folder


def test_a_local_shard_committed_first_is_kept(tmp_path):
    """Two hosts on one shared folder: each has its own lock, so both reach the commit."""
    store = Store(tmp_path / "root")
    shard = Store.shard_uri(store.uri("square", "n", "abc"), "00000")
    first = store.commit_shard(_work(tmp_path / "a", "from a"), shard, {"label": "00000"})
    second = store.commit_shard(_work(tmp_path / "b", "from b"), shard, {"label": "00000"})

    assert (Path(shard) / "value.txt").read_text() == "from a"
    assert second == first == store.shard_row(shard)  # the committed row, also for writer b
    assert file_manifest(Path(shard), skip=(COMMIT_MARKER,)) == first[FILES_KEY]
    assert not (tmp_path / "b").exists()  # writer b's files dropped


def test_a_local_incomplete_leftover_is_replaced(tmp_path):
    store = Store(tmp_path / "root")
    shard = Store.shard_uri(store.uri("square", "n", "abc"), "00000")
    _work(Path(shard), "a leftover without a marker")
    row = store.commit_shard(_work(tmp_path / "a", "from a"), shard, {"label": "00000"})
    assert (Path(shard) / "value.txt").read_text() == "from a"
    assert store.shard_row(shard) == row
    assert [p.name for p in Path(shard).parent.iterdir()] == ["00000"]


class Spec(BaseModel):
    text: str = "value"


HOSTS: dict[str, Store] = {}  # host name -> its Store (one S3 root, its own local cache)
ROW = {"label": "00000", "host": "a"}


@step("shard-race")
def written(cfg: Spec, out: Path) -> Metrics:
    """Writes ``cfg.text``; on host b, host a commits the same shard while this one computes."""
    if cfg.text == "from b":
        HOSTS["a"].commit_shard(_work(out.parent / "a-work", "from a"), HOSTS["uri"], ROW)
    (out / "value.txt").write_text(cfg.text)
    return {"text": cfg.text}


@pytest.mark.integration
def test_an_s3_shard_committed_while_another_writer_computed_it_is_kept(tmp_path, monkeypatch):
    from s3fs import S3FileSystem

    with moto_server(BUCKET, secret_prefix="shard-commit-") as s3:
        for key, value in s3.env.items():
            monkeypatch.setenv(key, value)
        S3FileSystem.clear_instance_cache()
        root = f"s3://{BUCKET}/runs"
        host_a = Store(root, cache_dir=tmp_path / "host-a")
        host_b = Store(root, cache_dir=tmp_path / "host-b")
        stage = host_b.uri("shard-race", "n", "abc")
        shard = Store.shard_uri(stage, "00000")
        HOSTS.update(a=host_a, uri=shard)
        try:
            result = written.run_shard(host_b, Spec(text="from b"), stage, "00000", {})
        finally:
            HOSTS.clear()
            S3FileSystem.clear_instance_cache()

        client = s3.client()
        key = shard.removeprefix(f"s3://{BUCKET}/")
        body = client.get_object(Bucket=BUCKET, Key=f"{key}/value.txt")["Body"].read()
        marker = json.loads(
            client.get_object(Bucket=BUCKET, Key=f"{key}/{COMMIT_MARKER}")["Body"].read()
        )
        assert body == b"from a"  # host a's shard stays; host b's upload never replaced it
        assert result.row == marker and marker["host"] == "a"  # the committed row, for the stage
        assert marker[FILES_KEY]["value.txt"]["bytes"] == len(b"from a")
        assert not (tmp_path / "host-b" / "partial" / "shard-race" / "n-abc" / "00000").exists()
