"""Gradient accumulation and batch-size warmup inside the trainer."""

from __future__ import annotations

import json

from conftest import SEQ_LEN, losses_by_step, read_jsonl, run_trainer, tiny_config


def test_accumulation_matches_one_big_batch_and_warmup_counts_tokens(tmp_path, train_data):
    common = dict(max_steps=6, checkpoint={"interval": 6, "keep_last": 1})
    run_trainer(tiny_config(batch={"micro_batch_size": 4}, **common), train_data, tmp_path / "a")
    accum = {"micro_batch_size": 2, "grad_accum_steps": 2}
    run_trainer(tiny_config(batch=accum, **common), train_data, tmp_path / "b")
    big, accumulated = losses_by_step(tmp_path / "a"), losses_by_step(tmp_path / "b")
    for step in big:
        assert abs(big[step] - accumulated[step]) <= 1e-5 * big[step], step

    ramp = {"micro_batch_size": 4, "warmup_start_micro_batch": 1, "warmup_steps": 3}
    run_trainer(tiny_config(batch=ramp, **common), train_data, tmp_path / "c")
    # micro-batches 1, 2, 3, then 4, 4, 4 sequences
    seen = [row["tokens_seen"] for row in read_jsonl(tmp_path / "c" / "metrics.jsonl")]
    assert seen == [SEQ_LEN * n for n in (1, 3, 6, 10, 14, 18)]
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["tokens_seen"] == 18 * SEQ_LEN
