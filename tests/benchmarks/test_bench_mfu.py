"""bench_mfu: the peak read from a device's name, and ``--quick`` on a CPU (so CI keeps the
GPU benchmark's script alive): both sides start from the same loss, FLOPs per token by hand;
``--packed`` adds our causal side in the same rounds, next to ours, and names the kernels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.bench_mfu import QUICK, batches, peak_for_name, with_causal
from benchmarks.common import paired_order

REPO = Path(__file__).resolve().parents[2]


def test_the_peak_is_read_from_the_device_name():
    assert peak_for_name("NVIDIA H100 80GB HBM3") == 989e12  # SXM
    assert peak_for_name("NVIDIA H200") == 989e12
    assert peak_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_for_name("Tesla T4") is None


def test_quick_mode_runs_on_cpu_with_both_sides_from_the_same_weights():
    out = subprocess.run(
        [sys.executable, "bench_mfu.py", "--quick", "--rounds", "1", "--steps", "1",
         "--warmup", "0", "--no-compile"],
        cwd=REPO / "benchmarks", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert record["bench"] == "mfu_quick_cpu" and record["identical_work"] is True
    first = record["first_step_loss"]
    assert abs(first["ours_eager"] - first["smollm3_eager"]) < 2e-2
    c, layers, v, i, t = (QUICK[k] for k in ("hidden_size", "num_layers", "vocab_size",
                                             "intermediate_size", "max_seq_len"))  # fmt: skip
    kv = QUICK["num_kv_heads"] * c // QUICK["num_heads"]
    non_embedding = layers * (c * (c + 2 * kv) + c * c + 3 * c * i + 2 * c) + c
    assert record["flops_per_token"] == 6 * (non_embedding + v * c) + 12 * layers * c * t
    assert record["mfu"] == {"ours_eager": None, "smollm3_eager": None}  # no peak on a CPU
    assert set(record["tokens_per_s"]) == {"ours_eager", "smollm3_eager"}


def flops_by_hand(seq: int) -> int:
    c, layers, v, i = (QUICK[k] for k in ("hidden_size", "num_layers", "vocab_size",
                                          "intermediate_size"))  # fmt: skip
    kv = QUICK["num_kv_heads"] * c // QUICK["num_heads"]
    non_embedding = layers * (c * (c + 2 * kv) + c * c + 3 * c * i + 2 * c) + c
    return 6 * (non_embedding + v * c) + 12 * layers * c * seq


def test_quick_packed_mode_times_the_causal_rows_beside_and_names_the_kernels():
    out = subprocess.run(
        [sys.executable, "bench_mfu.py", "--quick", "--rounds", "2", "--steps", "1",
         "--warmup", "0", "--no-compile", "--packed", "16"],
        cwd=REPO / "benchmarks", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert record["packed_doc_len"] == 16 and record["identical_work"] is True
    assert record["attention_kernels"] == ["sdpa-buckets", "sdpa-causal"]
    assert set(record["tokens_per_s"]) == {"ours_eager", "smollm3_eager", "ours_eager_causal"}
    tps = record["tokens_per_s"]
    assert set(record["packed_vs_causal"]) == {"eager"} and record["packed_vs_causal"]["eager"] > 0
    assert len(record["packed_vs_causal_ranges"]["eager"]) == 2
    assert tps["ours_eager"] > 0 and tps["ours_eager_causal"] > 0
    # a packed token attends over its document, a causal one over the row
    assert record["flops_per_token"] == flops_by_hand(16)
    assert record["flops_per_token_causal"] == flops_by_hand(QUICK["max_seq_len"])


def test_the_causal_side_runs_next_to_ours_each_round_on_alternate_sides():
    calls = with_causal(paired_order([("ours", "peer")], 4), "ours", "causal")
    assert calls == ["causal", "ours", "peer", "peer", "ours", "causal",
                     "causal", "ours", "peer", "peer", "ours", "causal"]  # fmt: skip


def test_packed_batches_restart_positions_and_share_targets_with_the_causal_side():
    ids = torch.arange(12).view(1, 12)
    sides = batches(ids, 4)
    packed, causal = sides["packed"], sides["causal"]
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 3] * 3
    assert "position_ids" not in causal and torch.equal(causal["labels"], packed["labels"])
    assert packed["labels"][0].tolist() == [1, 2, 3, -100, 5, 6, 7, -100, 9, 10, 11, -100]
    assert torch.equal(packed["labels"][:, :-1], packed["hf_labels"][:, 1:])  # shifted inside
    assert set(batches(ids, None)) == {"rows"}
