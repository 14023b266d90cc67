"""Train-step throughput on CPU: our Transformer against transformers' SmolLM3ForCausalLM.

Same shapes (hidden 256, 6 layers, 8 heads / 2 KV heads, intermediate 768, vocab 8192, tied
embeddings, NoPE every 4th layer as SmolLM3 does), batch 8 x 256, fp32, sdpa, AdamW, gradient
clipping at 1.0, ``torch.set_num_threads(2)``. Both step the same way: forward, loss, backward,
clip, optimizer step, zero_grad. Rounds alternate between the two so machine load hits both
alike; the figure is the median over rounds. Prints ONE JSON line.

    python benchmarks/bench_train_step.py [--rounds 5] [--steps 4] [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from llmflow.model.config import ModelConfig
from llmflow.model.loss import causal_lm_loss
from llmflow.model.transformer import Transformer
from llmflow.tasks.pretrain.config import OptimizerConfig
from llmflow.tasks.pretrain.optim import build_optimizers

SHAPES = dict(vocab_size=8192, hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=2,
              intermediate_size=768, max_seq_len=256, tie_embeddings=True, nope_interval=4)  # fmt: skip
BATCH, SEQ = 8, 256


def ours(compile_blocks: bool, fused: bool):
    """Our model with the trainer's optimizer groups; returns a step function."""
    model = Transformer(ModelConfig(**SHAPES))
    model.init_weights(seed=0)
    if compile_blocks:  # NOTE: per block, as the trainer does (cfg.compile)
        for block in model.layers:
            block.compile()
    (optimizer,) = build_optimizers(model, OptimizerConfig(lr=1e-3, fused=fused))
    return train_step(model, optimizer, lambda ids, labels: causal_lm_loss(model(ids), labels)[0])


def train_step(model, optimizer, loss_of):
    """One training step, the same for both models: loss, backward, clip, step."""

    def step(ids: torch.Tensor, labels: torch.Tensor) -> float:
        loss = loss_of(ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def smollm3():
    """transformers' SmolLM3ForCausalLM with the same shapes, torch AdamW (HF Trainer default)."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    config = SmolLM3Config(
        vocab_size=SHAPES["vocab_size"], hidden_size=SHAPES["hidden_size"],
        intermediate_size=SHAPES["intermediate_size"], num_hidden_layers=SHAPES["num_layers"],
        num_attention_heads=SHAPES["num_heads"], num_key_value_heads=SHAPES["num_kv_heads"],
        max_position_embeddings=SEQ, tie_word_embeddings=True, no_rope_layer_interval=4,
        # NOTE: SmolLM3Config's default pad id 128004 is outside a small vocab.
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
    )  # fmt: skip
    model = SmolLM3ForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return train_step(model, optimizer, lambda ids, labels: model(input_ids=ids, labels=ids).loss)


def timed(step, ids, labels, steps: int) -> float:
    """Tokens per second over ``steps`` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        step(ids, labels)
    return steps * ids.numel() / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    ids = torch.randint(0, SHAPES["vocab_size"], (BATCH, SEQ + 1))
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    steps = {"ours_eager": ours(False, fused=False), "ours_fused_adamw": ours(False, fused=True),
             "smollm3": smollm3()}  # fmt: skip
    if not args.no_compile:
        steps["ours_compiled"] = ours(True, fused=True)
    for step in steps.values():  # warmup (and compilation)
        for _ in range(args.warmup):
            step(inputs, labels)
    results: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            results[name].append(timed(step, inputs, labels, args.steps))
    median = {name: statistics.median(v) for name, v in results.items()}
    best = max((n for n in median if n.startswith("ours")), key=median.get)
    print(json.dumps({
        "benchmark": "train_step_cpu",
        "shape": f"h256 L6 H8/2 I768 V8192 tied, batch {BATCH}x{SEQ}, fp32, sdpa, 2 threads",
        "ours_tokens_per_s": round(median[best], 1),
        "ours_variant": best,
        "smollm3_tokens_per_s": round(median["smollm3"], 1),
        "ratio": round(median[best] / median["smollm3"], 3),
        "variants_tokens_per_s": {k: round(v, 1) for k, v in median.items()},
        "rounds": args.rounds, "steps_per_round": args.steps,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
