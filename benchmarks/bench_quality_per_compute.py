"""Quality per compute on CPU: our trainer (WSD; AdamW, and Muon) against GPT-2 + AdamW + cosine.

Data (``--text-dir``): WikiText-2 validation split into its articles (an article starts at a
`` = Title = `` line; section titles are `` = = ... = = ``), and tinyshakespeare in
2,000-character chunks. 10% of the articles (seeded) and the last 10% of the Shakespeare chunks
are held out; the rest is packed for training with a byte-level BPE of 4,096 ids trained here on
the training documents only.

Arms, same width and depth, same tokens, steps and batch, same LR floor (``MIN_LR_RATIO`` of the
peak), each for ``--seeds`` seeds:

- ``ours_adamw``: `Transformer` through our `Trainer`, AdamW, WSD;
- ``ours_muon``: the same with ``optimizer.name: muon`` (Muon on hidden matrices, AdamW else);
- ``gpt2_adamw``: transformers' GPT-2 (learned positions, GELU MLP, LayerNorm), AdamW, cosine.

The headline ``ratio`` is GPT-2's held-out WikiText loss over the arm of the optimizer the
quickstart recipe configures (``configs/quickstart.yaml``, ``pretrain.train.optimizer.name``):
the benchmark measures the recipe as configured. ``better_optimizer`` names the ours arm with the
lower loss, which is what the quickstart should configure.

Attention scope: document masking on every arm, in training and evaluation (ours through
``cu_seqlens``; GPT-2 through a 4-D block-diagonal causal mask and positions restarting at
each document). Validation loss (token mean) on the held-out articles and on the held-out
Shakespeare, mean and std over seeds. The arms run in rotating order per seed. Prints ONE JSON line.

    python benchmarks/bench_quality_per_compute.py --text-dir DIR [--steps 120] [--seeds 3]
    python benchmarks/bench_quality_per_compute.py --text-dir DIR --quick   # seconds, for tests
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import emit  # noqa: E402
from llmflow.model.loss import IGNORE_INDEX, causal_lm_loss  # noqa: E402
from llmflow.tasks.dataprep.loader import PackedLoader  # noqa: E402
from llmflow.tasks.dataprep.pack import write_packed  # noqa: E402
from llmflow.tasks.pretrain.config import ScheduleConfig, TrainConfig  # noqa: E402
from llmflow.tasks.pretrain.schedule import lr_multiplier  # noqa: E402

VOCAB, SEQ, BATCH, LR, MIN_LR_RATIO, CHUNK = 4096, 128, 16, 3e-3, 0.1, 2000
FULL = dict(hidden_size=192, num_layers=4, num_heads=6, num_kv_heads=2, intermediate_size=576)
QUICK = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192)
ARMS = ("ours_adamw", "ours_muon", "gpt2_adamw")


def wiki_articles(text: str) -> list[str]:
    """WikiText articles: a new one starts at each `` = Title = `` line (not `` = = ``)."""
    articles, current = [], []
    for line in text.splitlines(keepends=True):
        if line.startswith(" = ") and not line.startswith(" = = ") and current:
            articles.append("".join(current))
            current = []
        current.append(line)
    articles.append("".join(current))
    return [a for a in articles if a.strip()]


def split_documents(text_dir: Path, seed: int = 0) -> dict[str, list[str]]:
    """Training documents and the two held-out sets (whole articles, the Shakespeare tail)."""
    articles = wiki_articles((text_dir / "wikitext2_valid.txt").read_text())
    play = (text_dir / "tinyshakespeare.txt").read_text()
    chunks = [play[i : i + CHUNK] for i in range(0, len(play), CHUNK)]
    order_ = np.random.default_rng(seed).permutation(len(articles))
    cut_wiki, cut_play = int(0.9 * len(articles)), int(0.9 * len(chunks))
    return {
        "train": [articles[i] for i in sorted(order_[:cut_wiki])] + chunks[:cut_play],
        "val_wiki": [articles[i] for i in sorted(order_[cut_wiki:])],
        "val_shakespeare": chunks[cut_play:],
    }


def _tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>"], show_progress=False)
    tokenizer.train_from_iterator(docs, trainer)
    return tokenizer


def build_data(work: Path, text_dir: Path) -> dict[str, Path]:
    """Pack each split (documents + eos) with a BPE trained on the training split."""
    splits = split_documents(text_dir)
    tokenizer = _tokenizer(splits["train"])
    dirs = {}
    for name, docs in splits.items():
        encoded = [np.array(e.ids + [0], np.int64) for e in tokenizer.encode_batch(docs)]
        out = work / name
        out.mkdir(parents=True)
        lengths = np.array([len(d) for d in encoded])
        write_packed([(np.concatenate(encoded), lengths)], out, seq_len=SEQ, vocab_size=VOCAB,
                     eos_id=0, pad_id=0, seed=0, rows_per_shard=4096)  # fmt: skip
        dirs[name] = out
    return dirs


def _train_config(width: dict, steps: int, seed: int, optimizer: str) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"preset": "debug", "overrides": {**width, "vocab_size": VOCAB,
                                                   "max_seq_len": SEQ}},
        "optimizer": {"name": optimizer, "lr": LR, "weight_decay": 0.1},
        "schedule": {"name": "wsd", "warmup_steps": max(steps // 20, 1), "decay_fraction": 0.2,
                     "min_lr_ratio": MIN_LR_RATIO},
        "batch": {"micro_batch_size": BATCH}, "max_steps": steps, "seed": seed,
        "checkpoint": {"interval": steps, "keep_last": 1}, "eval_batches": 1,
        "eval_interval": steps, "log_interval": max(steps // 4, 1), "progress_bar": False,
        "tracker": {"tensorboard": False}, "deterministic": False,
    })  # fmt: skip


def train_ours(data: dict, out: Path, width: dict, steps: int, seed: int, optimizer: str) -> dict:
    """Our Trainer on the training split; the trained model scored on both held-out sets."""
    from llmflow.tasks.pretrain.distributed import teardown_runtime
    from llmflow.tasks.pretrain.train import Trainer

    cfg = _train_config(width, steps, seed, optimizer)
    start = time.perf_counter()
    try:
        trainer = Trainer(cfg, data["train"], out, data["val_wiki"])
        summary = trainer.fit()
        model = trainer.model
    finally:
        teardown_runtime()
    seconds = time.perf_counter() - start

    def forward(batch):
        return model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])

    losses = {
        name: evaluate(forward, model, data[name]) for name in ("val_wiki", "val_shakespeare")
    }
    return {**losses, "wall_s": seconds, "final_train_loss": summary["final_loss"],
            "non_embedding_params": cfg.model_config_obj().num_parameters(non_embedding=True)}  # fmt: skip


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean causal mask within documents (a document starts at position 0)."""
    doc = torch.cumsum(position_ids == 0, dim=1)
    seq = position_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def _gpt2(width: dict, seed: int):
    """GPT-2 with the same width and depth.

    # NOTE: n_inner is chosen so GPT-2 has the same non-embedding parameters per layer as ours
    # (4 d^2 + 2 d n_inner = attention with GQA + 3 d i), so equal tokens are equal FLOPs.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    d, heads, kv = width["hidden_size"], width["num_heads"], width["num_kv_heads"]
    ours_per_layer = 2 * d * d + 2 * d * (d // heads) * kv + 3 * d * width["intermediate_size"]
    n_inner = (ours_per_layer - 4 * d * d) // (2 * d)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=d, n_layer=width["num_layers"],
                        n_head=heads, n_inner=n_inner, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, attn_implementation="sdpa", bos_token_id=0,
                        eos_token_id=0, pad_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).train()


def train_gpt2(data: dict, width: dict, steps: int, seed: int) -> dict:
    """GPT-2 with AdamW and warmup + cosine to the same floor, document-masked."""
    model = _gpt2(width, seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "wte" not in n]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2 or "wte" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": rest, "weight_decay": 0.0}], lr=LR,
                                  betas=(0.9, 0.95))  # fmt: skip
    schedule = ScheduleConfig(
        name="cosine", warmup_steps=max(steps // 20, 1), min_lr_ratio=MIN_LR_RATIO
    )
    loader = PackedLoader(data["train"], BATCH, seed=seed)

    def forward(batch):
        pos = batch["position_ids"]
        return model(input_ids=batch["input_ids"], position_ids=pos,
                     attention_mask=document_mask(pos)).logits  # fmt: skip

    start = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = LR * lr_multiplier(step, schedule, steps)
        batch = loader.next_batch()
        loss, _ = causal_lm_loss(forward(batch), batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    losses = {
        name: evaluate(forward, model, data[name]) for name in ("val_wiki", "val_shakespeare")
    }
    n = sum(p.numel() for n_, p in model.named_parameters() if "wte" not in n_ and "wpe" not in n_)
    return {**losses, "wall_s": seconds, "final_train_loss": loss.item(),
            "non_embedding_params": n}  # fmt: skip


@torch.no_grad()
def evaluate(forward, model: torch.nn.Module, val: Path) -> float:
    """Token-mean loss over every held-out row (one pass, fixed order)."""
    model.eval()
    loader = PackedLoader(val, BATCH, seed=0)
    batches = -(-loader.num_sequences // BATCH)
    total = count = 0.0
    for _ in range(batches):
        batch = loader.next_batch()
        loss, _ = causal_lm_loss(forward(batch), batch["labels"])
        n = float((batch["labels"] != IGNORE_INDEX).sum())
        total, count = total + loss.item() * n, count + n
    model.train()
    return total / count


def recipe_optimizer() -> str:
    """The optimizer the quickstart recipe pretrains with."""
    from llmflow.tasks.config import load_config

    return load_config(None, []).pretrain.train.optimizer.name


def mean_std(values: list[float]) -> dict:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": round(statistics.mean(values), 4), "std": round(std, 4)}


def run_arm(arm: str, data: dict, work: Path, width: dict, steps: int, seed: int) -> dict:
    if arm == "gpt2_adamw":
        return train_gpt2(data, width, steps, seed)
    optimizer = "muon" if arm == "ours_muon" else "adamw"
    return train_ours(data, work / f"{arm}-{seed}", width, steps, seed, optimizer)


def summarize(results: dict[str, list[dict]], steps: int) -> dict:
    tokens = steps * BATCH * SEQ
    out = {}
    for arm, runs in results.items():
        out[arm] = {
            "val_wiki": mean_std([r["val_wiki"] for r in runs]),
            "val_shakespeare": mean_std([r["val_shakespeare"] for r in runs]),
            "train_wall_s": mean_std([r["wall_s"] for r in runs]),
            "train_flops": 6 * runs[0]["non_embedding_params"] * tokens,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 steps (for tests)")
    parser.add_argument(
        "--text-dir", type=Path, required=True,
        help="Folder with wikitext2_valid.txt and tinyshakespeare.txt.",
    )  # fmt: skip
    args = parser.parse_args()
    if not args.text_dir.is_dir():
        parser.error(f"--text-dir {args.text_dir} is not a folder")
    width, steps = (QUICK, 8) if args.quick else (FULL, args.steps)
    torch.set_num_threads(2)
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        data = build_data(Path(tmp), args.text_dir)
        for seed in range(args.seeds):
            for arm in ARMS[seed % len(ARMS) :] + ARMS[: seed % len(ARMS)]:  # rotate the order
                results[arm].append(run_arm(arm, data, Path(tmp), width, steps, seed))
        rows = {
            n: json.loads((d / "meta.json").read_text())["num_sequences"] for n, d in data.items()
        }
    summary = summarize(results, steps)
    wiki = {arm: s["val_wiki"]["mean"] for arm, s in summary.items()}
    recipe = f"ours_{recipe_optimizer()}"
    emit(
        "quality_per_compute",
        ratio=round(wiki["gpt2_adamw"] / wiki[recipe], 4),
        ratio_means=f"GPT-2 mean held-out WikiText loss / ours ({recipe}, the quickstart's "
        "optimizer); above 1: ours better",
        recipe_optimizer=recipe,
        ratio_adamw=round(wiki["gpt2_adamw"] / wiki["ours_adamw"], 4),
        ratio_muon=round(wiki["gpt2_adamw"] / wiki["ours_muon"], 4),
        better_optimizer=min(("ours_adamw", "ours_muon"), key=wiki.get),
        wall_time_ratio=round(
            summary["gpt2_adamw"]["train_wall_s"]["mean"] / summary[recipe]["train_wall_s"]["mean"],
            3,
        ),  # fmt: skip
        rounds=args.seeds,
        identical_work=True,
        identical_work_means="same tokens, steps, batch, width, depth, LR floor, attention scope",
        attention_scope="document masking on every arm (training and evaluation)",
        lr_floor=MIN_LR_RATIO,
        setup=f"{steps} steps x {BATCH}x{SEQ} tokens, BPE {VOCAB}, width {width['hidden_size']}, "
        f"{width['num_layers']} layers, seeds 0..{args.seeds - 1}",
        rows=rows,
        arms=summary,
    )


if __name__ == "__main__":
    main()
