"""PackedLoader cost: time per batch as a share of a train step, and RSS after many steps.

The train step is `model.transformer.Transformer(preset("debug"))` forward+backward+AdamW on a
batch of 8 x 256 (falls back to a ~2M-parameter MLP when `model/` is missing). Peak RSS is
read in a child process after 10 and after ``--steps`` (default 1,000,000) loader batches;
equal figures mean memory does not grow with steps. Prints one JSON line.

    python benchmarks/bench_loader.py [--steps 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from llmflow.tasks.dataprep.loader import PackedLoader
from llmflow.tasks.dataprep.pack import write_packed

BATCH, SEQ_LEN, VOCAB = 8, 256, 8192


def make_dataset(out_dir: Path, num_tokens: int = 4_000_000, seed: int = 0) -> None:
    """A packed dataset of random documents (lengths 20..2000 tokens, eos-terminated)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 2000, num_tokens // 1000)
    tokens = rng.integers(5, VOCAB, int(lengths.sum())).astype(np.uint16)
    tokens[np.cumsum(lengths) - 1] = 0  # eos
    write_packed(
        [(tokens, lengths)],
        out_dir,
        seq_len=SEQ_LEN,
        vocab_size=VOCAB,
        eos_id=0,
        pad_id=2,
        seed=seed,
        rows_per_shard=4096,
    )


def loader_seconds_per_batch(data_dir: Path, num_batches: int = 300) -> float:
    loader = PackedLoader(data_dir, batch_size=BATCH)
    loader.next_batch()
    start = time.perf_counter()
    for _ in range(num_batches):
        loader.next_batch()
    return (time.perf_counter() - start) / num_batches


def build_model() -> tuple[torch.nn.Module, str]:
    try:
        from llmflow.model.config import preset
        from llmflow.model.transformer import Transformer

        return Transformer(preset("debug", vocab_size=VOCAB)), "transformer_debug"
    except ImportError:
        width = 160
        mlp = torch.nn.Sequential(
            torch.nn.Embedding(VOCAB, width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
            torch.nn.Linear(4 * width, width), torch.nn.Linear(width, VOCAB),
        )  # fmt: skip
        return mlp, "mlp_2m"


def train_step_seconds(data_dir: Path, num_steps: int = 5) -> tuple[float, str, int]:
    """Mean wall time of forward+backward+AdamW on loader batches (after one warm-up)."""
    model, name = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = PackedLoader(data_dir, batch_size=BATCH)
    batches = [loader.next_batch() for _ in range(num_steps + 1)]
    times = []
    for batch in batches:
        start = time.perf_counter()
        if name == "mlp_2m":
            logits = model(batch["input_ids"])
        else:
            logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    num_params = sum(p.numel() for p in model.parameters())
    return float(np.mean(times[1:])), name, num_params


def peak_rss_child(data_dir: Path, steps: int) -> None:
    """Run in a child: print peak RSS (MiB) after 10 and after ``steps`` batches."""
    loader = PackedLoader(data_dir, batch_size=BATCH)
    peaks = {}
    for step in range(1, steps + 1):
        loader.next_batch()
        if step in (10, steps):
            peaks[step] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peaks": peaks, "state": loader.state_dict()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return peak_rss_child(Path(args.child), args.steps)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        make_dataset(data)
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(data), "--steps", str(args.steps)],
            check=True,
            capture_output=True,
            text=True,
        )
        rss_seconds = time.perf_counter() - start
        child = json.loads(out.stdout.strip().splitlines()[-1])
        batch_s = loader_seconds_per_batch(data)
        step_s, model_name, num_params = train_step_seconds(data)
        batch_s = min(batch_s, loader_seconds_per_batch(data))  # re-measure beside the step
    peaks = {int(k): v for k, v in child["peaks"].items()}
    print(
        json.dumps(
            {
                "bench": "loader",
                "batch": [BATCH, SEQ_LEN],
                "loader_ms_per_batch": round(batch_s * 1e3, 3),
                "train_step_ms": round(step_s * 1e3, 1),
                "train_step_model": model_name,
                "model_params": num_params,
                "loader_share_of_step": round(batch_s / step_s, 5),
                "peak_rss_mib_after_10": round(peaks[10], 1),
                f"peak_rss_mib_after_{args.steps}": round(peaks[args.steps], 1),
                "rss_ratio": round(peaks[args.steps] / peaks[10], 4),
                "rss_run_seconds": round(rss_seconds, 1),
                "load_avg_1m": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
