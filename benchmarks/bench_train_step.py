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
- ``compiled``: each decoder layer ``torch.compile``d (as our trainer does), default AdamW, both;
- ``packed``: no compile, default AdamW, a batch of 4 x 2,048 tokens in documents of 256
  (``--packed-shape``): ours given ``position_ids`` restarting at each document (per-document
  attention, no T x T mask), SmolLM3 the same ``position_ids``, no attention mask and
  ``use_cache=False``, from which transformers builds its block-diagonal document mask. No target
  crosses a document boundary on either side.

In each round every pair's two sides run back to back (the pairs rotate, and which side goes
first swaps each round), and the round's ratio is SmolLM3's time over ours; a pair's figure is
the median of its per-round ratios, reported with their range (``ratio_range``), so a margin
smaller than the spread shows as such. ``identical_work`` says that both sides' first-step
losses from the same weights agree within 1e-4 (for ``packed``: both attend within documents).
Prints ONE JSON line.

    python benchmarks/bench_train_step.py [--rounds 9] [--steps 4] [--no-compile] [--no-packed]
        [--packed-shape ROWS TOKENS DOC_LEN]

NOTE: transformers detects packed rows from ``position_ids`` only without a cache: with the
config's default ``use_cache=True`` a training forward builds a ``DynamicCache``, the packed
check is skipped, and every token attends across the whole row.

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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script or imported

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    alternate,
    emit,
    hf_adamw,
    paired_order,
    per_round_ratios,
)
from llmflow.model.config import ModelConfig  # noqa: E402
from llmflow.model.hf import to_hf_state_dict  # noqa: E402
from llmflow.model.hf_arch import hf_config  # noqa: E402
from llmflow.model.loss import IGNORE_INDEX  # noqa: E402
from llmflow.model.transformer import Transformer  # noqa: E402
from llmflow.tasks.pretrain.config import OptimizerConfig  # noqa: E402
from llmflow.tasks.pretrain.optim import build_optimizers  # noqa: E402

SHAPES = dict(vocab_size=8192, hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=2,
              intermediate_size=768, max_seq_len=256, tie_embeddings=True, nope_interval=4)  # fmt: skip
BATCH, SEQ = 8, 256
PACKED = (4, 2048, 256)
"""The packed pair's rows, tokens per row and tokens per document."""
OPTIM = OptimizerConfig(lr=1e-3)


def ours(compile_blocks: bool, fused: bool):
    """Our model with the trainer's loss and optimizer groups; returns (model, step)."""
    model = Transformer(ModelConfig(**SHAPES))
    model.init_weights(seed=0)
    if compile_blocks:  # NOTE: per block, as the trainer does (cfg.compile)
        for block in model.layers:
            block.compile()
    (optimizer,) = build_optimizers(model, OPTIM.model_copy(update={"fused": fused}))

    return model, train_step(model, optimizer, lambda batch: ours_loss(model, batch))


def smollm3(compile_layers: bool, fused: bool, weights: dict[str, torch.Tensor]):
    """transformers' SmolLM3ForCausalLM with the same shapes and weights; returns (model, step)."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    # NOTE: from our export's config, not SmolLM3Config's defaults: those put RoPE's base at
    # 2,000,000 (ours 10,000) and the pad id 128004 outside a small vocabulary
    config = SmolLM3Config.from_dict(hf_config(ModelConfig(**SHAPES)), attn_implementation="sdpa")
    model = SmolLM3ForCausalLM(config).train()
    model.load_state_dict(weights, strict=False)  # lm_head.weight is the tied embedding
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    optimizer = hf_adamw(model, OPTIM, fused)

    return model, train_step(model, optimizer, lambda batch: smollm3_loss(model, batch))


def ours_loss(model: Transformer, batch: dict) -> torch.Tensor:
    """Our trainer's loss on a batch of `batch_of` (packed: ``position_ids`` given)."""
    return model(batch["ids"], batch.get("position_ids"), labels=batch["labels"])[0]


def smollm3_loss(model, batch: dict) -> torch.Tensor:
    """SmolLM3's loss as its users call it (labels shifted inside); packed rows get their
    ``position_ids`` and no attention mask."""
    if "position_ids" not in batch:
        return model(input_ids=batch["ids"], labels=batch["hf_labels"]).loss
    # NOTE: use_cache=False: a training forward otherwise builds a DynamicCache (the config's
    # default), transformers then skips its packed-rows check and attends across documents
    return model(input_ids=batch["ids"], position_ids=batch["position_ids"],
                 labels=batch["hf_labels"], use_cache=False).loss  # fmt: skip


