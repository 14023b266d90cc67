"""The memory model of a pretraining step: what one GPU holds at a layout, term by term.

`memory(shape, layout)` takes the step's `Shape` (the model, one micro-batch, the precision, the
optimizer, checkpointing) and a ``parallel.config.Layout``. The terms of each parallel dimension
live beside the code that implements it: ``parallel/tp.py`` (the tied embedding's backward
buffers, TP traffic), ``parallel/cp.py`` (the gathered K/V, CP traffic), ``parallel/ep.py``
(the experts per rank, the dispatched rows, the all-to-all traffic), ``parallel/pp.py``
(the fullest stage, the final save, PP traffic, the bubble); FSDP2's sharding is here. Each term
is checked against the trainer by measurement (tests/tasks/pretrain/test_planner_terms.py,
test_planner_parallel_memory.py, tests/flows/test_preflight_memory.py) and the parameters per
rank against the trainer's own parallelize code on the meta device
(tests/tasks/pretrain/test_planner_meta.py).

A new parallel dimension adds its terms to its module and one line each where `memory` and
`layout_planner.communication` sum them.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmflow.model.config import ModelConfig
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.pretrain.parallel import cp as parallel_cp
from llmflow.tasks.pretrain.parallel import ep as parallel_ep
from llmflow.tasks.pretrain.parallel import pp as parallel_pp
from llmflow.tasks.pretrain.parallel import tp as parallel_tp
from llmflow.tasks.pretrain.parallel.config import Layout

GB = 1e9

OPTIMIZER_STATES = {"adamw": 2, "lion": 1, "sgd": 0, "muon": 1}
"""Float32 state tensors per parameter (AdamW: first and second moment). Muon keeps one momentum
buffer, for the hidden matrices only: embeddings, norms and the output projection stay on AdamW."""


@dataclass
class MemoryEstimate:
    """Memory per GPU, in GB (1e9 bytes).

    Weights (the float32 parameters the optimizer steps, and FSDP's gathered units) and the
    optimizer states stay for the whole run. Beside them, at different times: the train step's
    activations and gradients (never all live at once: the activations are freed block by block
    as the backward pass makes the gradients, and the gradients are freed (set to None) after
    the optimizer step), the optimizer step's temporaries beside the gradients, a validation
    pass, and a checkpoint save. The total is weights + optimizer states + the largest of those.
    """

    weights_gb: float
    gradients_gb: float
    optimizer_gb: float
    activations_gb: float
    """Activations at the end of the forward pass, the loss's buffers included."""
    peak_live_gb: float = 0.0
    """Activations and gradients at their fullest point together (see `memory`)."""
    optimizer_step_gb: float = 0.0
    """The gradients and the optimizer step's temporaries (`optimizer_step_bytes`)."""
    validation_gb: float = 0.0
    """A validation pass: the train step's loss path, forward only (`validation_bytes`)."""
    checkpoint_gb: float = 0.0
    """A checkpoint save's gathered tensors (`checkpoint_bytes`)."""

    @property
    def peak_gb(self) -> float:
        """Beside weights and optimizer states: the step, its optimizer step, validation or a
        checkpoint save, whichever is largest."""
        return max(self.peak_live_gb, self.optimizer_step_gb, self.validation_gb,
                   self.checkpoint_gb)  # fmt: skip

    @property
    def total_gb(self) -> float:
        """Weights + optimizer states + the fullest of the step, validation and a save."""
        return self.weights_gb + self.optimizer_gb + self.peak_gb


@dataclass(frozen=True)
class Shape:
    """What a layout is planned for: the model, one micro-batch and how the step computes it."""

    model: ModelConfig
    seq_len: int
    micro_batch_size: int
    param_dtype_bytes: int
    """Bytes the matmuls compute in (bf16: 2); parameters and gradients are float32 anyway."""
    optimizer: str
    activation_checkpointing: bool | str = False
    every_k: int = 2
    micro_batches: int = 1
    """Micro-batches per optimizer step (the accumulation; the pipeline schedule's count)."""
    fsdp: bool = True
    packed: bool = False
    """Rows hold several documents (`attention_extra_bytes`)."""
    device_type: str = "cuda"
    eval_batches: int = 4


def precision_bytes(train, device_type: str = "cuda") -> int:
    """Bytes per parameter copy, gradient and activation a ``TrainConfig`` computes in on
    ``device_type``: 2 in bf16 (float32 master weights counted apart), 4 in fp32.

    ``auto`` is bf16 on CUDA: a recipe's plan is for the GPUs it declares, so it plans bf16;
    preflight's rehearsal on a CPU plans fp32 unless the recipe asks for bf16.
    """
    import torch

    return torch.finfo(train.compute_dtype(device_type)).bits // 8


def checkpointed_blocks(
    cfg: ModelConfig, activation_checkpointing: bool | str, every_k: int = 2
) -> int:
    """Blocks recomputed in the backward pass: all (``full`` or True), every k-th
    (``selective``, blocks k, 2k, ... as the trainer wraps them) or none."""
    if activation_checkpointing in (True, "full"):
        return cfg.num_layers
    if activation_checkpointing == "selective":
        return cfg.num_layers // every_k
    return 0


def activation_bytes_per_token(
    cfg: ModelConfig,
    activation_bytes: int,
    activation_checkpointing: bool | str,
    every_k: int = 2,
    tp: int = 1,
    ep: int = 1,
) -> float:
    """Bytes kept for the backward pass per token of one micro-batch (loss buffers aside).

    Each block keeps `block_activation_bytes` (the derivation is there). Checkpointing keeps only
    each recomputed block's input (the residual stream: C, sequence-sharded over ``tp``), plus
    one block's worth during its recomputation (``selective``: every k-th block is
    checkpointed, the others keep everything). The embedding's output adds C (sequence-sharded
    over ``tp``), and the fused loss the hidden states' gradient (C, whole: the output
    projection's input is gathered), which it computes in the forward pass; its other buffers
    do not grow with the tokens (`loss_buffer_bytes`).
    """
    c = cfg.hidden_size
    per_block = block_activation_bytes(cfg, activation_bytes, tp, ep)
    recomputed = checkpointed_blocks(cfg, activation_checkpointing, every_k)
    blocks = (cfg.num_layers - recomputed) * per_block
    if recomputed:
        blocks += recomputed * c * activation_bytes / tp + per_block
    return blocks + (c / tp + c) * activation_bytes


FLOAT32 = 4
"""Bytes of the float32 statistics a block keeps in any precision (RMSNorm's 1/rms, SDPA's
logsumexp)."""


def block_activation_bytes(
    cfg: ModelConfig, activation_bytes: int, tp: int = 1, ep: int = 1
) -> float:
    """What one block keeps for its backward pass, per token, at tensor-parallel degree ``tp``
    with sequence parallelism.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    section 4.1) count, per layer and 2-byte activations, ``sbh(34 + 5as/h)`` bytes:
    attention 11sbh + 5as^2b (LN input 2, QKV input 2, Q and K 4, V 2, output-projection input
    2, dropout mask 1; softmax output 2as^2, its dropout mask as^2 and output 2as^2), MLP 19sbh
    (LN input 2, fc1 input 2, GeLU input 8 and output 8 at 4h, dropout mask 1), LayerNorms 4sbh.
    With TP the head- and column-sharded part divides: ``sbh(10 + 24/t + 5as/(ht))``; with
    sequence parallelism too the LayerNorm/dropout part divides: ``sbh·34/t`` (selective
    recomputation of the attention core drops the 5as/h term).

    Our block differs, and the count is redone for it, per token in elements of
    ``activation_bytes`` (h = hidden_size, kv = num_kv_heads·head_dim, I = intermediate_size,
    a = num_heads), measured with saved-tensor hooks on the real block (tests):

    - the two RMSNorms keep their input and their output (4h; the paper's LayerNorms keep the
      input only), plus one float32 1/rms per row each;
    - the two matmuls that read a norm's output (qkv and gate/up) keep their flattened input
      (2h): eager PyTorch keeps that reshaped copy beside the norm's output;
    - GQA: the rotated q (h) but k and v of num_kv_heads heads only (2kv, not the paper's 2h);
    - SDPA (flash/memory-efficient): no a·s·s score, softmax or dropout-mask matrices, so the
      paper's 5as/h terms vanish; it keeps its output (h, which is also the output
      projection's input) and the float32 logsumexp of each head and row (a floats);
    - SwiGLU instead of a 4h GeLU MLP: gate (I), up (I), silu(gate) (I) and their product
      (I, the down projection's input): 4I, with the model's intermediate size;
    - no dropout: the paper's dropout masks (2sbh with the attention's) vanish;
    - the residual additions keep nothing.

    In all: ``(8h + 2kv + 4I)`` elements and ``(a + 2)`` floats. At I = 4h and kv = h that is
    26h elements, 52h bytes in bf16, against the paper's 34h bytes + 5as: no score matrix, but
    the norms' outputs, the matmul inputs' copies and both SwiGLU halves. With TP + SP (PyTorch's ``ColwiseParallel``/``SequenceParallel``), what lies in
    the sequence-sharded region divides by tp (the norms' inputs and outputs: 4h, their 1/rms),
    what lies between a column- and a row-parallel matmul divides by tp over heads or columns
    (q, k, v, the SDPA output, its logsumexp, the SwiGLU tensors: 2h + 2kv + 4I, a floats), but
    the all-gathered inputs of the qkv and gate/up matmuls are saved whole (2h): unlike
    Megatron, which saves the sharded input and gathers it again in the backward pass (its
    34/t), autograd keeps the gathered tensor. Hence
    ``2h + (6h + 2kv + 4I)/t`` elements and ``(a + 2)/t`` floats per token.

    A mixture of experts (averaged over the layers, the sparse share of them): a sparse layer's
    routed rows and top-k expert widths (``ep.dispatch_bytes``) replace the dense ``4I``.
    """
    c, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    elements = 2 * c + (6 * c + 2 * kv + 4 * cfg.intermediate_size) / tp
    dense = elements * activation_bytes + (cfg.num_heads + 2) * FLOAT32 / tp
    if not cfg.num_experts:
        return dense
    sparse = sum(cfg.is_sparse(i) for i in range(cfg.num_layers)) / cfg.num_layers
    moe = parallel_ep.dispatch_bytes(cfg, 1, activation_bytes, ep)
    return dense + sparse * (moe - 4 * cfg.intermediate_size / tp * activation_bytes)


def loss_buffer_bytes(cfg: ModelConfig, tokens: int, tp: int = 1) -> float:
    """The fused loss's largest buffers at once, for a micro-batch of ``tokens``.

    `linear_cross_entropy` makes the logits a chunk of rows at a time (``CHUNK_ELEMENTS / V``
    rows; all rows where the loss is not chunked): a chunk's float32 logits and
    log-probabilities (8 bytes per logit), beside the output projection's float32 gradient,
    which it accumulates over the chunks in the forward pass (4·V·C). With TP the loss is
    vocab-parallel: each rank holds V/tp columns of both.
    """
    from llmflow.model import loss

    chunk_elements = getattr(loss, "CHUNK_ELEMENTS", None)
    rows = tokens if chunk_elements is None else max(1, chunk_elements // cfg.vocab_size)
    return (8 * min(rows, tokens) * cfg.vocab_size + 4 * cfg.vocab_size * cfg.hidden_size) / tp


@dataclass
class AttentionExtra:
    """What attention keeps beyond `block_activation_bytes` with packed rows or CP, bytes."""

    per_layer: float = 0.0
    """Kept by every block that is not recomputed (one block's worth when recomputed)."""
    once: float = 0.0
    """Held through the step once, for all layers (the documents' bucket plan)."""


BUCKET_PADDING = 0.25
"""The most `sdpa-buckets` pads a document of 16 tokens or more (``model/kernels.py``
`padded_length`: a quarter of its octave); the plan counts it whole."""
INDEX_BYTES = 8
"""An int64 token index of the bucket plan."""


def attention_extra_bytes(
    cfg: ModelConfig,
    *,
    seq_len: int,
    micro_batch_size: int,
    activation_bytes: int,
    tp: int = 1,
    cp: int = 1,
    packed: bool = False,
    device_type: str = "cuda",
) -> AttentionExtra:
    """The attention's memory that `block_activation_bytes` leaves out, for
    ``micro_batch_size`` rows of ``seq_len`` tokens (s/cp per rank), by the kernel
    ``model/kernels.py`` runs on ``device_type`` (no kernel keeps a T x T mask).

    ``packed``: rows hold several documents. What each kernel keeps for the backward pass,
    against the block's count (rotated q, k and v of the KV heads, the output, its logsumexp):

    - one document per row (``sdpa-causal``), any device: exactly that, nothing more;
    - packed rows on CUDA (``varlen``, or ``flex`` with a block mask of (s/128)^2 blocks per
      row, negligible): the same tensors, KV heads shared, nothing more;
    - packed rows on CPU (``sdpa-buckets``), measured with saved-tensor hooks: the per-document
      copies of q, k and v (they replace q, k and v: only their padding adds, at most
      `BUCKET_PADDING`) and the bucketed output beside the output projection's input
      (``(1 + pad)·h``), the logsumexp's padding; the plan's int64 token indices (each slot's
      token, each token's slot) are shared by all layers: once;
    - CP (``model/context.py``), any rows: every layer keeps K and V of the whole rows
      (``2·b·s·kv/tp``; the KV heads, not expanded) and not its local s/cp ones. Beside
      them it keeps what the block's count has: CUDA's ``flex`` the local q, the output and
      its logsumexp; the CPU's document-segment kernel the same, its per-segment copies being
      made again in the backward pass (its plan's indices, a few bytes per token, left out).
    """
    if cp == 1 and not (packed and device_type == "cpu"):
        return AttentionExtra()
    if cp > 1:  # the whole rows' K and V, less the local ones of the block's count
        return AttentionExtra(
            per_layer=parallel_cp.gathered_kv_bytes(
                cfg,
                seq_len=seq_len,
                micro_batch_size=micro_batch_size,
                activation_bytes=activation_bytes,
                tp=tp,
                cp=cp,
            )  # fmt: skip
        )
    b, p = micro_batch_size, activation_bytes
    kv = cfg.num_kv_heads * cfg.head_dim / tp
    q, pad = cfg.num_heads * cfg.head_dim / tp, BUCKET_PADDING
    copies = pad * (q + 2 * kv) + (1 + pad) * q  # padding of q, k, v; the bucketed output
    per_layer = b * seq_len * (copies * p + pad * cfg.num_heads / tp * FLOAT32)
    return AttentionExtra(per_layer=per_layer, once=b * seq_len * (2 + pad) * INDEX_BYTES)


def memory(shape: Shape, layout: Layout) -> MemoryEstimate:
    """Weights, gradients, optimizer states and activations on one GPU of ``layout``, and their
    peak together, for ``shape``.

    Parameters, their gradients and the optimizer states are float32 at any precision (the
    trainer's parameters are the master weights; FSDP2 reduces gradients in float32, autocast
    leaves them float32); ``param_dtype_bytes`` is what the matmuls compute in: FSDP2's gathered
    units, autocast's copies of the weights (without FSDP: kept for the backward pass) and the
    activations. A GPU holds its pipeline stage's parameters (``pp.stage_blocks`` blocks, the
    embedding or the output projection: the first and last stage), tp-th of them (norm weights,
    replicated over TP, are left out). FSDP2 (ZeRO-3) shards those over ``dp_shard x cp`` (CP
    ranks hold the same parameters) and replicates them over ``dp_replicate`` (HSDP); it adds
    the two unsharded blocks it holds while gathering (the current one and the prefetched next
    one), and the root unit (embeddings, final norm) with its gradient, which FSDP2 keeps whole.
    With Muon the hidden matrices keep one momentum buffer and the rest AdamW's two moments.

    Activations (`activation_bytes_per_token`) are for ``micro_batch_size x seq_len / cp``
    tokens per micro-batch, with what packed rows and CP add (`attention_extra_bytes`: by the
    attention kernel of ``device_type``) and the loss's buffers vocab-parallel over tp
    (`loss_buffer_bytes`); under PP the fuller end stage's (``pp.stage_activations_bytes``).

    Activations and gradients are never all live at once (measured on CPU with peak RSS
    sampled per phase of a step, 2 ranks; tests/flows/test_preflight_memory.py checks the total
    at several shapes). They peak together at one of three points:

    - the loss's forward pass: every activation and the loss's buffers (`loss_buffer_bytes`);
      no gradient exists yet, they were set to None after the last optimizer step;
    - the backward pass's start: every activation less the loss's logits chunk, and the last
      block's backward temporaries (`backward_working_bytes`);
    - the backward pass's end: every gradient, the first block's activations and, with FSDP,
      that block's unsharded gradient and the root's reduce-scattered shard beside its whole
      gradient; under TP the tied embedding's gradient buffers (``tp.embedding_backward_bytes``).

    Outside those, beside weights and optimizer states: the optimizer step (the gradients and
    its temporaries, `optimizer_step_bytes`), a validation pass of ``micro_batch_size`` rows
    (`validation_bytes`) and a checkpoint save (``pp.final_save_bytes``).
    """
    cfg, tp, cp, pp = shape.model, layout.tp, layout.cp, layout.pp
    if shape.optimizer not in OPTIMIZER_STATES:
        raise BadInputError(
            f"optimizer={shape.optimizer!r} must be one of {sorted(OPTIMIZER_STATES)}"
        )
    shards = layout.dp_shard * cp if shape.fsdp else 1
    per_block, root, blocks = _stage_parts(cfg, pp)
    params = (blocks * per_block + root) / tp
    if layout.ep > 1:  # EP: each rank holds E/ep experts (ep.py), FSDP2 shards them further
        params = parameters_per_rank(cfg, layout, shape.fsdp) * shards
        per_block -= parallel_ep.expert_parameters(cfg) / cfg.num_layers * (1 - 1 / layout.ep)
    state_floats = _optimizer_state_floats(cfg, params, blocks / tp, shape.optimizer)
    p = shape.param_dtype_bytes
    # NOTE: the parameters are float32 at any precision (they are the master weights), so are
    # their gradients (FSDP2's reduce_dtype; autocast's float32 leaves); bf16 exists only as
    # FSDP2's gathered units or autocast's copies of the weights.
    weights = gradients = params * FLOAT32 / shards
    reducing = casts = 0.0
    if shape.fsdp and shards > 1:
        # NOTE: FSDP2 keeps the root unit (embedding, output projection, final norm) gathered
        # from forward to backward, and its gradient is whole until reduce-scattered. Under EP
        # a gathered block holds its E/ep experts.
        weights += (2 * per_block + root) / tp * p
        gradients += root / tp * p
        reducing = (per_block + root / shards) / tp * p
    elif p < FLOAT32:
        # autocast's bf16 copy of each weight, saved for the backward pass (freed through it)
        casts = params * p
    tokens = shape.micro_batch_size * shape.seq_len / cp
    extra = attention_extra_bytes(
        cfg, seq_len=shape.seq_len, micro_batch_size=shape.micro_batch_size,
        activation_bytes=p, tp=tp, cp=cp, packed=shape.packed, device_type=shape.device_type,
    )  # fmt: skip
    activations = _stage_activations(shape, layout, tokens, extra)
    first_block = tokens * block_activation_bytes(cfg, p, tp, layout.ep) + extra.per_layer
    backward_end = gradients + reducing + first_block
    backward_end += parallel_tp.embedding_backward_bytes(
        cfg, tp, p if shards > 1 else FLOAT32, shape.device_type
    )
    backward_start = activations - logits_chunk_bytes(cfg, int(tokens), tp)
    backward_start += backward_working_bytes(cfg, tokens, p, tp)
    largest = max(cfg.vocab_size * cfg.hidden_size, 2 * cfg.intermediate_size * cfg.hidden_size)
    step = optimizer_step_bytes(
        params / shards, largest / tp / shards, shape.optimizer, shape.device_type
    )  # fmt: skip
    validation = validation_bytes(cfg, tokens, p, tp, pp, extra, shape.eval_batches) + casts
    return MemoryEstimate(
        weights_gb=weights / GB,
        gradients_gb=gradients / GB,
        optimizer_gb=state_floats * FLOAT32 / shards / GB,
        activations_gb=activations / GB,
        peak_live_gb=max(activations + casts, backward_start + casts, backward_end) / GB,
        optimizer_step_gb=step / GB,
        validation_gb=validation / GB,
        checkpoint_gb=parallel_pp.final_save_bytes(cfg, pp) / GB,
    )


def _stage_parts(cfg: ModelConfig, pp: int) -> tuple[float, float, int]:
    """(parameters per block, the root unit's, blocks) of the fullest pipeline stage: the root
    is the embedding, output projection and final norm (PP: the first stage holds the embedding,
    the last the output projection, and the fuller of the two is counted)."""
    per_block = (cfg.num_parameters(non_embedding=True) - cfg.hidden_size) / cfg.num_layers
    root = cfg.num_parameters() - cfg.num_layers * per_block
    if pp > 1:
        root = cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    return per_block, root, parallel_pp.stage_blocks(cfg.num_layers, pp)


def parameters_per_rank(cfg: ModelConfig, layout: Layout, fsdp: bool = True) -> float:
    """Parameters one rank holds between steps (its FSDP2 shard of its TP slice of its
    pipeline stage): what the weights, gradients and optimizer states are counted on. Under
    EP the experts are its E/ep of them (``ep.expert_parameters``), FSDP2-sharded over the
    rest of ``dp_shard``."""
    per_block, root, blocks = _stage_parts(cfg, layout.pp)
    shards = layout.dp_shard * layout.cp if fsdp else 1
    if layout.ep == 1:
        return (blocks * per_block + root) / layout.tp / shards
    layers = range(blocks)  # NOTE: EP runs without PP (support.py): every layer
    experts = parallel_ep.expert_parameters(cfg, layers=layers)
    expert_shards = layout.dp_shard_mod_ep * layout.cp if fsdp else 1
    mine = parallel_ep.expert_parameters(cfg, layout.ep, expert_shards, layers)
    return ((blocks * per_block + root - experts) / shards + mine) / layout.tp


def _optimizer_state_floats(cfg: ModelConfig, params: float, blocks: float, optimizer: str):
    """Float32 optimizer state elements for ``params`` parameters of which ``blocks`` blocks'
    hidden matrices (Muon's: one momentum; the rest AdamW's two moments)."""
    if optimizer != "muon":
        return params * OPTIMIZER_STATES[optimizer]
    hidden = hidden_matrix_parameters(cfg) / cfg.num_layers * blocks
    return hidden * OPTIMIZER_STATES["muon"] + (params - hidden) * OPTIMIZER_STATES["adamw"]


def optimizer_step_bytes(params: float, largest: float, optimizer: str, device: str) -> float:
    """The float32 gradients and the optimizer step's temporaries, for ``params`` parameters
    on this GPU of which the largest tensor holds ``largest``.

    On CUDA torch's optimizers take their ``foreach`` path, which makes one float32 tensor per
    parameter at once (AdamW: ``sqrt(exp_avg_sq)``; Lion: the update); on CPU they go tensor by
    tensor, two temporaries of the largest at once. SGD without momentum makes none.
    """
    if optimizer == "sgd":
        return params * FLOAT32
    temporaries = params if device == "cuda" else 2 * largest
    return (params + temporaries) * FLOAT32


def validation_bytes(
    cfg: ModelConfig,
    tokens: float,
    activation_bytes: int,
    tp: int,
    pp: int,
    extra: AttentionExtra,
    eval_batches: int = 4,
) -> float:
    """A validation pass beside weights and optimizer states (the gradients were freed).

    It is the train step's loss path forward only, without gradients (``callbacks.Validator``:
    the same CP shards, the fused or vocabulary-parallel loss): one block's tensors at a time
    (at most what a block keeps for its backward pass) with the attention's copies and gathered
    K/V, the residual stream and one chunk of the loss's logits; under PP every stage keeps its
    outputs of the ``eval_batches`` micro-batches until the schedule ends.
    """
    c = cfg.hidden_size
    block = tokens * block_activation_bytes(cfg, activation_bytes, tp) + extra.per_layer
    stream = tokens * 2 * c * activation_bytes  # the residual stream in and out of a block
    held = (eval_batches - 1) * tokens * c * activation_bytes if pp > 1 else 0.0
    return block + extra.once + stream + logits_chunk_bytes(cfg, int(tokens), tp) + held


def backward_working_bytes(
    cfg: ModelConfig, tokens: float, activation_bytes: int, tp: int
) -> float:
    """The last block's backward temporaries, beside every activation at the backward's start:
    SwiGLU's grad·up, silu's gradient and grad·silu (3I/tp per token) and the hidden-state
    gradient coming in and going out (2h, whole under TP: the gathered input's gradient)."""
    return tokens * (3 * cfg.intermediate_size / tp + 2 * cfg.hidden_size) * activation_bytes


def logits_chunk_bytes(cfg: ModelConfig, tokens: int, tp: int = 1) -> float:
    """The loss's float32 logits and log-probabilities of one chunk (freed after the forward)."""
    from llmflow.model import loss

    chunk_elements = getattr(loss, "CHUNK_ELEMENTS", None)
    rows = tokens if chunk_elements is None else max(1, chunk_elements // cfg.vocab_size)
    return 8 * min(rows, tokens) * cfg.vocab_size / tp


def _stage_activations(
    shape: Shape, layout: Layout, tokens: float, extra: AttentionExtra | None = None
) -> float:
    """Activations of the fullest pipeline stage at the loss's forward pass (the whole model
    without PP): blocks, embedding output, the loss's hidden-state gradient and buffers."""
    cfg, p, tp = shape.model, shape.param_dtype_bytes, layout.tp
    extra = extra or AttentionExtra()
    ac, every_k = shape.activation_checkpointing, shape.every_k
    recomputed = checkpointed_blocks(cfg, ac, every_k)
    kept_layers = cfg.num_layers - recomputed + (1 if recomputed else 0)
    whole = tokens * activation_bytes_per_token(cfg, p, ac, every_k, tp, layout.ep)
    whole += kept_layers * extra.per_layer
    loss = loss_buffer_bytes(cfg, int(tokens), tp) + extra.once
    if layout.pp == 1:
        return whole + loss
    c = cfg.hidden_size
    embedding, loss_gradient = tokens * c / tp * p, tokens * c * p
    return parallel_pp.stage_activations_bytes(
        whole - embedding - loss_gradient, embedding, loss_gradient, loss, extra.once,
        num_layers=cfg.num_layers, pp=layout.pp, micro_batches=shape.micro_batches,
        schedule=layout.pp_schedule,
    )  # fmt: skip


def hidden_matrix_parameters(cfg: ModelConfig) -> int:
    """Parameters of the blocks' 2-D weights (attention and MLP projections): what Muon takes."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_block = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    per_block += 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_block
