"""Hub sources: the URI grammar, streaming through `datasets` from a folder laid out as a Hub
dataset repo (offline), caps, domains, pinned revisions in the hash and lineage, and bad input."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.ingest import hub
from llmflow.tasks.ingest.idset import IdSet
from llmflow.tasks.ingest.ingest import IngestConfig, ingest, ingest_sources

README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.parquet
  - split: test
    path: data/test-*.parquet
- config_name: hq
  data_files:
  - split: train
    path: hq/*.parquet
---
# A web corpus laid out as on the Hub
"""


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """acme/web (Parquet, configs default and hq) and acme/code (JSONL, text in `content`)."""
    web = tmp_path / "mirror" / "acme" / "web"
    for folder in ("data", "hq"):
        (web / folder).mkdir(parents=True)
    (web / "README.md").write_text(README)
    for shard in range(2):
        rows = [f"web page {shard}-{i}: " + "words " * (i + 1) for i in range(20)]
        ids = [f"w{shard}-{i}" for i in range(20)]
        pq.write_table(pa.table({"id": ids, "text": rows}), web / f"data/train-{shard}.parquet")
    pq.write_table(pa.table({"text": ["held out"]}), web / "data/test-0.parquet")
    pq.write_table(pa.table({"text": [f"good page {i}" for i in range(5)]}), web / "hq/a.parquet")
    code = tmp_path / "mirror" / "acme" / "code" / "data"
    code.mkdir(parents=True)
    lines = [json.dumps({"content": f"def f{i}():\n    return {i}\n"}) for i in range(12)]
    (code / "part-0.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv(hub.MIRROR_ENV, str(tmp_path / "mirror"))
    return tmp_path / "mirror"


def test_uri_grammar_round_trips_and_rejects_bad_options():
    uri = "hf://datasets/HuggingFaceTB/finemath/finemath-4plus@main?split=train&domain=math&max_docs=5"
    source = hub.parse_uri(uri)
    assert (source.repo, source.config, source.revision) == (
        "HuggingFaceTB/finemath",
        "finemath-4plus",
        "main",
    )
    assert (source.split, source.domain, source.max_docs, source.max_tokens) == (
        "train",
        "math",
        5,
        None,
    )
    assert hub.parse_uri(hub.format_uri(source)) == source
    plain = hub.parse_uri("hf://datasets/acme/web")
    assert (plain.config, plain.revision, plain.split) == (None, None, "train")
    with pytest.raises(BadInputError, match="unknown option.*shuffle"):
        hub.parse_uri("hf://datasets/acme/web?shuffle=1")
    with pytest.raises(BadInputError, match="max_docs='-3'"):
        hub.parse_uri("hf://datasets/acme/web?max_docs=-3")
    with pytest.raises(BadInputError, match="not a Hub dataset URI"):
        hub.parse_uri("hf://datasets/justaname")


def test_ingest_streams_hub_splits_with_caps_domains_and_text_fields(mirror, tmp_path):
    web = "hf://datasets/acme/web?split=train&domain=web&max_docs=25"
    code = "hf://datasets/acme/code?split=train&domain=code&text_field=content&max_tokens=20"
    hq = "hf://datasets/acme/web/hq?split=train&domain=web-hq"
    out = tmp_path / "out"
    metrics = ingest(IngestConfig(docs_per_shard=10), [], out, [web, code, hq])
    docs = pa.concat_tables([pq.read_table(p) for p in sorted((out / "shards").glob("*"))])
    docs = docs.to_pylist()
    # reference: the mirror's files read with pyarrow, in the order `datasets` streams them
    expected_web = [
        r
        for s in range(2)
        for r in pq.read_table(mirror / f"acme/web/data/train-{s}.parquet").to_pylist()
    ]
    got_web = [d for d in docs if d["domain"] == "web"]
    assert [d["text"] for d in got_web] == [r["text"] for r in expected_web[:25]]
    assert [d["id"] for d in got_web] == [r["id"] for r in expected_web[:25]]
    # max_tokens=20 is 80 bytes at 4 bytes per token: documents are kept until that is reached
    code_docs = [d["text"] for d in docs if d["domain"] == "code"]
    sizes = [len(t.encode()) for t in code_docs]
    assert sum(sizes[:-1]) < 80 <= sum(sizes) and code_docs[0] == "def f0():\n    return 0\n"
    assert [d["text"] for d in docs if d["domain"] == "web-hq"] == [
        f"good page {i}" for i in range(5)
    ]
    assert metrics["documents"] == len(docs) == 25 + len(code_docs) + 5
    assert metrics["hub_taken"] == {web: 25, code: len(code_docs), hq: 5}
    report = json.loads((out / "report.json").read_text())["sources"]
    assert report[hq]["dataset"] == "acme/web" and report[hq]["config"] == "hq"
    assert report[web]["kept"] == 25 and report[web]["split"] == "train"
    assert not list(out.glob("*.sqlite"))  # the on-disk id set is gone


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("hf://datasets/acme/web/nope?split=train", "BuilderConfig 'nope' not found"),
        ("hf://datasets/acme/web?split=validation", "Bad split: validation"),
        ("hf://datasets/acme/missing?split=train", "acme/missing"),
    ],
)
def test_missing_config_split_or_repo_fails_naming_the_source(mirror, tmp_path, uri, message):
    with pytest.raises(BadInputError, match=message) as err:
        ingest(IngestConfig(), [], tmp_path / "out", [uri])
    assert uri in str(err.value)
    with pytest.raises(BadInputError, match="acme/missing"):
        hub.pin("hf://datasets/acme/missing?split=train")


