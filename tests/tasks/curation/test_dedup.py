"""Exact dedup (Bloom filter + exact check) and MinHash LSH near dedup."""

from __future__ import annotations

import random

import numpy as np
import pyarrow.parquet as pq
import pytest

from llmflow.tasks.curation.config import (
    ExactDedupConfig,
    ExactHashConfig,
    MinhashConfig,
    SignatureConfig,
)
from llmflow.tasks.curation.exact_dedup import (
    BloomFilter,
    exact_dedup,
    exact_hashes,
    text_hash,
)
from llmflow.tasks.curation.minhash import (
    UnionFind,
    minhash_signatures,
    near_dedup,
    shingle_batch,
    signatures,
)
from tests.tasks.curation.helpers import near_copy, prose, real_documents, write_shards


def _dropped(out_dir) -> dict[str, str]:
    table = pq.read_table(out_dir / "drops.parquet").to_pylist()
    return {r["id"]: r["duplicate_of"] for r in table}


def test_bloom_filter_false_positive_rate_near_target():
    bloom = BloomFilter(capacity=20_000, false_positive_rate=0.01)
    rng = np.random.default_rng(0)
    seen = [bytes(x) for x in rng.integers(0, 256, (20_000, 16), dtype=np.uint8)]
    assert not bloom.add_and_check(seen).any()
    fresh = [bytes(x) for x in rng.integers(0, 256, (20_000, 16), dtype=np.uint8)]
    probe = BloomFilter(20_000, 0.01)
    probe.bits[:] = bloom.bits
    rate = probe.add_and_check(fresh).mean()
    assert 0.003 < rate < 0.02
    assert bloom.add_and_check([seen[5], seen[5]]).all()


def test_exact_dedup_removes_planted_copies_across_shards(tmp_path):
    rng = random.Random(1)
    originals = [{"id": f"doc-{i}", "text": prose(rng, 6), "domain": "web"} for i in range(40)]
    copies = [
        {"id": f"copy-{i}", "text": originals[i]["text"].upper().replace(".", "!"), "domain": "web"}
        for i in range(0, 40, 4)
    ]
    write_shards(tmp_path / "in", originals + copies, num_shards=3)
    hashes = tmp_path / "hashes"
    hashes.mkdir()
    assert exact_hashes(ExactHashConfig(), tmp_path / "in", hashes)["documents"] == 50
    out = tmp_path / "exact"
    out.mkdir()
    metrics = exact_dedup(ExactDedupConfig(), [hashes], out)
    dropped = _dropped(out)
    assert metrics["documents_dropped"] == 10
    # the first occurrence in (shard name, row) order is kept, the other member dropped
    for i in range(0, 40, 4):
        assert {f"doc-{i}", f"copy-{i}"} - set(dropped) and len(
            {f"doc-{i}", f"copy-{i}"} & set(dropped)
        ) == 1


def test_bloom_false_positives_never_drop_unique_documents(tmp_path, monkeypatch):
    monkeypatch.setattr("llmflow.tasks.curation.exact_dedup.BLOOM_BATCH", 16)
    rng = random.Random(2)
    docs = [{"id": f"d{i}", "text": prose(rng, 2), "domain": "web"} for i in range(300)]
    docs.append({"id": "dup", "text": docs[7]["text"], "domain": "web"})
    write_shards(tmp_path / "in", docs, num_shards=1)
    hashes = tmp_path / "hashes"
    hashes.mkdir()
    exact_hashes(ExactHashConfig(), tmp_path / "in", hashes)
    # a Bloom filter far too small: most unique documents become candidates
    cfg = ExactDedupConfig(expected_documents=10, false_positive_rate=0.5)
    out = tmp_path / "exact"
    out.mkdir()
    metrics = exact_dedup(cfg, [hashes], out)
    assert _dropped(out) == {"dup": "d7"}
    assert metrics["bloom_candidates"] > 50


def test_paragraph_level_drops_repeated_paragraphs(tmp_path):
    rng = random.Random(3)
    shared = prose(rng, 3)
    docs = [
        {"id": "a", "text": prose(rng, 3) + "\n\n" + shared, "domain": "web"},
        {"id": "b", "text": shared + "\n\n" + prose(rng, 3), "domain": "web"},
    ]
    write_shards(tmp_path / "in", docs, num_shards=1)
    cfg = ExactDedupConfig(level="paragraph")
    hashes, out = tmp_path / "hashes", tmp_path / "exact"
    hashes.mkdir()
    out.mkdir()
    exact_hashes(cfg.hash_config(), tmp_path / "in", hashes)
    assert exact_dedup(cfg, [hashes], out)["paragraphs_dropped"] == 1
    assert pq.read_table(out / "paragraph_drops.parquet").to_pylist() == [
        {"id": "b", "paragraph": 0, "duplicate_of": "a"}
    ]


