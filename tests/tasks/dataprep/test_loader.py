"""PackedLoader: batch layout, rank sharding, exact resume, batch-size changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmflow.tasks.dataprep.loader import IGNORE_INDEX, PackedLoader
from tests.tasks.dataprep.conftest import EOS, PAD, make_docs, pack_docs
from tests.tasks.dataprep.packed_rows import read_all_rows


def _row_ids(batch, all_rows: np.ndarray) -> list[int]:
    """Which stored rows a batch's input_ids came from (rows are unique in these tests)."""
    lookup = {tuple(r[:-1]): i for i, r in enumerate(all_rows)}
    return [lookup[tuple(x)] for x in batch["input_ids"].numpy()]


def test_spec_example_cu_seqlens(tmp_path):
    # Documents of 3, 2 and 5 tokens (eos included), T=4: row 0 = [a a e | b e], row 1 = [c c c c e]
    docs = make_docs([3, 2, 5])
    pack_docs(docs, tmp_path, seq_len=4)
    loader = PackedLoader(tmp_path, batch_size=2)
    rows = read_all_rows(tmp_path)
    first = [int(np.flatnonzero(rows[:, 0] == docs[0][0])[0])]
    batch = loader._collate(np.array(first + [1 - first[0]]))
    assert batch["cu_seqlens"].tolist() == [0, 3, 4, 8]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]
    a, b, c = (d.tolist() for d in docs)
    assert batch["input_ids"].tolist() == [[a[0], a[1], EOS, b[0]], c[:4]]
    # the eos of document a must not be trained to predict b's first token
    assert batch["labels"].tolist() == [[a[1], EOS, IGNORE_INDEX, EOS], c[1:]]
    assert batch["input_ids"].dtype == torch.long and batch["labels"].dtype == torch.long


def test_padding_is_ignored_and_positions_restart_after_eos(tmp_path):
    docs = make_docs([5, 9, 3, 30, 2, 11], seed=3)
    meta = pack_docs(docs, tmp_path, seq_len=8)
    assert meta["num_tokens"] == 60 and meta["num_sequences"] == 7  # 63 slots, 3 pad
    loader = PackedLoader(tmp_path, batch_size=7)
    batch = loader.next_batch()
    x, y, pos = (batch[k].numpy() for k in ("input_ids", "labels", "position_ids"))
    assert (y == IGNORE_INDEX).sum() == (x == EOS).sum() + (x == PAD).sum()
    for b in range(7):
        for t in range(1, 8):
            expected = 0 if x[b, t - 1] == EOS else pos[b, t - 1] + 1
            assert pos[b, t] == expected
    assert sorted(_row_ids(batch, read_all_rows(tmp_path))) == list(range(7))


def test_ranks_are_disjoint_and_cover_each_epoch(packed_36):
    rows = read_all_rows(packed_36)
    loaders = [PackedLoader(packed_36, batch_size=3, rank=r, world_size=2, seed=5) for r in (0, 1)]
    for _epoch in range(3):
        seen = []
        for _ in range(6):  # 6 steps x 2 ranks x 3 = 36 = one epoch
            for loader in loaders:
                seen += _row_ids(loader.next_batch(), rows)
        assert sorted(seen) == list(range(36))
    assert loaders[0].state_dict() == {"epoch": 3, "position": 0, "seed": 5, "num_sequences": 36}


def test_epochs_and_seeds_give_different_orders(packed_36):
    rows = read_all_rows(packed_36)
    a = PackedLoader(packed_36, batch_size=36, seed=0)
    b = PackedLoader(packed_36, batch_size=36, seed=1)
    first, second = _row_ids(a.next_batch(), rows), _row_ids(a.next_batch(), rows)
    assert first != second and first != _row_ids(b.next_batch(), rows)


def _run(loaders, steps):
    return [
        [{k: v.clone() for k, v in ld.next_batch().items()} for ld in loaders] for _ in range(steps)
    ]


def test_resume_mid_epoch_on_two_ranks_matches_uninterrupted(packed_36):
    def make():
        return [PackedLoader(packed_36, batch_size=5, rank=r, world_size=2, seed=7) for r in (0, 1)]

    reference = _run(make(), 20)  # 200 sequences: crosses five epoch boundaries mid-batch
    first = make()
    head = _run(first, 8)
    state = first[0].state_dict()
    assert state == first[1].state_dict() and state["position"] == 80 % 36
    resumed = make()
    for loader in resumed:
        loader.load_state_dict(dict(state))
    got = head + _run(resumed, 12)
    for step_ref, step_got in zip(reference, got, strict=True):
        for ref, out in zip(step_ref, step_got, strict=True):
            for key in ref:
                assert torch.equal(ref[key], out[key]), key


def test_batch_size_change_neither_repeats_nor_skips(packed_36):
    rows = read_all_rows(packed_36)
    one = PackedLoader(packed_36, batch_size=1, seed=2)
    reference = [_row_ids(one.next_batch(), rows)[0] for _ in range(50)]
    loader = PackedLoader(packed_36, batch_size=4, seed=2)
    got = []
    for size, steps in ((4, 3), (7, 2), (2, 12)):  # 12 + 14 + 24 = 50 sequences
        loader.set_batch_size(size)
        for _ in range(steps):
            got += _row_ids(loader.next_batch(), rows)
    assert got == reference


def test_state_is_small_and_bad_arguments_fail(packed_36):
    loader = PackedLoader(packed_36, batch_size=2)
    for _ in range(100):
        loader.next_batch()
    assert all(isinstance(v, int) for v in loader.state_dict().values())
    assert len(loader._perms) <= 2
    with pytest.raises(ValueError, match="rank=2"):
        PackedLoader(packed_36, batch_size=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size=0"):
        loader.set_batch_size(0)
    other = PackedLoader(packed_36, batch_size=2)
    with pytest.raises(ValueError, match="same packed dataset"):
        other.load_state_dict({**loader.state_dict(), "num_sequences": 5})


def test_large_vocabularies_use_uint32(tmp_path):
    from llmflow.tasks.dataprep.pack import write_packed

    tokens = np.array([70_000, 65_536, 3, EOS, 99_999, EOS], np.int64)
    meta = write_packed(
        [(tokens, [4, 2])], tmp_path, seq_len=2, vocab_size=100_000, eos_id=EOS, pad_id=PAD,
        seed=0, rows_per_shard=10,
    )  # fmt: skip
    assert meta["dtype"] == "uint32"
    assert sorted(read_all_rows(tmp_path).ravel().tolist()) == sorted(tokens.tolist())
    batch = PackedLoader(tmp_path, batch_size=2).next_batch()
    assert sorted(batch["input_ids"].ravel().tolist()) == sorted([70_000, 65_536, EOS, 99_999])
