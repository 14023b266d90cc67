"""Causal attention over packed documents, with no (T x T) mask: one entry point, `attend`,
which picks a kernel by device, dtype and the batch's documents.

| kernel          | where                                   | cost follows        |
|-----------------|-----------------------------------------|---------------------|
| `sdpa-causal`   | rows of one document (any device)       | the row, causal     |
| `sdpa-buckets`  | CPU (and CUDA without varlen or flex)   | the documents       |
| `varlen`        | CUDA, bf16/fp16, `torch.nn.attention.varlen` with grouped KV heads | the documents |
| `flex`          | CUDA otherwise: FlexAttention, compiled, document `BlockMask` | the documents |
| `dense`         | never chosen: the reference of the tests (`use_attention_kernel("dense")`) | T x T |

`sdpa-buckets` cuts each row into its documents, pads each to a length bucket (at most 25%
longer, at least 16 tokens), stacks the documents of one bucket as a batch and runs causal SDPA
on it (the CPU's flash kernel, with a backward pass, and grouped KV heads shared). A document's
padding comes after its tokens, so causal attention never lets a real query see it; the padded
queries are dropped. Its gathers and scatters cost O(T) per layer; attention costs sum(l_i^2).

The chosen kernel is logged once per process and listed by `chosen_kernels()` (the trainer
writes it to ``summary.json``). ``LLMFLOW_ATTENTION`` or `use_attention_kernel` forces one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

KERNELS = ("auto", "dense", "sdpa-buckets", "varlen", "flex")
MIN_BUCKET = 16
"""Documents shorter than this are padded to it (one SDPA call for all short documents)."""
_forced: list[str] = []
_chosen: dict[str, None] = {}


# ---------------------------------------------------------------------------------- documents
@dataclass(frozen=True, eq=False)
class Documents:
    """The documents of a batch of B rows of T tokens: what every kernel needs, computed once
    per forward and shared by all layers.

    Attributes:
        batch, seq_len: B and T.
        cu_seqlens: int32 (N+1,) cumulative document lengths over the flattened B*T tokens,
            every row boundary included (flash-attn's varlen convention), on the tokens' device.
        lengths: the N document lengths (host copy).
    """

    batch: int
    seq_len: int
    cu_seqlens: Tensor
    lengths: tuple[int, ...]
    _plans: dict = field(default_factory=dict, repr=False)

    @staticmethod
    def of(
        batch: int,
        seq_len: int,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
    ) -> Documents | None:
        """The batch's documents, or None when every row is one document (plain causal).

        Args:
            position_ids: (B, T) or (1, T) positions restarting at 0 at each document; used
                only without `cu_seqlens` (a position that is not the previous one plus 1 starts
                a document, as transformers' `find_packed_sequence_indices` decides).
            cu_seqlens: cumulative document lengths over the flattened B*T tokens; row
                boundaries are added where missing.
        """
        total = batch * seq_len
        if cu_seqlens is not None:
            device = cu_seqlens.device
            rows = torch.arange(0, total + 1, seq_len, device=device)
            cu = torch.unique(torch.cat([cu_seqlens.to(torch.int64), rows]))  # sorted
        elif position_ids is not None:
            positions = position_ids.expand(batch, -1)
            diff = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
            starts = diff != 1
            starts[:, 0] = True
            device = positions.device
            cu = torch.cat(
                [starts.flatten().nonzero().flatten(), torch.tensor([total], device=device)]
            )
        else:
            return None
        if cu.numel() == batch + 1:  # only the row boundaries
            return None
        # NOTE: one host sync per forward (transformers makes the same one); the lengths plan
        # the CPU's buckets and give varlen its max_seqlen
        lengths = tuple(torch.diff(cu).tolist())
        return Documents(batch, seq_len, cu.to(torch.int32), lengths)

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)

    def ids(self) -> Tensor:
        """Which document each token belongs to, (B, T), numbered over the whole batch."""
        tokens = torch.arange(self.batch * self.seq_len, device=self.cu_seqlens.device)
        ids = torch.searchsorted(self.cu_seqlens.to(tokens.dtype), tokens, right=True)
        return ids.view(self.batch, self.seq_len)

    def positions(self) -> Tensor:
        """Each token's position inside its document, (B, T), restarting at 0 at each start."""
        tokens = torch.arange(self.batch * self.seq_len, device=self.cu_seqlens.device)
        starts = self.cu_seqlens.to(tokens.dtype)
        doc = torch.searchsorted(starts, tokens, right=True) - 1
        return (tokens - starts[doc]).view(self.batch, self.seq_len)

    def plan(self, name: str, build):
        """A kernel's plan for these documents (built on first use, then shared by all layers)."""
        if name not in self._plans:
            self._plans[name] = build(self)
        return self._plans[name]


def padded_length(length: int) -> int:
    """The bucket of a document of `length` tokens: rounded up to a quarter of its octave (at
    most 25% padding), and at least `MIN_BUCKET`."""
    if length <= MIN_BUCKET:
        return MIN_BUCKET
    granule = 1 << max(length.bit_length() - 3, 0)
    return -(-length // granule) * granule


@dataclass(frozen=True)
class _Buckets:
    """`sdpa-buckets`' plan: per bucket, the padded length and the token each slot reads; and
    for every token, its slot in the concatenation of all buckets' outputs."""

    sizes: tuple[tuple[int, int], ...]  # (documents, padded length) per bucket
    gather: Tensor  # (sum n*L,) token index of each slot (padding repeats a document's last)
    where: Tensor  # (B*T,) slot of each token


def _plan_buckets(docs: Documents) -> _Buckets:
    device = docs.cu_seqlens.device
    starts = docs.cu_seqlens[:-1].tolist()
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(docs.lengths):
        by_length.setdefault(padded_length(n), []).append(i)
    sizes, gathers = [], []
    where = torch.empty(docs.batch * docs.seq_len, dtype=torch.int64)
    offset = 0
    for padded, members in sorted(by_length.items()):
        start = torch.tensor([starts[i] for i in members])[:, None]  # (n, 1)
        length = torch.tensor([docs.lengths[i] for i in members])[:, None]
        slot = torch.arange(padded)[None, :]  # (1, L)
        gathers.append((start + torch.minimum(slot, length - 1)).flatten())
        real = (slot < length).expand(len(members), -1)
        tokens = (start + slot).expand(len(members), -1)
        slots = offset + torch.arange(len(members) * padded).view(len(members), padded)
        where[tokens[real]] = slots[real]
        sizes.append((len(members), padded))
        offset += len(members) * padded
    return _Buckets(tuple(sizes), torch.cat(gathers).to(device), where.to(device))


# ------------------------------------------------------------------------------------ kernels
def attend(q: Tensor, k: Tensor, v: Tensor, docs: Documents | None) -> Tensor:
    """Causal attention of q (B, T, H, D) over k, v (B, T, KV, D) within each document;
    (B, T, H, D) out. `docs` None: each row is one document."""
    name = _kernel(q, docs)
    if name == "sdpa-causal":
        return _sdpa_causal(q, k, v)
    return _KERNELS[name](q, k, v, docs)


def _sdpa_causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H|KV, T, D)
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return out.transpose(1, 2)


# NOTE: the plan is host-side (document lengths); under torch.compile the bucketed call is left
# eager rather than guarded on every batch's packing (a recompilation per step)
@torch.compiler.disable
def _sdpa_buckets(q: Tensor, k: Tensor, v: Tensor, docs: Documents) -> Tensor:
    plan = docs.plan("sdpa-buckets", _plan_buckets)
    batch, seq_len, heads, dim = q.shape
    flat = [t.reshape(batch * seq_len, t.shape[2], dim) for t in (q, k, v)]
    gqa = q.shape[2] != k.shape[2]
    outs, offset = [], 0
    for count, padded in plan.sizes:
        index = plan.gather[offset : offset + count * padded]
        offset += count * padded
        qb, kb, vb = (
            t.index_select(0, index).view(count, padded, t.shape[1], dim).transpose(1, 2)
            for t in flat
        )  # (n, H|KV, L, D)
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(count * padded, heads, dim))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.index_select(0, plan.where).view(batch, seq_len, heads, dim)


@torch.compiler.disable
def _dense(q: Tensor, k: Tensor, v: Tensor, docs: Documents) -> Tensor:
    """The reference: SDPA under the (B, 1, T, T) block-diagonal causal mask, k/v repeated."""
    ids = docs.ids()
    mask = document_mask(ids)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def document_mask(doc_ids: Tensor) -> Tensor:
    """Block-diagonal causal mask (B, 1, T, T), True where a query may attend to a key (the
    tests' reference; no training path builds it)."""
    seq_len = doc_ids.shape[-1]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=doc_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)