def test_signature_matches_brute_force_minhash():
    cfg = SignatureConfig()
    texts = ["one two three four five six seven", "a b c", "alpha beta gamma delta epsilon zeta"]
    shingles, owner = shingle_batch(texts, cfg.n_grams)
    assert owner.tolist() == [0, 0, 0, 2, 2]  # 3 + 0 (too short) + 2 five-grams
    sig, docs = signatures(shingles, owner, cfg, chunk=2)  # chunks split documents
    assert docs.tolist() == [0, 2]
    from llmflow.tasks.curation.minhash import permutation_parameters

    a, b = permutation_parameters(cfg)
    with np.errstate(over="ignore"):
        brute = (shingles[:3, None] * (a | np.uint64(1)) + b).min(axis=0)
    assert (sig[0] == brute).all()


def test_signature_agreement_estimates_jaccard():
    rng = random.Random(4)
    cfg = SignatureConfig(num_buckets=32, hashes_per_bucket=8)
    base = prose(rng, 40)
    other = near_copy(rng, base, 12)
    shingles, owner = shingle_batch([base, other], cfg.n_grams)
    sig, _ = signatures(shingles, owner, cfg)
    words = [t.lower().replace(".", " ").split() for t in (base, other)]
    sets = [{tuple(w[i : i + 5]) for i in range(len(w) - 4)} for w in words]
    jaccard = len(sets[0] & sets[1]) / len(sets[0] | sets[1])
    assert abs((sig[0] == sig[1]).mean() - jaccard) < 0.08


def test_union_find_keeps_smallest_root():
    uf = UnionFind(5)
    uf.union(3, 4)
    uf.union(4, 1)
    assert uf.find(3) == 1 and uf.find(0) == 0


def _near_dedup_run(tmp_path, records, cfg=None, num_shards=3):
    cfg = cfg or MinhashConfig()
    write_shards(tmp_path / "in", records, num_shards=num_shards)
    sigs, out = tmp_path / "sigs", tmp_path / "near"
    sigs.mkdir()
    out.mkdir()
    minhash_signatures(cfg.signature_config(), tmp_path / "in", sigs)
    metrics = near_dedup(cfg, [sigs], out, filtered=[tmp_path / "in"])
    return metrics, _dropped(out)


def _score(records, dropped, planted):
    caught = sum(1 for copy, original in planted.items() if copy in dropped or original in dropped)
    pair_ok = sum(
        1 for copy, original in planted.items() if (copy in dropped) != (original in dropped)
    )
    wrong = [i for i in dropped if i not in planted and i not in planted.values()]
    return caught / len(planted), pair_ok / len(planted), wrong


def test_near_dedup_finds_planted_copies_synthetic(tmp_path):
    rng = random.Random(5)
    records = [{"id": f"doc-{i:03d}", "text": prose(rng, 30), "domain": "web"} for i in range(120)]
    planted = {}
    for i in range(0, 120, 4):
        copy = {
            "id": f"near-{i:03d}",
            "text": near_copy(rng, records[i]["text"], rng.randint(1, 3)),
            "domain": "web",
        }
        planted[copy["id"]] = records[i]["id"]
        records.append(copy)
    metrics, dropped = _near_dedup_run(tmp_path, records)
    recall, one_kept, wrong = _score(records, dropped, planted)
    assert recall >= 0.95 and one_kept == recall and wrong == []
    assert metrics["clusters"] == len(dropped)


def test_near_dedup_on_real_text(tmp_path, shared_data):
    rng = random.Random(6)
    docs = [d for d in real_documents() if len(d.split()) > 200]
    records = [{"id": f"doc-{i:04d}", "text": t, "domain": "web"} for i, t in enumerate(docs)]
    planted = {}
    for i in rng.sample(range(len(records)), 60):
        copy_id = f"near-{i:04d}"
        planted[copy_id] = records[i]["id"]
        records.append(
            {
                "id": copy_id,
                "text": near_copy(rng, records[i]["text"], rng.randint(1, 3)),
                "domain": "web",
            }
        )
    _, dropped = _near_dedup_run(tmp_path, records, num_shards=4)
    recall, _, wrong = _score(records, dropped, planted)
    precision = 1 - len(wrong) / max(1, len(dropped))
    assert recall >= 0.95 and precision >= 0.95


def test_near_dedup_keep_longest(tmp_path):
    rng = random.Random(7)
    base = prose(rng, 30)
    records = [
        {"id": "short", "text": base, "domain": "web"},
        {"id": "long", "text": base + " And one more sentence at the end.", "domain": "web"},
    ]
    cfg = MinhashConfig(keep="longest")
    _, dropped = _near_dedup_run(tmp_path, records, cfg, num_shards=1)
    assert dropped == {"short": "long"}


@pytest.mark.parametrize("field", ["n_grams", "num_buckets", "hashes_per_bucket"])
def test_minhash_config_rejects_zero(field):
    with pytest.raises(ValueError, match=field):
        MinhashConfig(**{field: 0})


def test_text_hash_uses_normal_form():
    assert text_hash("Hello, World 42!") == text_hash("hello world 7")
    assert text_hash("hello world") != text_hash("hello there")
