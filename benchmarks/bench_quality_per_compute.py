"""Quality per compute on CPU: our trainer (Transformer + WSD) against GPT-2 + AdamW + cosine.

Both models see the same packed tokens (WikiText-2 valid + tinyshakespeare from ``--text-dir``,
byte-level BPE with 4,096 ids trained here), the same number of steps and batch, the same width
and depth, and are scored on the same held-out rows. Training FLOPs are reported (6 N D) so the
comparison can be read per FLOP. Ours attends within documents (packed rows, cu_seqlens);
GPT-2 attends across document boundaries like a plain causal LM. Prints ONE JSON line.

    python benchmarks/bench_quality_per_compute.py --text-dir DIR [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from llmflow.model.loss import IGNORE_INDEX, causal_lm_loss
from llmflow.tasks.dataprep.loader import PackedLoader
from llmflow.tasks.dataprep.pack import write_packed
from llmflow.tasks.pretrain.config import ScheduleConfig, TrainConfig
from llmflow.tasks.pretrain.schedule import lr_multiplier

VOCAB, SEQ, BATCH, LR = 4096, 128, 16, 3e-3
WIDTH = dict(hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=2, intermediate_size=768)


def build_data(work: Path, text_dir: Path) -> tuple[Path, Path]:
    """Tokenize the texts with a fresh BPE; pack 95% of documents for training, 5% held out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = (text_dir / "wikitext2_valid.txt").read_text()
    text += (text_dir / "tinyshakespeare.txt").read_text()
    docs = [d for d in text.split("\n\n") if len(d.strip()) > 20]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>"])
    tokenizer.train_from_iterator(docs, trainer)
    encoded = [np.array(e.ids + [0], np.int64) for e in tokenizer.encode_batch(docs)]
    order = np.random.default_rng(0).permutation(len(encoded))
    cut = int(0.95 * len(order))
    dirs = []
    for name, idx in (("train", order[:cut]), ("val", order[cut:])):
        out = work / name
        out.mkdir(parents=True)
        chosen = [encoded[i] for i in sorted(idx)]
        lengths = np.array([len(d) for d in chosen])
        write_packed([(np.concatenate(chosen), lengths)], out, seq_len=SEQ, vocab_size=VOCAB,
                     eos_id=0, pad_id=0, seed=0, rows_per_shard=4096)  # fmt: skip
        dirs.append(out)
    return dirs[0], dirs[1]


def train_ours(train: Path, val: Path, out: Path, steps: int, val_batches: int) -> dict:
    from llmflow.tasks.pretrain.train import run

    cfg = TrainConfig.model_validate({
        "model": {"preset": "debug", "overrides": {**WIDTH, "vocab_size": VOCAB,
                                                   "max_seq_len": SEQ}},
        "optimizer": {"lr": LR, "weight_decay": 0.1, "fused": True},
        "schedule": {"name": "wsd", "warmup_steps": steps // 20, "decay_fraction": 0.2,
                     "min_lr_ratio": 0.0},
        "batch": {"micro_batch_size": BATCH}, "max_steps": steps,
        "checkpoint": {"interval": steps, "keep_last": 1}, "eval_batches": val_batches,
        "eval_interval": steps, "log_interval": max(steps // 10, 1), "progress_bar": False,
        "tracker": {"tensorboard": False}, "deterministic": False,
    })  # fmt: skip
    start = time.perf_counter()
    summary = run(cfg, train, out, val)
    n = cfg.model_config_obj().num_parameters(non_embedding=True)
    return {"val_loss": summary["val_loss"], "wall_s": time.perf_counter() - start,
            "tokens_per_s": summary["tokens_per_s"],
            "non_embedding_params": n, "final_train_loss": summary["final_loss"]}  # fmt: skip


def train_gpt2(train: Path, val: Path, steps: int, val_batches: int) -> dict:
    """GPT-2 (learned positions, GELU MLP, LayerNorm) with AdamW and warmup + cosine.

    # NOTE: n_inner=960 gives GPT-2 the same non-embedding parameters per layer as ours
    # (4*256^2 + 2*256*960 = 12*32*256 + 256^2 + 3*256*768), so equal tokens are equal FLOPs.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH["hidden_size"],
                        n_layer=WIDTH["num_layers"], n_head=WIDTH["num_heads"],
                        n_inner=960, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "wte" not in n]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2 or "wte" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": rest, "weight_decay": 0.0}], lr=LR,
                                  betas=(0.9, 0.95), fused=True)  # fmt: skip
    schedule = ScheduleConfig(name="cosine", warmup_steps=steps // 20, min_lr_ratio=0.1)
    loader = PackedLoader(train, BATCH, seed=0)
    start = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = LR * lr_multiplier(step, schedule, steps)
        batch = loader.next_batch()
        ids = batch["input_ids"]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        loss, _ = causal_lm_loss(logits, batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    train_s = time.perf_counter() - start
    n = sum(p.numel() for n_, p in model.named_parameters() if "wte" not in n_ and "wpe" not in n_)
    tokens_per_s = steps * BATCH * SEQ / train_s
    return {"val_loss": evaluate_gpt2(model, val, val_batches), "tokens_per_s": tokens_per_s,
            "non_embedding_params": n, "final_train_loss": loss.item()}  # fmt: skip


@torch.no_grad()
def evaluate_gpt2(model: torch.nn.Module, val: Path, val_batches: int) -> float:
    """Token-mean loss on the same rows the trainer's evaluate() reads (same loader, seed 0)."""
    model.eval()
    loader = PackedLoader(val, BATCH, seed=0)
    total = count = 0.0
    for _ in range(val_batches):
        batch = loader.next_batch()
        ids = batch["input_ids"]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        loss, _ = causal_lm_loss(logits, batch["labels"])
        n = float((batch["labels"] != IGNORE_INDEX).sum())
        total, count = total + loss.item() * n, count + n
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--text-dir",
        type=Path,
        required=True,
        help="Folder with wikitext2_valid.txt and tinyshakespeare.txt.",
    )
    args = parser.parse_args()
    if not args.text_dir.is_dir():
        parser.error(f"--text-dir {args.text_dir} is not a folder")
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        train, val = build_data(Path(tmp), args.text_dir)
        num_val = json.loads((val / "meta.json").read_text())["num_sequences"]
        val_batches = max(num_val // BATCH, 1)
        ours = train_ours(train, val, Path(tmp) / "ours", args.steps, val_batches)
        gpt2 = train_gpt2(train, val, args.steps, val_batches)
    tokens = args.steps * BATCH * SEQ
    for result in (ours, gpt2):
        result["train_flops"] = 6 * result["non_embedding_params"] * tokens
    print(json.dumps({
        "benchmark": "quality_per_compute",
        "setup": f"{args.steps} steps x {BATCH}x{SEQ} tokens, BPE {VOCAB}, width 256, 6 layers",
        "ours_wsd_val_loss": round(ours["val_loss"], 4),
        "gpt2_cosine_val_loss": round(gpt2["val_loss"], 4),
        "val_loss_ratio": round(ours["val_loss"] / gpt2["val_loss"], 4),
        "ours_val_ppl": round(math.exp(ours["val_loss"]), 2),
        "gpt2_val_ppl": round(math.exp(gpt2["val_loss"]), 2),
        "ours_train_flops": ours["train_flops"], "gpt2_train_flops": gpt2["train_flops"],
        "ours_train_tokens_per_s": round(ours["tokens_per_s"], 1),
        "gpt2_train_tokens_per_s": round(gpt2["tokens_per_s"], 1),
        "tokens": tokens, "val_rows": val_batches * BATCH,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
