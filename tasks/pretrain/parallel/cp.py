"""Context parallelism: each rank of the ``cp`` mesh dimension holds 1/cp of every row's tokens.

The rows (B, T) are cut along T into ``2 * cp`` chunks and rank ``r`` keeps chunks ``r`` and
``2 * cp - 1 - r`` (the zig-zag split of torch's ``context_parallel`` and torchtitan): under a
causal mask an early chunk attends to few keys and a late one to many, so every rank gets the
same attention work. CP ranks read the same rows (the loader reads by data-parallel rank) and
hold the same parameters (FSDP2 shards over ``dp_shard_cp``).

What a rank computes (``model/attention.py``): its queries and everything else (embedding, MLP,
norms, loss) on its T/cp tokens; in every attention layer the keys and values of the whole rows
are all-gathered over the cp group (only the KV heads: GQA's smaller tensors), put back in row
order, and attended causally in row positions and within documents by
``model/context.py:SequenceShard.attend``, with no (T/cp x T) mask: each document segment of a
rank's chunks attends its own tokens causally and its document's earlier tokens in full, both by
flash kernels (CPU: merged by log-sum-exp; CUDA: FlexAttention). Positions (RoPE, YaRN) and
document ids are computed on the whole rows before the cut, so a shard's tokens keep their own
positions; NoPE layers need nothing. The loss is each rank's token mean over its own tokens; the
trainer weights it by the rank's token count and sums the counts over ``dp_cp``.

Activation memory per rank, for B rows of T tokens, hidden C, H query and KV key/value heads of
width D, L layers, b bytes per element:

- everything per token (residual stream, norms, q/k/v/o projections' inputs, MLP, loss chunks)
  is T/cp: the one-process activation memory divided by cp;
- plus, per layer, the all-gathered keys and values ``2 * B * KV * T * D * b`` (KV heads):
  on CPU alive only while one layer's attention runs (its backward saves the local k/v, T/cp,
  and gathers them again); on CUDA FlexAttention saves them for its backward pass: held for
  all L layers without activation checkpointing, one layer's while it is recomputed with it;
- plus, per layer, the attention's log-sum-exp ``B * H * (T/cp) * 4`` bytes (float32); its
  output is the output projection's input (the same storage);
- plus, once for all layers, the shard's plan (CPU: token indices, tens of bytes a token) or block
  mask (CUDA: per 128 x 128 block);
- plus, while one layer computes, O(T) buffers: the bucketed copies of q, k, v and the output
  (up to 25% padding), and in the backward pass the gradients of the whole rows' k and v
  (float32 under bf16) before they are reduce-scattered.

No term grows as T x T/cp, so activation memory per rank falls as 1/cp (on CUDA until the
all-gathered K/V, linear in T and not divided by cp, are the floor).
``benchmarks/bench_cp_memory.py`` measures one forward/backward's peak RSS per rank at cp=2
against one process, at 8,192 tokens of 512-token documents.

Compiled blocks (``train.compile``) run the gather too: a 2-rank check of the YaRN/NoPE debug
model on CPU gave the eager loss exactly and gradients within 8e-8 (not in the test suite: the
compile takes minutes on 2 cores; taken with the earlier masked attention). On CPU the attention
itself runs eagerly inside a compiled block (``torch.compiler.disable``: its plan is built on the
host); compiled around it, one shard's attention gave the eager gradients exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from llmflow.model.attention import document_ids, positions_from_cu_seqlens
from llmflow.model.context import SequenceShard
from llmflow.tasks.framework.errors import BadInputError

SHARDED_KEYS = ("input_ids", "labels", "position_ids")
"""The per-token (B, T) tensors of a batch that are cut along T."""


def zigzag_index(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> Tensor:
    """Positions (ascending) of the tokens rank ``rank`` of ``cp`` holds: chunks r and 2cp-1-r.

    Raises:
        BadInputError: ``seq_len`` does not divide by ``2 * cp``.
    """
    if seq_len % (2 * cp):
        raise BadInputError(
            f"context parallelism: seq_len={seq_len} must be divisible by 2 x cp = {2 * cp}"
        )
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last_start = (2 * cp - 1 - rank) * chunk
    return torch.cat([first, torch.arange(last_start, last_start + chunk, device=device)])


def gather_order(seq_len: int, cp: int, device: torch.device | None = None) -> Tensor:
    """For each row position, its place in the rank-major all-gather of every rank's tokens."""
    gathered = torch.cat([zigzag_index(seq_len, cp, r, device) for r in range(cp)])
    return torch.argsort(gathered)


