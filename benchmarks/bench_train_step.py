"""Train-step throughput on CPU: our Transformer against transformers' SmolLM3ForCausalLM, like for
like.

Same shapes (hidden 256, 6 layers, 8 heads / 2 KV heads, intermediate 768, vocab 8192, tied
embeddings, NoPE every 4th layer as SmolLM3 does), batch 8 x 256, fp32, sdpa, gradient clipping
at 1.0, ``torch.set_num_threads(2)``, the same starting weights (ours exported to the HF layout)
and the same targets (the last position of each row takes no loss on either side). Each side
steps the way its users do: ours through the trainer's loss (``model(..., labels=...)``, the output
projection fused into the loss) and its optimizer groups; SmolLM3 through ``model(input_ids,
labels=...).loss``. Both use AdamW with the same hyperparameters and the same no-decay groups
(embeddings and norms). Three pairs, each compared with itself only:

- ``eager`` (the headline ``ratio``): no compile, torch's default AdamW on both;
- ``fused_adamw``: no compile, ``AdamW(fused=True)`` on both;
- ``compiled``: each decoder layer ``torch.compile``d (as our trainer does), default AdamW, both.

In each round every pair's two sides run back to back (the pairs rotate, and which side goes
first swaps each round), and the round's ratio is SmolLM3's time over ours; a pair's figure is
the median of its per-round ratios, reported with their range (``ratio_range``), so a margin
smaller than the spread shows as such. ``identical_work`` says that both sides' first-step
losses from the same weights agree within 1e-4. Prints ONE JSON line.

    python benchmarks/bench_train_step.py [--rounds 9] [--steps 4] [--no-compile]

``--breakdown`` instead times the eager step's parts on both sides (alternating rounds): the
decoder body's forward+backward (embedding to final norm), the output projection with its loss,
and clipping plus the optimizer; and the floor no implementation of these matmuls can go under:
the step's matrix-multiply FLOPs at the rate torch's GEMM reaches on the body's largest
projection, plus the attention kernel both sides call (SDPA), plus the optimizer. It prints the
largest eager ratio that floor allows.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import alternate, emit, hf_adamw, paired_order, per_round_ratios

from llmflow.model.config import ModelConfig
from llmflow.model.hf import to_hf_state_dict
from llmflow.model.loss import IGNORE_INDEX
from llmflow.model.transformer import Transformer
from llmflow.tasks.pretrain.config import OptimizerConfig
from llmflow.tasks.pretrain.optim import build_optimizers

SHAPES = dict(vocab_size=8192, hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=2,
              intermediate_size=768, max_seq_len=256, tie_embeddings=True, nope_interval=4)  # fmt: skip
BATCH, SEQ = 8, 256
OPTIM = OptimizerConfig(lr=1e-3)


def ours(compile_blocks: bool, fused: bool):
    """Our model with the trainer's loss and optimizer groups; returns (model, step)."""
    model = Transformer(ModelConfig(**SHAPES))
    model.init_weights(seed=0)
    if compile_blocks:  # NOTE: per block, as the trainer does (cfg.compile)
        for block in model.layers:
            block.compile()
    (optimizer,) = build_optimizers(model, OPTIM.model_copy(update={"fused": fused}))

    def loss_of(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model(ids, labels=labels)[0]

    return model, train_step(model, optimizer, loss_of)


def smollm3(compile_layers: bool, fused: bool, weights: dict[str, torch.Tensor]):
    """transformers' SmolLM3ForCausalLM with the same shapes and weights; returns (model, step)."""
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
    model.load_state_dict(weights, strict=False)  # lm_head.weight is the tied embedding
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    optimizer = hf_adamw(model, OPTIM, fused)

    def loss_of(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss  # shifted inside, as HF users call it

    return model, train_step(model, optimizer, loss_of)


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


def build(compile_: bool) -> dict[str, tuple]:
    """Every (side, variant) -> (model, step)."""
    variants = {"eager": (False, False), "fused_adamw": (False, True)}
    if compile_:
        variants["compiled"] = (True, False)
    steps = {}
    for name, (compiled, fused) in variants.items():
        model, steps[f"ours_{name}"] = ours(compiled, fused)
        weights = to_hf_state_dict(model.state_dict(), model.cfg)
        steps[f"smollm3_{name}"] = smollm3(compiled, fused, weights)[1]
    return steps


def breakdown(rounds: int) -> None:
    """Median ms of each part of the eager step, both sides, and the floor of any eager step."""
    import torch.nn.functional as F

    from llmflow.model.loss import linear_cross_entropy

    ids = torch.randint(0, SHAPES["vocab_size"], (BATCH, SEQ), generator=torch.Generator())
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), IGNORE_INDEX)], dim=1)
    model = Transformer(ModelConfig(**SHAPES))
    model.init_weights(seed=0)
    (ours_opt,) = build_optimizers(model, OPTIM)
    hf = smollm3(False, False, to_hf_state_dict(model.state_dict(), model.cfg))[0]
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=OPTIM.lr)
    hidden = torch.randn(BATCH, SEQ, SHAPES["hidden_size"], requires_grad=True)
    weight = model.embed.weight.detach().clone().requires_grad_()
    positions = torch.arange(SEQ)[None]

    def ours_body():
        x = model.embed(ids)
        rope = model.rope(positions, x.dtype)
        for layer in model.layers:
            x = layer(x, rope, None)
        model.norm(x).sum().backward()

    def optimizer_step(m, opt):
        def run():
            for p in m.parameters():
                p.grad = torch.ones_like(p)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return run

    head_dim = SHAPES["hidden_size"] // SHAPES["num_heads"]
    q = torch.randn(BATCH, SHAPES["num_heads"], SEQ, head_dim, requires_grad=True)
    kv = torch.randn(BATCH, SHAPES["num_kv_heads"], SEQ, head_dim, requires_grad=True)

    def sdpa():  # one layer's attention, forward and backward
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True).sum().backward()

    a, b = torch.randn(BATCH * SEQ, SHAPES["hidden_size"]), model.layers[0].mlp.gate_up_proj.weight
    parts = {
        "ours_body": ours_body,
        "smollm3_body": lambda: hf.model(input_ids=ids).last_hidden_state.sum().backward(),
        "ours_loss": lambda: linear_cross_entropy(hidden, weight, labels)[0].backward(),
        "smollm3_loss": lambda: hf.loss_function(
            F.linear(hidden, weight), ids, vocab_size=SHAPES["vocab_size"]
        ).backward(),
        "ours_optimizer": optimizer_step(model, ours_opt),
        "smollm3_optimizer": optimizer_step(hf, hf_opt),
        "gemm": lambda: [a @ b.detach().t() for _ in range(10)],
        "sdpa_layer": sdpa,
    }
    with torch.no_grad():
        for fn in ("ours_optimizer", "smollm3_optimizer"):
            parts[fn]()  # the optimizer states exist before the rounds
    seconds = alternate(parts, rounds=rounds, warmup=True)
    ms = {k: 1000 * statistics.median(v) for k, v in seconds.items()}
    gemm_rate = 10 * 2 * a.shape[0] * a.shape[1] * b.shape[0] / (ms["gemm"] / 1000)
    tokens, c, v = BATCH * SEQ, SHAPES["hidden_size"], SHAPES["vocab_size"]
    linear = sum(p.numel() for n, p in model.layers.named_parameters() if p.ndim == 2)
    flops = 3 * 2 * tokens * (linear + v * c)  # forward, input and weight gradients
    floor = 1000 * flops / gemm_rate + SHAPES["num_layers"] * ms["sdpa_layer"]
    floor += ms["ours_optimizer"]
    steps = {side: sum(ms[f"{side}_{p}"] for p in ("body", "loss", "optimizer"))
             for side in ("ours", "smollm3")}  # fmt: skip
    emit(
        "train_step_breakdown",
        ms={k: round(x, 1) for k, x in ms.items() if k != "gemm"},
        step_ms={k: round(x, 1) for k, x in steps.items()},
        ratio=round(steps["smollm3"] / steps["ours"], 3),
        gemm_gflops=round(gemm_rate / 1e9, 1),
        matmul_gflop_per_step=round(flops / 1e9, 1),
        floor_ms=round(floor, 1),
        max_eager_ratio=round(steps["smollm3"] / floor, 3),
        rounds=rounds,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=4, help="train steps per timed call")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (and compilation)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--breakdown", action="store_true", help="time the eager step's parts")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.breakdown:
        breakdown(args.rounds)
        return
    ids = torch.randint(0, SHAPES["vocab_size"], (BATCH, SEQ), generator=torch.Generator())
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), IGNORE_INDEX)], dim=1)
    steps = build(not args.no_compile)
    first = {name: step(ids, labels) for name, step in steps.items()}
    for step in steps.values():
        for _ in range(args.warmup - 1):
            step(ids, labels)

    def run(step):
        return lambda: [step(ids, labels) for _ in range(args.steps)]

    pairs = [n.removeprefix("ours_") for n in steps if n.startswith("ours_")]
    calls = paired_order([(f"ours_{p}", f"smollm3_{p}") for p in pairs], args.rounds)
    seconds = alternate({name: run(step) for name, step in steps.items()}, args.rounds, calls=calls)
    tokens = args.steps * ids.numel()
    tps = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    per_round = {p: per_round_ratios(seconds, f"smollm3_{p}", f"ours_{p}") for p in pairs}
    same = all(abs(first[f"ours_{p}"] - first[f"smollm3_{p}"]) < 1e-4 for p in pairs)
    emit(
        "train_step_cpu",
        shape=f"h256 L6 H8/2 I768 V8192 tied, batch {BATCH}x{SEQ}, fp32, sdpa, 2 threads",
        ratio=per_round["eager"]["median"],
        ratio_range=per_round["eager"]["range"],
        ratios={p: r["median"] for p, r in per_round.items()},
        ratio_ranges={p: r["range"] for p, r in per_round.items()},
        eager_round_ratios=per_round["eager"]["rounds"],
        tokens_per_s={k: round(v, 1) for k, v in tps.items()},
        first_step_loss={k: round(v, 6) for k, v in first.items()},
        rounds=args.rounds,
        steps_per_round=args.steps,
        identical_work=same,
    )


if __name__ == "__main__":
    main()
