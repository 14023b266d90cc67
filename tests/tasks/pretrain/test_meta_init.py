"""Meta-device init under FSDP2: two gloo ranks materialize only their shards, yet the gathered
weights equal a one-process seeded init bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import TINY_MODEL

from llmflow.model.config import preset
from llmflow.model.transformer import INIT_BLOCK_ROWS, Transformer, normal_rows

# vocab 2500 rows: embedding rows span three init blocks, split unevenly between the ranks.
MODEL = {**TINY_MODEL, "vocab_size": 2 * INIT_BLOCK_ROWS + 452, "num_layers": 3}

WORKER = textwrap.dedent(
    """
    import sys, torch
    from llmflow.model.config import preset
    from llmflow.model.transformer import Transformer
    from llmflow.tasks.pretrain.distributed import (
        materialize_sharded, param_checksum, setup_runtime, shard_model, sharding_report,
        teardown_runtime,
    )

    rt = setup_runtime()
    with torch.device("meta"):
        model = Transformer(preset("debug", **{overrides}))
    shard_model(model, rt)
    materialize_sharded(model, rt, seed=11)
    report = sharding_report(model)
    assert report["num_sharded"] == report["num_params"], report
    checksum = param_checksum(model)
    full = {{k: v.full_tensor() for k, v in model.state_dict().items()}}
    if rt.rank == 0:
        torch.save({{"state": full, "checksum": checksum, "report": report}}, sys.argv[1])
    teardown_runtime()
    """
)


def test_meta_init_on_two_ranks_equals_single_process_init(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(overrides=repr(MODEL)))
    out = tmp_path / "state.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", str(script), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = torch.load(out)

    reference = Transformer(preset("debug", **MODEL))
    reference.init_weights(seed=11)
    expected = reference.state_dict()
    assert sorted(got["state"]) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got["state"][name], tensor), name
    assert got["report"]["local_numel"] < 0.6 * got["report"]["global_numel"]
    with torch.no_grad():
        single = sum((p.double() * (i + 1)).sum() for i, p in enumerate(reference.parameters()))
    assert got["checksum"] == pytest.approx(float(single), rel=1e-12)


def test_seeded_rows_are_the_same_whatever_range_is_drawn():
    shape = (3 * INIT_BLOCK_ROWS + 7, 5)
    full = normal_rows(shape, 0, shape[0], 0.02, seed=3, key="w")
    for start, stop in [(0, 1), (INIT_BLOCK_ROWS - 2, INIT_BLOCK_ROWS + 3), (1500, shape[0])]:
        assert torch.equal(normal_rows(shape, start, stop, 0.02, 3, "w"), full[start:stop])
    assert not torch.equal(normal_rows(shape, 0, 8, 0.02, 3, "v"), full[:8])
    assert not torch.equal(normal_rows(shape, 0, 8, 0.02, 4, "w"), full[:8])
    assert abs(float(full.std()) - 0.02) < 1e-3


def test_seeded_init_on_meta_then_to_empty_equals_eager_init():
    with torch.device("meta"):
        meta = Transformer(preset("debug", **MODEL))
    meta.to_empty(device="cpu")
    meta.init_weights(seed=5)
    eager = Transformer(preset("debug", **MODEL))
    eager.init_weights(seed=5)
    for (name, a), b in zip(meta.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(meta.rope.inv_freq, eager.rope.inv_freq)
