"""Fingerprints of mirror folders that live under a ``.cache`` folder (``~/.cache/...``).

Only a ``.cache`` folder *inside* the mirrored repo (``huggingface-cli download --local-dir``
keeps its records there) is left out; a ``.cache`` among the folder's parents is just where the
mirror lives, and its files must count.
"""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.ingest import hub, models
from llmflow.tasks.ingest.ingest import IngestConfig, ingest_sources

URI = "hf://datasets/acme/web?split=train&domain=web"


def _write_rows(folder, n):
    pq.write_table(
        pa.table({"text": [f"page {i}: words" for i in range(n)]}), folder / "train.parquet"
    )


@pytest.fixture
def cached_mirror(tmp_path, monkeypatch):
    """A Hub-layout mirror at ``TMP/home/.cache/mirror``, as one under ``~/.cache`` is."""
    mirror = tmp_path / "home" / ".cache" / "mirror"
    web = mirror / "acme" / "web"
    web.mkdir(parents=True)
    _write_rows(web, 40)
    monkeypatch.setenv(hub.MIRROR_ENV, str(mirror))
    return mirror


def test_a_dataset_mirror_under_a_cache_folder_fingerprints_its_files(cached_mirror):
    web = cached_mirror / "acme" / "web"
    before = hub.parse_uri(hub.pin(URI)).revision
    _write_rows(web, 5)  # the data cut from 40 rows to 5
    after = hub.parse_uri(hub.pin(URI)).revision
    assert before != after
    # the fingerprint is that of the files: the same folder elsewhere fingerprints the same
    assert after == hub.folder_fingerprint(web)
    assert after != "local-" + hashlib.sha256(b"").hexdigest()[:16]  # that of no files
    # a .cache folder inside the repo (download records) is still left out
    records = web / ".cache" / "huggingface" / "download"
    records.mkdir(parents=True)
    (records / "train.parquet.metadata").write_text("x\n")
    assert hub.parse_uri(hub.pin(URI)).revision == after


def test_a_changed_mirror_under_a_cache_folder_is_not_served_from_the_old_address(
    cached_mirror, tmp_path
):
    """The issue's reproduction: the second ingest after cutting the data was Cached."""
    executor = Executor(str(tmp_path / "runs"))
    results = []
    for rows in (40, 5):
        _write_rows(cached_mirror / "acme" / "web", rows)
        graph = Graph(("ingest",))
        node = graph.add(ingest_sources, IngestConfig(hub=[hub.pin(URI)]), "hub", phase="ingest")
        result = executor.run(graph)[node]
        results.append((result.uri, executor.store.read_lineage(result.uri)["metrics"]))
    (first_uri, first), (second_uri, second) = results
    assert first_uri != second_uri
    assert (first["documents"], second["documents"]) == (40, 5)


def test_a_model_mirror_under_a_cache_folder_fingerprints_its_files(tmp_path, monkeypatch):
    mirror = tmp_path / ".cache" / "models"
    folder = mirror / "org" / "tiny"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    monkeypatch.setenv(hub.MIRROR_ENV, str(mirror))
    before = models.resolve("hf://models/org/tiny", "init").revision
    (folder / "model.safetensors").write_bytes(b"\1" * 64)  # same size, other weights
    after = models.resolve("hf://models/org/tiny", "init").revision
    assert before != after and after == hub.folder_fingerprint(folder)
    assert len(models.model_files(models.resolve("hf://models/org/tiny", "init"))) == 2
