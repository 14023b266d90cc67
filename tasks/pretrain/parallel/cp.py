"""Context parallelism: each rank of the ``cp`` mesh dimension holds 1/cp of every row's tokens.

The rows (B, T) are cut along T into ``2 * cp`` chunks and rank ``r`` keeps chunks ``r`` and
``2 * cp - 1 - r`` (the zig-zag split of torch's ``context_parallel`` and torchtitan): under a
causal mask an early chunk attends to few keys and a late one to many, so every rank gets the
same attention work. CP ranks read the same rows (the loader reads by data-parallel rank) and
hold the same parameters (FSDP2 shards over ``dp_shard_cp``).

What a rank computes (``model/attention.py``): its queries and everything else (embedding, MLP,
norms, loss) on its T/cp tokens; in every attention layer the keys and values of the whole rows
are all-gathered over the cp group (only the KV heads: GQA's smaller tensors), put back in row
order, and attended under a mask that is causal in row positions and block-diagonal over
documents. Positions (RoPE, YaRN) and document ids are computed on the whole rows before the
cut, so a shard's tokens keep their own positions; NoPE layers need nothing. The loss is each
rank's token mean over its own tokens; the trainer weights it by the rank's token count and sums
the counts over ``dp_cp``.

Activation memory per rank (the planner's estimate), for B rows of T tokens, hidden C, H query
and KV key/value heads of width D, L layers, b bytes per element:

- everything per token (residual stream, norms, q/k/v/o projections' inputs, MLP, loss chunks)
  is T/cp: the one-process activation memory divided by cp;
- plus, per layer, the all-gathered keys and values ``2 * B * KV * T * D * b``: SDPA saves its
  inputs for the backward pass, so without activation checkpointing these are held for all L
  layers (``2 * L * B * KV * T * D * b`` in all; with checkpointing, one layer's while it is
  recomputed); the local k/v are T/cp;
- plus the mask ``B * (T/cp) * T`` bytes (bool, one for all layers, held through the step);
- plus, while one layer computes: on CPU the scores, ``B * H * (T/cp) * T * 4`` bytes, up to
  twice that with the probabilities (1 GiB of the 1.6 GiB below at T=8192); on CUDA the
  memory-efficient kernel takes the mask without a T x T matrix, but the gathered k/v are
  expanded to H heads first (``attention.py``: its fused kernels take grouped k/v only without
  a mask), and those are what SDPA saves: ``2 * B * H * T * D * b`` per layer instead of
  ``2 * B * KV * T * D * b`` above (the one-process document-masked path does the same at T).

So at small widths the T x T/cp terms dominate and activation memory per rank falls as 1/cp;
at long T and few heads the all-gathered K/V (linear in T, not divided) are the floor.

Measured (``benchmarks/bench_cp_memory.py``: CPU, fp32, debug preset, B=1, a document every
1000 tokens): peak RSS per rank of one forward/backward, minus the RSS before it (~280 MiB of
torch, model and batch):

========  ===================  ============================
T         one process          cp=2, each rank
========  ===================  ============================
4096      534 MiB (peak 812)   349 / 331 MiB (peak 630 / 612)
8192      1594 MiB (peak 1872) 841 / 839 MiB (peak 1123 / 1120)
========  ===================  ============================

Compiled blocks (``train.compile``) run the gather too: a 2-rank check of the YaRN/NoPE debug
model on CPU gave the eager loss exactly and gradients within 8e-8 (not in the test suite: the
compile takes minutes on 2 cores).
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