def whole_row_positions(
    batch_size: int, seq_len: int, position_ids: Tensor | None, cu_seqlens: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Positions (B, T) and document ids (B, T) or None of the whole rows, as the model derives
    them (``Transformer.forward``): given positions win, else they restart at each document."""
    doc_ids = document_ids(batch_size, seq_len, position_ids, cu_seqlens)
    if position_ids is None and doc_ids is not None:
        position_ids = positions_from_cu_seqlens(batch_size, seq_len, cu_seqlens)
    elif position_ids is None:
        device = cu_seqlens.device if cu_seqlens is not None else None
        position_ids = torch.arange(seq_len, device=device)[None]
    return position_ids.expand(batch_size, -1), doc_ids


def shard_batch(batch: dict[str, Tensor], group: dist.ProcessGroup) -> dict:
    """This rank's part of a micro-batch of whole rows, for ``Transformer.forward(context=...)``.

    ``input_ids``, ``labels`` and ``position_ids`` (the whole rows' positions, restarting at each
    document of ``cu_seqlens``) keep this rank's T/cp tokens; ``context`` holds the
    ``SequenceShard`` (index, gather order and the whole rows' document ids; it moves with
    ``.to(device)`` like the tensors). Other keys, ``cu_seqlens`` included (the model reads the
    documents from ``context``), are kept as they are.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = batch["input_ids"]
    batch_size, seq_len = ids.shape
    positions, doc_ids = whole_row_positions(
        batch_size, seq_len, batch.get("position_ids"), batch.get("cu_seqlens")
    )
    index = zigzag_index(seq_len, cp, rank, ids.device)
    whole = {**batch, "position_ids": positions}
    out = dict(batch)
    for key in SHARDED_KEYS:
        if whole.get(key) is not None:
            out[key] = whole[key].index_select(1, index)
    out["context"] = SequenceShard(group, index, gather_order(seq_len, cp, ids.device), doc_ids)
    return out


# --- the planner's terms for CP (`memory_model.memory`, `layout_planner.communication`) ------


def gathered_kv_bytes(
    cfg, *, seq_len: int, micro_batch_size: int, activation_bytes: int, tp: int, cp: int
) -> float:
    """Per layer kept for the backward pass: K and V of the whole rows (the KV heads, not
    expanded; /tp under TP), less the local s/cp ones the block's own count has. Beside them
    CUDA's ``flex`` and the CPU's document-segment kernel keep what the block's count has (the
    local q, the output and its logsumexp); the CPU kernel's per-segment copies are made again
    in the backward pass (its plan's indices, a few bytes per token, left out)."""
    if cp == 1:
        return 0.0
    kv = cfg.num_kv_heads * cfg.head_dim / tp
    return 2 * micro_batch_size * (seq_len - seq_len / cp) * kv * activation_bytes


def traffic_bytes(
    cfg,
    *,
    seq_len: int,
    micro_batch_size: int,
    micro_batches: int,
    activation_bytes: int,
    tp: int,
    cp: int,
    blocks: int,
    recomputed: float,
) -> float:
    """Bytes one GPU sends per step for CP: the all-gather of K and V per block forward (again
    for the ``recomputed`` share), the reduce-scatter of their gradients backward."""
    kv = cfg.num_kv_heads * cfg.head_dim / tp
    gathered = 2 * micro_batch_size * seq_len * kv * activation_bytes  # K and V, whole rows
    return (2 + recomputed) * gathered * (cp - 1) / cp * blocks * micro_batches
