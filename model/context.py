"""Context parallelism's view of a batch: the tokens of each row one rank holds.

Under context parallelism a rank holds only some tokens of each row (a `SequenceShard`); its
queries attend to the keys and values of the whole rows, all-gathered over the context-parallel
group (`SequenceShard.gather`), causally in the rows' own token order and within documents.

`SequenceShard.attend` builds no (T_local x T_full) mask. A rank's tokens are contiguous
chunks of the rows (zig-zag: chunks r and 2cp-1-r); a chunk cuts into document segments, and a
segment [s, e) of a document that starts at ds attends keys [ds, e) causally. On CPU each
segment's attention is split in two parts, both run by the CPU's flash kernel, which returns
the log-sum-exp of its rows:

- the diagonal [s, e) x [s, e): causal and square (as one document of `kernels.py`'s
  `sdpa-buckets`); every local token has one;
- the past [s, e) x [ds, s): no mask; only a chunk's first segment has one, when its document
  began before the chunk.

The parts are merged with their log-sum-exps; the backward pass runs the flash kernel's
backward on each part with the MERGED output and log-sum-exp (as ring attention does), which
gives each part's share of the gradients, and sums them. For its backward pass it saves the
k/v of this rank's own tokens, not the whole rows', and all-gathers them again there (when
they are `gather`'s outputs): the whole rows' k/v live for one layer at a time. Segments of
similar length are padded to a length bucket and stacked, so a layer makes about two kernel
calls per bucket, not one per document; the plan is built once per shard and shared by all
layers. Padded query slots are dropped; padded key slots come after the real ones (causal
diagonal) or are hidden by a (1 x key slots) padding bias per segment (past).

On CUDA, FlexAttention (compiled) with a block mask of the local queries over the whole rows'
keys; NOTE: written without a GPU to test it on.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor

from llmflow.model.kernels import _flex, padded_length, record_kernel


@dataclass(frozen=True)
class SequenceShard:
    """The tokens of each row one rank holds under context parallelism, and the whole rows' layout.

    Every rank of `group` holds the same rows (B, T_full) cut along T into different tokens; the
    queries stay local and the keys/values are all-gathered (GQA: only the KV heads travel).

    Attributes:
        group: the context-parallel process group.
        index: (T,) ascending positions in the full row (0..T_full-1) of this rank's tokens.
        order: (T_full,) for each full-row position, where it lies in the rank-major all-gather
            (rank 0's T tokens, then rank 1's, ...).
        doc_ids: (B, T_full) document of every token of the full rows, or None (one per row).
    """

    group: dist.ProcessGroup
    index: Tensor
    order: Tensor
    doc_ids: Tensor | None = None
    _plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # id(whole-row tensor from `gather`) -> (weak reference to it, the local tensor it came from)
    _gathered: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """This rank's queries q (B, H, T, D) over the whole rows' k, v (B, KV, T_full, D),
        causal in row positions and within documents; (B, H, T, D) out. GQA: k and v keep their
        KV heads.

        When k and v are this shard's own `gather` outputs, the CPU kernel saves their local
        tokens for its backward pass, not the whole rows, and gathers them again there (the
        same bytes: the all-gather copies): the whole rows' k/v are then alive for one layer
        at a time, not for every layer from its forward to its backward."""
        device = q.device.type
        local_k, local_v = self._local_of(k), self._local_of(v)
        regather = local_k is not None and local_v is not None
        q, k, v, local_k, local_v = _in_autocast_dtype(device, q, k, v, local_k, local_v)
        if device == "cuda" and _flex() is not None:
            _log_once("flex", q)
            return self._flex(q, k, v)
        _log_once("split", q)
        plan = self.plan(q.shape[0], q.device)
        if not regather:
            return _split_attend(q, k, v, plan)
        return _split_attend(q, k, v, plan, _Regather(self.group, self.order), local_k, local_v)

    def plan(self, batch: int, device: torch.device) -> _SplitPlan:
        """The CPU kernel's plan for `batch` rows (built on first use, shared by all layers)."""
        key = ("split", batch, str(device))
        if key not in self._plans:
            self._plans[key] = _plan_split(self.index, self.doc_ids, batch, self.order.numel())
            self._plans[key] = self._plans[key].to(device)
        return self._plans[key]

    def _flex(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        flex, _ = _flex()
        key = ("flex", q.shape[0], str(q.device))
        if key not in self._plans:
            self._plans[key] = self._block_mask(q.shape[0], q.device)
        gqa = q.shape[1] != k.shape[1]
        return flex(q, k, v, block_mask=self._plans[key], enable_gqa=gqa)

    def _block_mask(self, batch: int, device: torch.device):
        _, create_block_mask = _flex()
        index, ids = self.index.to(device), self.doc_ids
        if ids is None:

            def causal(b, h, q_idx, kv_idx):
                return index[q_idx] >= kv_idx

            mask_mod, rows = causal, None
        else:
            ids = ids.to(device)
            local = ids[:, index]  # (B, T): the documents of this rank's tokens

            def document_causal(b, h, q_idx, kv_idx):
                return (index[q_idx] >= kv_idx) & (local[b, q_idx] == ids[b, kv_idx])

            mask_mod, rows = document_causal, batch
        return create_block_mask(
            mask_mod, rows, None, index.numel(), self.order.numel(), device=device,
            _compile=True,
        )  # fmt: skip

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SequenceShard:
        """The same shard with its tensors on `device` (moved with the batch that holds it)."""
        doc_ids = self.doc_ids
        if doc_ids is not None:
            doc_ids = doc_ids.to(device, non_blocking=non_blocking)
        index = self.index.to(device, non_blocking=non_blocking)
        order = self.order.to(device, non_blocking=non_blocking)
        return replace(self, index=index, order=order, doc_ids=doc_ids)

    def gather(self, x: Tensor) -> Tensor:
        """(B, N, T, D) local heads -> (B, N, T_full, D) of the whole rows (autograd: the backward
        reduce-scatters the gradient back to the rank that holds each token)."""
        if torch.compiler.is_compiling():  # NOTE: compiled, `attend` saves the whole rows
            return _GatherSequence.apply(x, self.group, self.order)
        local: list[Tensor] = []
        out = _GatherSequence.apply(x, self.group, self.order, local)
        for key in [key for key, (ref, _) in self._gathered.items() if ref() is None]:
            del self._gathered[key]  # gathered but never attended (and since freed)
        self._gathered[id(out)] = (weakref.ref(out), local[0])
        return out

    def _local_of(self, whole: Tensor) -> Tensor | None:
        """The (T, B, N, D) local tokens `gather` made `whole` from, or None (not its output)."""
        if torch.compiler.is_compiling():
            return None
        ref, local = self._gathered.pop(id(whole), (None, None))
        return local if ref is not None and ref() is whole else None


_WHY = {
    "flex": "FlexAttention, block mask sharded on queries",
    "split": "per-segment past and diagonal parts, merged by log-sum-exp",
}


def _in_autocast_dtype(device: str, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """The tensors (None left as is) in the autocast dtype when autocast is on for `device`,
    as SDPA computes under autocast; unchanged otherwise. A shard's local k/v cast this way hold
    the same values as the whole rows' cast (the gather only copies)."""
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def _log_once(name: str, q: Tensor) -> None:
    record_kernel(f"cp-{name}", _WHY[name], q)


# ------------------------------------------------------------------------------- CPU: split
@dataclass(frozen=True)
class _Bucket:
    """Segments of one padded size, stacked: (count, q_len) query slots over (count, k_len) key
    slots. Slots are flat token numbers (row * T + position) of the local queries and of the
    whole rows' keys; a segment's padding repeats its last token."""

    count: int
    q_len: int
    k_len: int
    queries: Tensor  # (count * q_len,) local token of each query slot
    keys: Tensor  # (count * k_len,) whole-row token of each key slot
    real: Tensor  # (count * q_len,) bool: the slot is a token of the segment, not padding
    key_bias: Tensor | None  # (count, 1, 1, k_len): 0, or -inf on padded key slots (past only)

    def to(self, device: torch.device) -> _Bucket:
        moved = {n: getattr(self, n).to(device) for n in ("queries", "keys", "real")}
        bias = None if self.key_bias is None else self.key_bias.to(device)
        return replace(self, **moved, key_bias=bias)


@dataclass(frozen=True)
class _SplitPlan:
    """Every local token's diagonal part and some tokens' past part, in buckets.

    Attributes:
        batch, local_len, full_len: B, T_local, T_full.
        diagonal: causal buckets; `diagonal_where` (B * T_local,): each token's slot in the
            concatenation of their query slots.
        past: unmasked buckets; `past_tokens`: the local tokens that have a past part, and
            `past_where` their slots in the concatenation of the past buckets' query slots.
    """

    batch: int
    local_len: int
    full_len: int
    diagonal: tuple[_Bucket, ...]
    diagonal_where: Tensor
    past: tuple[_Bucket, ...]
    past_tokens: Tensor
    past_where: Tensor

    def to(self, device: torch.device) -> _SplitPlan:
        return replace(
            self,
            diagonal=tuple(b.to(device) for b in self.diagonal),
            past=tuple(b.to(device) for b in self.past),
            diagonal_where=self.diagonal_where.to(device),
            past_tokens=self.past_tokens.to(device),
            past_where=self.past_where.to(device),
        )


def _document_starts(doc_ids: Tensor | None, batch: int) -> list[list[int]]:
    """Per row, the ascending positions where a document starts (0 included)."""
    if doc_ids is None:
        return [[0] for _ in range(batch)]
    starts = torch.ones(doc_ids.shape, dtype=torch.bool, device=doc_ids.device)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    rows, cols = starts.nonzero(as_tuple=True)  # NOTE: one host sync per shard, not per layer
    per_row: list[list[int]] = [[] for _ in range(batch)]
    for row, col in zip(rows.tolist(), cols.tolist(), strict=True):
        per_row[row].append(col)
    return per_row


def _plan_split(index: Tensor, doc_ids: Tensor | None, batch: int, full_len: int) -> _SplitPlan:
    positions = index.tolist()
    local_len = len(positions)
    runs, first = [], 0  # (local start, full start, length) of each contiguous chunk
    for i in range(1, local_len + 1):
        if i == local_len or positions[i] != positions[i - 1] + 1:
            runs.append((first, positions[first], i - first))
            first = i
    # segments as (row, local start, first key, queries, keys), by padded (queries, keys)
    diagonal: dict[tuple[int, int], list[tuple]] = {}
    past: dict[tuple[int, int], list[tuple]] = {}
    for row, doc_starts in enumerate(_document_starts(doc_ids, batch)):
        for local, full, length in runs:
            pos, end = full, full + length
            while pos < end:
                doc = bisect.bisect_right(doc_starts, pos) - 1
                doc_end = doc_starts[doc + 1] if doc + 1 < len(doc_starts) else full_len
                at, queries, before = (
                    local + pos - full,
                    min(end, doc_end) - pos,
                    pos - doc_starts[doc],
                )
                bucket = padded_length(queries)
                diagonal.setdefault((bucket, bucket), []).append((row, at, pos, queries, queries))
                if before:  # the document began before this chunk
                    segment = (row, at, doc_starts[doc], queries, before)
                    past.setdefault((bucket, padded_length(before)), []).append(segment)
                pos += queries
    total = batch * local_len
    diagonal_buckets, diagonal_where = _stack(diagonal, local_len, full_len, total, causal=True)
    past_buckets, past_where = _stack(past, local_len, full_len, total, causal=False)
    tokens = (past_where >= 0).nonzero().flatten()
    return _SplitPlan(
        batch, local_len, full_len, diagonal_buckets, diagonal_where,
        past_buckets, tokens, past_where[tokens],
    )  # fmt: skip


def _stack(groups: dict, local_len: int, full_len: int, total: int, causal: bool):
    """The buckets of `groups` {(q_len, k_len): [(row, local start, first key, queries, keys)]}
    and, per local token, its query slot in their concatenation (-1: none)."""
    where = torch.full((total,), -1, dtype=torch.int64)
    buckets, offset = [], 0
    for (q_len, k_len), members in sorted(groups.items()):
        row, at, key_start, queries, keys = (
            torch.tensor(c)[:, None] for c in zip(*members, strict=True)
        )
        q_slot, k_slot = torch.arange(q_len)[None], torch.arange(k_len)[None]
        count = len(members)
        tokens = row * local_len + at + torch.minimum(q_slot, queries - 1)  # (n, q_len)
        key_tokens = row * full_len + key_start + torch.minimum(k_slot, keys - 1)  # (n, k_len)
        real = (q_slot < queries).expand(count, -1)
        slots = offset + torch.arange(count * q_len).view(count, q_len)
        where[tokens[real]] = slots[real]
        bias = None if causal else _padding_bias(k_slot, keys)
        buckets.append(
            _Bucket(
                count, q_len, k_len, tokens.flatten(), key_tokens.flatten(), real.flatten(), bias
            )
        )
        offset += count * q_len
    return tuple(buckets), where


def _padding_bias(k_slot: Tensor, keys: Tensor) -> Tensor:
    """(n, 1, 1, k_len) additive bias: -inf on the key slots past each member's `keys`."""
    bias = torch.zeros(keys.shape[0], 1, 1, k_slot.shape[-1])
    return bias.masked_fill_((k_slot >= keys)[:, None, None, :], float("-inf"))


def _gather(x: Tensor, tokens: Tensor, seq_len: int) -> Tensor:
    """(B, N, T, D) in any memory layout -> (n, N, D): the tokens numbered row * T + position."""
    return x.transpose(1, 2)[tokens // seq_len, tokens % seq_len]


def _operands(q: Tensor, k: Tensor, v: Tensor, bucket: _Bucket, plan: _SplitPlan):
    """A bucket's (count, H|KV, L, D) queries, keys and values, and its key padding bias."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[3]
    count, q_len, k_len = bucket.count, bucket.q_len, bucket.k_len
    qb = _gather(q, bucket.queries, plan.local_len).view(count, q_len, heads, dim)
    kb, vb = (
        _gather(t, bucket.keys, plan.full_len).view(count, k_len, kv_heads, dim) for t in (k, v)
    )
    bias = None if bucket.key_bias is None else bucket.key_bias.to(q.dtype)
    return qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), bias


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _run(q: Tensor, k: Tensor, v: Tensor, plan: _SplitPlan, buckets, causal: bool, where):
    """Every bucket's output (n, H, D) and log-sum-exp (n, H), at the query slots `where`."""
    heads, dim = q.shape[1], q.shape[3]
    outs, lses = [], []
    for bucket in buckets:
        qb, kb, vb, bias = _operands(q, k, v, bucket, plan)
        out, lse = _FLASH(qb, kb, vb, 0.0, causal, attn_mask=bias)  # (n, H, L, D), (n, H, L)
        outs.append(out.transpose(1, 2).reshape(-1, heads, dim))
        lses.append(lse.transpose(1, 2).reshape(-1, heads))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses) if len(lses) > 1 else lses[0]
    return out.index_select(0, where), lse.index_select(0, where)


def _split_forward(q: Tensor, k: Tensor, v: Tensor, plan: _SplitPlan) -> tuple[Tensor, Tensor]:
    """(B * T_local, H, D) output and (B * T_local, H) log-sum-exp of every local token."""
    out, lse = _run(q, k, v, plan, plan.diagonal, True, plan.diagonal_where)
    if plan.past:
        past_out, past_lse = _run(q, k, v, plan, plan.past, False, plan.past_where)
        tokens = plan.past_tokens
        own_out, own_lse = out.index_select(0, tokens), lse.index_select(0, tokens)
        merged_lse = torch.logaddexp(own_lse, past_lse)  # float32 (float64 for float64)
        merged = own_out * (own_lse - merged_lse).exp()[..., None]
        merged = merged + past_out * (past_lse - merged_lse).exp()[..., None]
        out.index_copy_(0, tokens, merged.to(out.dtype))
        lse.index_copy_(0, tokens, merged_lse)
    return out, lse


@dataclass(frozen=True)
class _Regather:
    """How the backward pass gathers the whole rows' k/v again from their local tokens."""

    group: dist.ProcessGroup
    order: Tensor

    def __call__(self, local: Tensor) -> Tensor:
        return _gather_rows(local, self.group, self.order)


class _SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        plan: _SplitPlan,
        regather: _Regather | None,
        local_k: Tensor | None,
        local_v: Tensor | None,
    ) -> Tensor:
        batch, heads, local_len, dim = q.shape
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _split_forward(q, k, v, plan)
        if regather is not None:  # the local tokens, 1/cp of the whole rows
            k, v = local_k, local_v
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.regather = plan, regather
        return out.view(batch, local_len, heads, dim).transpose(1, 2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        plan: _SplitPlan = ctx.plan
        if ctx.regather is not None:
            k, v = ctx.regather(k), ctx.regather(v)
        batch, heads, local_len, dim = q.shape
        kv_heads = k.shape[1]
        # NOTE: a token's gradients sum its parts (and keys are seen by several segments):
        # accumulated in float32 under bf16, so they round once, as one kernel's would
        acc = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
        dq = torch.zeros(batch * local_len, heads, dim, dtype=acc, device=q.device)
        dk = torch.zeros(batch * plan.full_len, kv_heads, dim, dtype=acc, device=q.device)
        dv = torch.zeros_like(dk)
        grad = grad.to(q.dtype)
        parts = [(b, True) for b in plan.diagonal] + [(b, False) for b in plan.past]
        with torch.autocast(q.device.type, enabled=False):
            for bucket, causal in parts:
                shape = (bucket.count, bucket.q_len, heads, dim)
                qb, kb, vb, bias = _operands(q, k, v, bucket, plan)
                # padded query slots get no gradient: their parts then add exact zeros
                gb = _gather(grad, bucket.queries, local_len)
                gb = gb.masked_fill(~bucket.real[:, None, None], 0).view(shape).transpose(1, 2)
                ob = out.index_select(0, bucket.queries).view(shape).transpose(1, 2)
                lb = lse.index_select(0, bucket.queries).view(shape[:3]).transpose(1, 2)
                # the merged output and log-sum-exp: this part's share of the gradients
                dqb, dkb, dvb = _FLASH_BACKWARD(
                    gb, qb, kb, vb, ob, lb.contiguous(), 0.0, causal, attn_mask=bias
                )
                dq.index_add_(
                    0, bucket.queries, dqb.transpose(1, 2).reshape(-1, heads, dim).to(acc)
                )
                dk.index_add_(
                    0, bucket.keys, dkb.transpose(1, 2).reshape(-1, kv_heads, dim).to(acc)
                )
                dv.index_add_(
                    0, bucket.keys, dvb.transpose(1, 2).reshape(-1, kv_heads, dim).to(acc)
                )
        dq = dq.view(batch, local_len, heads, dim).transpose(1, 2).to(q.dtype)
        dk, dv = (
            t.view(batch, plan.full_len, kv_heads, dim).transpose(1, 2).to(k.dtype)
            for t in (dk, dv)
        )
        return dq, dk, dv, None, None, None, None


@torch.compiler.disable  # NOTE: host-side plan and aten CPU kernels: compiled blocks call it eagerly
def _split_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: _SplitPlan,
    regather: _Regather | None = None,
    local_k: Tensor | None = None,
    local_v: Tensor | None = None,
) -> Tensor:
    if regather is not None:  # NOTE: detached: saved, not differentiated (k, v carry the graph)
        local_k, local_v = local_k.detach(), local_v.detach()
    return _SplitAttention.apply(q, k, v, plan, regather, local_k, local_v)


# NOTE: torch 2.13 renamed the dim-0 collectives (`*_into_tensor` / `*_tensor` are deprecated).
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _gather_rows(local: Tensor, group: dist.ProcessGroup, order: Tensor) -> Tensor:
    """(T, B, N, D) contiguous local tokens -> (B, N, T_full, D) of the whole rows."""
    world = dist.get_world_size(group)
    gathered = local.new_empty((world * local.shape[0], *local.shape[1:]))
    _ALL_GATHER(gathered, local, group=group)
    return gathered.index_select(0, order).movedim(0, 2)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: Tensor, group: dist.ProcessGroup, order: Tensor, sink: list | None = None
    ) -> Tensor:
        local = x.movedim(2, 0).contiguous()  # (T, B, N, D): the collective cuts dim 0
        if sink is not None:  # what `attend` may save in place of the whole rows
            sink.append(local)
        ctx.group, ctx.order, ctx.world = group, order, dist.get_world_size(group)
        return _gather_rows(local, group, order)  # (B, N, T_full, D)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        full = grad.movedim(2, 0)  # (T_full, B, N, D) in row order
        rank_major = torch.empty_like(full, memory_format=torch.contiguous_format)
        rank_major.index_copy_(0, ctx.order, full)  # back to the all-gather's layout
        local = rank_major.new_empty((rank_major.shape[0] // ctx.world, *rank_major.shape[1:]))
        _REDUCE_SCATTER(local, rank_major, group=ctx.group)  # summed over ranks
        return local.movedim(0, 2), None, None, None
