"""tokenize_corpus on workers (a spawned process pool, Ray tasks) against the sequential path.

The reference is this process alone (``LLMFLOW_DATA_WORKERS`` unset, Ray not connected): every
file of the tokenized folder and of the mixture built from it downstream must have the same
sha256 on the parallel paths, on the quickstart corpus ingested into several shards.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llmflow.tasks.dataprep.config import StageMixture, TokenizeConfig
from llmflow.tasks.dataprep.mixture import build_mixture
from llmflow.tasks.dataprep.tokenize import tokenize_corpus
from llmflow.tasks.framework.backend import ProcessBackend, RayBackend, active
from llmflow.tasks.ingest.ingest import IngestConfig, ingest, list_files
from llmflow.tasks.ingest.sample import SampleConfig, make_sample
from llmflow.tasks.tokenizer.config import TokenizerConfig
from llmflow.tasks.tokenizer.train import train_tokenizer

CFG = TokenizeConfig(validation_fraction=0.05, encode_batch_size=64, read_batch_rows=50)


def sha256s(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quickstart sample ingested into 100-document shards, and a tokenizer trained on it."""
    root = tmp_path_factory.mktemp("tok_engine")
    make_sample(SampleConfig(), root / "sample")
    ingest(IngestConfig(docs_per_shard=100), list_files([str(root / "sample")]), root / "corpus")
    (root / "tok").mkdir()
    train_tokenizer(TokenizerConfig(vocab_size=1000), root / "corpus", root / "tok")
    return root


def _tokenize_and_mix(root: Path, out: Path) -> tuple[dict, dict, float]:
    """Tokenize the corpus into ``out/tokenized`` and build a mixture from it into ``out/mix``:
    both folders' sha256s and the tokenize wall time."""
    (out / "tokenized").mkdir(parents=True)
    start = time.perf_counter()
    tokenize_corpus(CFG, root / "corpus", root / "tok", out / "tokenized")
    seconds = time.perf_counter() - start
    mix = StageMixture(
        weights={"prose": 2.0, "code": 1.0, "math": 1.0},
        num_tokens=60_000,
        max_epochs=4,
        seq_len=64,
        rows_per_shard=100,
        seed=7,
    )
    (out / "mix").mkdir()
    build_mixture(mix, out / "tokenized", out / "mix")
    return sha256s(out / "tokenized"), sha256s(out / "mix"), seconds


@pytest.fixture(scope="module")
def sequential(quickstart, tmp_path_factory):
    """The reference: this process alone."""
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    return _tokenize_and_mix(quickstart, tmp_path_factory.mktemp("seq"))


def test_quickstart_corpus_has_several_files(quickstart, sequential):
    files = sorted((quickstart / "corpus" / "shards").glob("*.parquet"))
    assert len(files) >= 5
    tokenized, mix, _ = sequential
    assert "validation_docs/shards/part-00000.parquet" in tokenized
    assert any(name.startswith("train/") for name in tokenized) and mix


def test_process_pool_output_is_byte_identical(quickstart, sequential, tmp_path, on_backend):
    on_backend(ProcessBackend(2))
    tokenized, mix, seconds = _tokenize_and_mix(quickstart, tmp_path)
    print(f"tokenize: sequential {sequential[2]:.2f} s, 2 processes {seconds:.2f} s")
    assert tokenized == sequential[0]
    assert mix == sequential[1]


