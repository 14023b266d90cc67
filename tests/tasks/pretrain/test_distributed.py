"""FSDP2 over two CPU processes (gloo) against one process with the same global batch."""

from __future__ import annotations

import json

from conftest import losses_by_step, run_trainer, tiny_config


def test_two_process_fsdp_matches_single_process(tmp_path, train_data):
    steps = 20
    common = dict(max_steps=steps, checkpoint={"interval": 10, "keep_last": 1})
    single = tmp_path / "single"
    run_trainer(tiny_config(batch={"micro_batch_size": 4}, **common), train_data, single)
    double = tmp_path / "double"
    run_trainer(
        tiny_config(batch={"micro_batch_size": 2}, **common), train_data, double, num_processes=2
    )

    expected, got = losses_by_step(single), losses_by_step(double)
    assert sorted(got) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert abs(got[step] - expected[step]) <= 1e-4 * abs(expected[step]), step

    ranks = [json.loads((double / "ranks" / f"rank-{r:05d}.json").read_text()) for r in (0, 1)]
    # Identical initialisation on every rank, different data per rank.
    assert ranks[0]["init_checksum"] == ranks[1]["init_checksum"]
    assert ranks[0]["first_batch_sha256"] != ranks[1]["first_batch_sha256"]
    # Parameters really are sharded: every one is a DTensor with a Shard placement and each
    # rank holds about half of the elements.
    for info in ranks:
        assert info["world_size"] == 2
        assert info["num_sharded"] == info["num_params"]
        assert info["local_numel"] < 0.6 * info["global_numel"]
    assert json.loads((double / "summary.json").read_text())["world_size"] == 2

    # The 2-process checkpoint reloads in one process (DCP reshards) and keeps training.
    resumed = tiny_config(batch={"micro_batch_size": 4}, max_steps=steps)
    proc = run_trainer(resumed, train_data, double)
    assert "resumed from" in proc.stdout
