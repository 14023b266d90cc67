"""bench_train_step: the peer computes what ours computes (same weights, same logits), and in the
packed pair both attend within documents: each packed row's logits equal its documents run one
by one, on both sides; the targets of the two sides are the same tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks.bench_train_step import batch_of, ours, ours_loss, smollm3, smollm3_loss
from llmflow.model.hf import to_hf_state_dict
from llmflow.model.loss import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[2]


def pair():
    torch.manual_seed(0)
    model = ours(False, False)[0]
    peer = smollm3(False, False, to_hf_state_dict(model.state_dict(), model.cfg))[0]
    return model, peer


@torch.no_grad()
def test_smollm3_peer_computes_our_logits_from_the_same_weights():
    model, peer = pair()
    ids = batch_of(2, 64)["ids"]
    assert (model(ids) - peer(input_ids=ids).logits).abs().max() < 1e-4


@torch.no_grad()
def test_packed_pair_attends_within_documents_on_both_sides():
    model, peer = pair()
    batch, doc_len = batch_of(2, 96, 32), 32
    ids, positions = batch["ids"], batch["position_ids"]
    one_by_one = torch.cat([model(ids[:, i : i + doc_len]) for i in range(0, 96, doc_len)], 1)
    assert (model(ids, positions) - one_by_one).abs().max() < 1e-4
    peer_packed = peer(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert (peer_packed - one_by_one).abs().max() < 1e-4
    # the losses the benchmark steps on: the documents' losses, one by one, by hand
    by_hand = F.cross_entropy(one_by_one.flatten(0, 1), batch["labels"].flatten(),
                              ignore_index=IGNORE_INDEX)  # fmt: skip
    assert abs(ours_loss(model, batch).item() - by_hand.item()) < 1e-5
    assert abs(smollm3_loss(peer, batch).item() - by_hand.item()) < 1e-5


def test_packed_targets_never_cross_a_document_and_match_the_peers_shifted_labels():
    batch = batch_of(2, 12, 4)
    labels, hf_labels, ids = batch["labels"], batch["hf_labels"], batch["ids"]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3] * 3
    ignored = (labels == IGNORE_INDEX).nonzero()[:, 1].unique().tolist()
    assert ignored == [3, 7, 11]  # each document's last token
    assert torch.equal(labels[:, :-1][labels[:, :-1] != IGNORE_INDEX],
                       ids[:, 1:][labels[:, :-1] != IGNORE_INDEX])  # fmt: skip
    # transformers shifts its labels by one: target of t is hf_labels[t + 1]
    assert torch.equal(labels[:, :-1], hf_labels[:, 1:])


@pytest.mark.slow
def test_quick_run_records_the_packed_pair_beside_the_others():
    out = subprocess.run(
        [sys.executable, "bench_train_step.py", "--rounds", "1", "--steps", "1", "--warmup", "0",
         "--no-compile", "--packed-shape", "2", "256", "64"],
        cwd=REPO / "benchmarks", capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert set(record["ratios"]) == {"eager", "fused_adamw", "packed"}
    assert record["identical_work"] is True and "documents of 64" in record["packed_shape"]
    first = record["first_step_loss"]
    assert abs(first["ours_packed"] - first["smollm3_packed"]) < 1e-4
    assert first["ours_packed"] != first["ours_eager"]  # a different batch
    for kept in ("ratio", "ratio_range", "eager_round_ratios", "tokens_per_s", "shape"):
        assert kept in record
