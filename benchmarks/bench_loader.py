"""PackedLoader cost: time per batch against a train step, and RSS growth over a 1 GB dataset.

1. Time: loader batches (8 x 256) and train steps of `Transformer(preset("debug"))`
   (forward + backward + AdamW on the same loader's batches), in alternating wall-time rounds.
   The ratio is a train step's median wall time over a loader batch's: how many batches the
   loader could produce in one step.
2. Memory: a generated packed dataset of ``--gib`` GiB (default 1.0) is read for
   ``--epochs`` epochs (default 1.25, so the second epoch's permutation is built) in a child
   process that imports only the loader. RSS (``VmRSS``) is read after the imports and the
   loader's construction, after 10 batches and at the end; the growth in MiB is the headline.
   The loader reads with ``pread``, so file pages do not count towards RSS.

Prints ONE JSON line.

    python benchmarks/bench_loader.py [--gib 1.0] [--epochs 1.25] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import alternate, emit, ratio  # noqa: E402
from llmflow.tasks.dataprep.loader import PackedLoader  # noqa: E402
from llmflow.tasks.dataprep.pack import write_packed  # noqa: E402

BATCH, SEQ_LEN, VOCAB = 8, 256, 8192
RSS_BATCH = 64
CHUNK_TOKENS = 1 << 25


def _chunks(num_tokens: int, seed: int):
    """Random eos-terminated documents (20..2000 tokens) in chunks of ~32M tokens."""
    rng, made = np.random.default_rng(seed), 0
    while made < num_tokens:
        lengths = rng.integers(20, 2000, CHUNK_TOKENS // 1000)
        tokens = rng.integers(5, VOCAB, int(lengths.sum()), dtype=np.uint16)
        tokens[np.cumsum(lengths) - 1] = 0  # eos
        made += len(tokens)
        yield tokens, lengths


def make_dataset(out_dir: Path, gib: float, seed: int = 0) -> int:
    """A packed dataset of at least ``gib`` GiB of uint16 tokens; returns its bytes on disk."""
    write_packed(
        _chunks(int(gib * 2**30) // 2, seed),
        out_dir,
        seq_len=SEQ_LEN,
        vocab_size=VOCAB,
        eos_id=0,
        pad_id=2,
        seed=seed,
        rows_per_shard=65536,
    )
    return sum(p.stat().st_size for p in out_dir.glob("shard_*.bin"))


def _rss_mib() -> float:
    """Resident set size now (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def rss_child(data_dir: Path, epochs: float) -> None:
    """Run in a child that imports only the loader: print RSS after setup, 10 batches, the end."""
    loader = PackedLoader(data_dir, batch_size=RSS_BATCH)
    steps = max(int(epochs * loader.num_sequences / RSS_BATCH), 11)
    rss = {"after_setup": _rss_mib()}
    for step in range(1, steps + 1):
        loader.next_batch()
        if step == 10:
            rss["after_10"] = _rss_mib()
    rss["at_end"] = _rss_mib()
    print(json.dumps({"rss_mib": rss, "steps": steps, "epoch": loader.epoch}))


def measure_rss(data_dir: Path, epochs: float) -> dict:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from benchmarks.bench_loader import "
        "rss_child; from pathlib import Path; rss_child(Path(sys.argv[2]), float(sys.argv[3]))"
    )
    args = [sys.executable, "-c", code, str(ROOT), str(data_dir), str(epochs)]
    start = time.perf_counter()
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=900)
    child = json.loads(out.stdout.strip().splitlines()[-1])
    child["seconds"] = time.perf_counter() - start
    return child


def _train_step_fn(data_dir: Path):
    """A closure doing one forward+backward+AdamW step of the debug Transformer."""
    import torch

    from llmflow.model.config import preset
    from llmflow.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(preset("debug", vocab_size=VOCAB))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = PackedLoader(data_dir, batch_size=BATCH)

    def step() -> None:
        batch = loader.next_batch()
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in model.parameters())


def time_per_batch(data_dir: Path, rounds: int) -> tuple[dict, int]:
    """Wall seconds per loader batch and per train step, in alternating rounds."""
    import torch

    torch.set_num_threads(2)
    loader = PackedLoader(data_dir, batch_size=BATCH)
    step, num_params = _train_step_fn(data_dir)
    batches, steps = 200, 3

    def load() -> None:
        for _ in range(batches):
            loader.next_batch()

    def train() -> None:
        for _ in range(steps):
            step()

    times = alternate({"train_step": train, "loader_batch": load}, rounds, warmup=True)
    times["train_step"] = [t / steps for t in times["train_step"]]
    times["loader_batch"] = [t / batches for t in times["loader_batch"]]
    return times, num_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the generated dataset")
    parser.add_argument("--epochs", type=float, default=1.25, help="epochs read for the RSS")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        size = make_dataset(data, args.gib)
        child = measure_rss(data, args.epochs)
        times, num_params = time_per_batch(data, args.rounds)
    rss = child["rss_mib"]
    emit(
        "loader",
        ratio=ratio(times, "train_step", "loader_batch"),
        ratio_means="train step median wall s / loader batch median wall s",
        rounds=args.rounds,
        identical_work=True,
        identical_work_means="both sides read the same packed dataset with the same batch",
        rss_growth_mib=round(rss["at_end"] - rss["after_10"], 1),
        rss_growth_since_setup_mib=round(rss["at_end"] - rss["after_setup"], 1),
        rss_mib=rss,
        rss_batches=child["steps"],
        rss_batch=[RSS_BATCH, SEQ_LEN],
        rss_epochs_read=args.epochs,
        dataset_bytes=size,
        batch=[BATCH, SEQ_LEN],
        model_params=num_params,
        seconds=times,
    )


if __name__ == "__main__":
    main()