def test_sample_documents_checks_reachability_and_the_text_field(mirror):
    texts = hub.sample_documents(hub.parse_uri("hf://datasets/acme/web/hq"), "text", count=2)
    assert texts == ["good page 0", "good page 1"]
    with pytest.raises(BadInputError, match="no string field 'text'.*content"):
        hub.sample_documents(hub.parse_uri("hf://datasets/acme/code"), "text")


def test_pin_resolves_a_fingerprint_that_follows_the_data(mirror):
    uri = "hf://datasets/acme/web?split=train&domain=web"
    pinned = hub.pin(uri)
    revision = hub.parse_uri(pinned).revision
    assert revision.startswith("local-") and hub.pin(pinned) == pinned and hub.pin(uri) == pinned
    pq.write_table(pa.table({"text": ["changed"]}), mirror / "acme/web/hq/a.parquet")
    assert hub.parse_uri(hub.pin(uri)).revision != revision


def test_step_records_dataset_revision_and_number_taken_in_lineage(mirror, tmp_path):
    from llmflow.tasks.framework.executor import Executor

    uri = hub.pin("hf://datasets/acme/web/hq?split=train&domain=web&max_docs=3")
    graph = Graph(("ingest",))
    node = graph.add(ingest_sources, IngestConfig(hub=[uri]), "hubtest", phase="ingest")
    executor = Executor(str(tmp_path / "runs"))
    result = executor.run(graph)[node]
    record = executor.store.read_lineage(result.uri)
    assert record["config"]["hub"] == [uri] and "@local-" in uri
    assert record["metrics"]["hub_taken"] == {uri: 3}


def test_recipe_pins_hub_sources_and_refuses_a_weighted_domain_without_source(mirror):
    from llmflow.tasks.config import load_config

    data = [
        "hf://datasets/acme/web?split=train&domain=prose",
        "hf://datasets/acme/code?domain=code&text_field=content",
    ]
    config = load_config(None).model_copy(update={"data": data})
    with pytest.raises(BadInputError, match=r"weighs domain\(s\) \['math'\].*'code', 'prose'"):
        hub.data_sources(config)
    data.append("hf://datasets/acme/web/hq?domain=math")
    local, pinned = hub.data_sources(config.model_copy(update={"data": data}))
    assert local == [] and all("@local-" in u for u in pinned) and len(pinned) == 3


def test_idset_is_exact_and_on_disk(tmp_path):
    with IdSet(tmp_path) as ids:
        assert ids.add("a") and not ids.add("a") and ids.add("b")
        ids.update(["c", "a"])
        assert "c" in ids and "z" not in ids and len(ids) == 3
        path = ids.path
        assert path.exists()
    assert not path.exists()


def test_a_mirror_pin_never_streams_the_live_hub(mirror, monkeypatch):
    pinned = hub.parse_uri(hub.pin("hf://datasets/acme/web/hq?split=train&domain=web"))
    assert next(hub.stream(pinned))["text"] == "good page 0"
    monkeypatch.delenv(hub.MIRROR_ENV)
    with pytest.raises(BadInputError, match="LLMFLOW_HUB_MIRROR is not set"):
        next(hub.stream(pinned))


def test_a_changed_mirror_no_longer_serves_its_old_pin(mirror):
    pinned = hub.parse_uri(hub.pin("hf://datasets/acme/web/hq?split=train&domain=web"))
    pq.write_table(pa.table({"text": ["changed"]}), mirror / "acme/web/hq/a.parquet")
    with pytest.raises(BadInputError, match="files changed"):
        next(hub.stream(pinned))


def test_the_fingerprint_covers_bytes_past_the_first_mebibyte(mirror):
    big = mirror / "acme/web/hq/big.bin"
    big.write_bytes(b"\0" * (3 << 20))
    before = hub.parse_uri(hub.pin("hf://datasets/acme/web?split=train&domain=web")).revision
    big.write_bytes(b"\0" * ((3 << 20) - 1) + b"\1")  # same size, last byte differs
    after = hub.parse_uri(hub.pin("hf://datasets/acme/web?split=train&domain=web")).revision
    assert before != after