def test_a_changed_corpus_changes_the_sha256s(quickstart, sequential, tmp_path, monkeypatch):
    """The comparison can fail: one document's text changed gives other bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = tmp_path / "corpus" / "shards"
    corpus.mkdir(parents=True)
    for path in sorted((quickstart / "corpus" / "shards").glob("*.parquet")):
        table = pq.read_table(path)
        if path.name.endswith("00002.parquet"):
            texts = table.column("text").to_pylist()
            texts[3] = texts[3] + " changed"
            table = table.set_column(1, "text", pa.array(texts, pa.string()))
        pq.write_table(table, corpus / path.name)
    (tmp_path / "tok").symlink_to(quickstart / "tok")
    with ProcessBackend(2) as backend, active(backend):
        tokenized, _, _ = _tokenize_and_mix(tmp_path, tmp_path / "out")
    changed = {k for k in tokenized if tokenized[k] != sequential[0].get(k)}
    assert any(k.endswith("tokens.bin") for k in changed), changed


def _sleep_and_return(job: float, item: int) -> int:
    time.sleep(job * (5 - item % 5))
    return item


def _drawn(count: int, log: list[int]):
    """Items 0..count-1, logging each as the stream draws it."""
    for item in range(count):
        log.append(item)
        yield item


def _check_order_and_bound(stream_fn, limit: int) -> None:
    """Results in the items' order, and never more than ``limit`` items drawn ahead of the
    results taken (the driver holds a bounded number of encoded files)."""
    drawn: list[int] = []
    taken = []
    for result in stream_fn(_sleep_and_return, 0.05, _drawn(12, drawn)):
        assert len(drawn) - len(taken) <= limit
        taken.append(result)
    assert taken == list(range(12))


def test_process_stream_keeps_the_items_order_with_a_bounded_number_in_flight():
    with ProcessBackend(2) as backend:
        _check_order_and_bound(backend.stream, 4)


@pytest.mark.slow
def test_ray_output_is_byte_identical(quickstart, sequential, tmp_path):
    """Ray connected (as the data engine connects it): each file a Ray task."""
    ray = pytest.importorskip("ray")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    start = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        started = time.perf_counter() - start
        with RayBackend(max_in_flight=3) as backend, active(backend):
            tokenized, mix, seconds = _tokenize_and_mix(quickstart, tmp_path)
            tokenized_again, _, again = _tokenize_and_mix(quickstart, tmp_path / "again")
            _check_order_and_bound(backend.stream, 3)
    finally:
        ray.shutdown()
    print(
        f"tokenize: sequential {sequential[2]:.2f} s, ray {seconds:.2f} s then {again:.2f} s "
        f"(ray.init {started:.1f} s), load {os.getloadavg()[0]:.1f}"
    )
    assert tokenized == sequential[0] == tokenized_again
    assert mix == sequential[1]
    assert np.isfinite(seconds)


def _committed(root: Path, steps: tuple[str, ...]) -> dict[str, tuple[str, dict]]:
    """The committed outputs of ``steps`` under ``root``: address -> (hash, each file's sha256)."""
    import json

    found = {}
    for step_name in steps:
        for record in root.glob(f"{step_name}/*/lineage.json"):
            data = json.loads(record.read_text())
            found[record.parent.relative_to(root).as_posix()] = (data["hash"], data["files"])
    return found


@pytest.mark.slow
def test_pipeline_under_ray_runner_tokenizes_on_ray_with_the_same_addresses(
    prefect_harness, tmp_path, monkeypatch
):
    """The quickstart until the mixture on the threads runner, then on ``runner.kind=ray`` (the
    executor starts a local cluster before ingest, the first step that maps its own units):
    ingest reads and tokenize encodes their files as Ray tasks, and ingest's, tokenize's and the
    mixture's addresses and files are the threads run's."""
    import shutil

    from llmflow.flows.pipeline import run_pipeline
    from llmflow.tasks.config import load_config

    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    streamed: list[tuple[str, int]] = []
    original = RayBackend.stream

    def counting(self, fn, job, items, errors=False):
        items = list(items)
        streamed.append((fn.__name__, len(items)))
        return original(self, fn, job, items, errors)

    monkeypatch.setattr(RayBackend, "stream", counting)
    repo = Path(__file__).resolve().parents[3]
    root, walls = tmp_path / "run", {}
    for kind in ("threads", "ray"):
        overrides = [f"root={root}", "until=mixture", "ingest.docs_per_shard=60"]
        config = load_config(
            repo / "configs" / "quickstart.yaml", overrides + [f"runner.kind={kind}"]
        )
        start = time.perf_counter()
        run_pipeline(config)
        walls[kind] = time.perf_counter() - start
        # NOTE: one root for both runs (moved aside in between): documents record their source
        # file's path.
        shutil.move(root, tmp_path / kind)
    print(f"pipeline until mixture: {walls}, load {os.getloadavg()[0]:.1f}")
    steps = ("ingest", "tokenize", "mixture")
    threads = _committed(tmp_path / "threads", steps)
    on_ray = _committed(tmp_path / "ray", steps)
    assert {k.split("/")[0] for k in threads} == set(steps)
    assert on_ray == threads
    files = dict(streamed)
    assert files.get("_file_records", 0) >= 2  # ingest's files went to Ray tasks
    assert files.get("_encode_file", 0) >= 5  # and tokenize's