def train_step(model, optimizer, loss_of):
    """One training step, the same for both models: loss, backward, clip, step."""

    def step(batch: dict) -> float:
        loss = loss_of(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def batch_of(rows: int, seq: int, doc_len: int | None = None) -> dict[str, torch.Tensor]:
    """Token ids and each side's targets; with ``doc_len``, rows packed with documents of that
    length: ``position_ids`` restart at each, and a document's last token has no target.

    Keys: ``ids``; ``labels`` (ours, aligned with the logits, -100 for no loss);
    ``hf_labels`` (transformers', shifted inside its loss); ``position_ids`` when packed.
    """
    ids = torch.randint(0, SHAPES["vocab_size"], (rows, seq), generator=torch.Generator())
    labels = torch.cat([ids[:, 1:], torch.full((rows, 1), IGNORE_INDEX)], dim=1)
    if doc_len is None:
        return {"ids": ids, "labels": labels, "hf_labels": ids}
    positions = torch.arange(seq) % doc_len
    labels[:, positions == doc_len - 1] = IGNORE_INDEX  # the next token starts a document
    hf_labels = ids.clone()
    hf_labels[:, (positions == 0) & (torch.arange(seq) > 0)] = IGNORE_INDEX
    return {"ids": ids, "labels": labels, "hf_labels": hf_labels,
            "position_ids": positions.expand(rows, -1).contiguous()}  # fmt: skip


def build(compile_: bool, packed: bool) -> dict[str, tuple]:
    """Every (side, variant) -> (model, step)."""
    variants = {"eager": (False, False), "fused_adamw": (False, True)}
    if compile_:
        variants["compiled"] = (True, False)
    if packed:
        variants["packed"] = (False, False)
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
    parser.add_argument("--no-packed", action="store_true", help="without the packed pair")
    parser.add_argument("--packed-shape", type=int, nargs=3, default=PACKED,
                        metavar=("ROWS", "TOKENS", "DOC_LEN"), help="the packed pair's batch")  # fmt: skip
    args = parser.parse_args()
    rows, seq, doc_len = args.packed_shape
    if min(rows, seq, doc_len) < 1 or seq % doc_len or seq == doc_len:
        parser.error(f"--packed-shape {rows} {seq} {doc_len}: TOKENS must be a multiple "
                     "(>= 2x) of DOC_LEN, all >= 1")  # fmt: skip
    torch.set_num_threads(2)
    if args.breakdown:
        breakdown(args.rounds)
        return
    plain = batch_of(BATCH, SEQ)
    packed = batch_of(rows, seq, doc_len)
    steps = build(not args.no_compile, not args.no_packed)
    batches = {name: packed if name.endswith("_packed") else plain for name in steps}
    first = {name: step(batches[name]) for name, step in steps.items()}
    for name, step in steps.items():
        for _ in range(args.warmup - 1):
            step(batches[name])

    def run(name):
        return lambda: [steps[name](batches[name]) for _ in range(args.steps)]

    pairs = [n.removeprefix("ours_") for n in steps if n.startswith("ours_")]
    calls = paired_order([(f"ours_{p}", f"smollm3_{p}") for p in pairs], args.rounds)
    seconds = alternate({name: run(name) for name in steps}, args.rounds, calls=calls)
    tps = {name: args.steps * batches[name]["ids"].numel() / statistics.median(s)
           for name, s in seconds.items()}  # fmt: skip
    per_round = {p: per_round_ratios(seconds, f"smollm3_{p}", f"ours_{p}") for p in pairs}
    same = all(abs(first[f"ours_{p}"] - first[f"smollm3_{p}"]) < 1e-4 for p in pairs)
    packed_shape = None if args.no_packed else (
        f"batch {rows}x{seq} in documents of {doc_len}, position_ids restarting; "
        "SmolLM3 the same position_ids, no attention mask, use_cache=False")  # fmt: skip
    emit(
        "train_step_cpu",
        shape=f"h256 L6 H8/2 I768 V8192 tied, batch {BATCH}x{SEQ}, fp32, sdpa, 2 threads",
        packed_shape=packed_shape,
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