@functools.cache
def _varlen() -> tuple | None:
    """torch's varlen flash attention and the keywords that make it causal and share KV heads,
    probed (its signature changed between releases), or None without grouped KV heads."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "enable_gqa" not in params:
        return None  # it would need k/v repeated per head: flex shares them
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    return varlen_attn, {**causal, "enable_gqa": True}


def _varlen_kernel(q: Tensor, k: Tensor, v: Tensor, docs: Documents) -> Tensor:
    fn, kwargs = _varlen()
    batch, seq_len, heads, dim = q.shape
    q, k, v = (t.reshape(batch * seq_len, t.shape[2], dim) for t in (q, k, v))
    cu, longest = docs.cu_seqlens, docs.max_seqlen
    out = fn(q, k, v, cu, cu, longest, longest, **kwargs)
    return out.view(batch, seq_len, heads, dim)


@functools.cache
def _flex() -> tuple | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def _block_mask(docs: Documents):
    _, create_block_mask = _flex()
    ids = docs.ids()

    def document_causal(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(
        document_causal, docs.batch, None, docs.seq_len, docs.seq_len,
        device=docs.cu_seqlens.device, _compile=True,
    )  # fmt: skip


def _flex_kernel(q: Tensor, k: Tensor, v: Tensor, docs: Documents) -> Tensor:
    flex, _ = _flex()
    block_mask = docs.plan("flex", _block_mask)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


_KERNELS = {
    "dense": _dense,
    "sdpa-buckets": _sdpa_buckets,
    "varlen": _varlen_kernel,
    "flex": _flex_kernel,
}


# ---------------------------------------------------------------------------------- selection
def _kernel(q: Tensor, docs: Documents | None) -> str:
    forced = _forced[-1] if _forced else os.environ.get("LLMFLOW_ATTENTION", "auto")
    if forced not in KERNELS:
        raise ValueError(f"LLMFLOW_ATTENTION={forced!r}: expected one of {', '.join(KERNELS)}")
    if docs is None:
        name, why = "sdpa-causal", "rows of one document"
    elif forced != "auto":
        name, why = forced, "forced"
    else:
        name, why = choose_kernel(q.device.type, q.dtype)
    record_kernel(name, why, q)
    return name


def record_kernel(name: str, why: str, q: Tensor) -> None:
    """Note that `name` ran (logged once per process, listed by `chosen_kernels`)."""
    if name not in _chosen:
        _chosen[name] = None
        log.info("attention: %s (%s, %s on %s)", name, why, str(q.dtype)[6:], q.device.type)


def choose_kernel(device_type: str, dtype: torch.dtype) -> tuple[str, str]:
    """The kernel for packed documents on `device_type` at `dtype`, and why."""
    if device_type == "cuda":
        if dtype in (torch.bfloat16, torch.float16) and _varlen() is not None:
            return "varlen", "flash varlen with shared KV heads"
        if _flex() is not None:
            return "flex", "FlexAttention, document block mask"
    return "sdpa-buckets", "per-document causal SDPA in length buckets"


def chosen_kernels() -> list[str]:
    """The attention kernels this process has run, in the order first used."""
    return list(_chosen)


@contextlib.contextmanager
def use_attention_kernel(name: str) -> Iterator[None]:
    """Force the kernel for packed documents inside the block (``"dense"``: the reference)."""
    if name not in KERNELS:
        raise ValueError(f"attention kernel {name!r}: expected one of {', '.join(KERNELS)}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()
