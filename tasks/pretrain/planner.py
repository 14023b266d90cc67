"""Back-of-the-envelope plan for a pretraining run: parameters, FLOPs, memory per GPU, time.

The estimates are the standard ones: 6N + 12·L·C·T FLOPs per token (Kaplan et al. 2020, PaLM
appendix B), Chinchilla's 20 tokens per parameter (Hoffmann et al. 2022), and activation memory
counted tensor by tensor for this model's block (Korthikanti et al. 2022 redone for RMSNorm,
GQA, SDPA and SwiGLU: `block_activation_bytes`), per GPU of a TP/CP/PP/FSDP2 layout
(`memory_per_gpu`). Choosing the layout is `layout_planner`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmflow.model.config import ModelConfig
from llmflow.tasks.framework.errors import BadInputError

GB = 1e9
HEADROOM = 0.9
"""Fraction of GPU memory a plan may use; the rest is CUDA context and allocator fragmentation."""
CHINCHILLA_TOKENS_PER_PARAM = 20
NO_STAGE = "no pretraining stage (pretrain.stages is empty)"
"""How plans and preflight name a recipe that post-trains its ``init`` model directly."""
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
    """Activations and gradients at their fullest point together (see `memory_per_gpu`)."""
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


@dataclass
class Plan:
    """What a run costs; `warnings` proposes fixes when it does not fit or looks wrong."""

    num_parameters: int
    num_non_embedding_parameters: int
    flops_per_token: float
    """Model FLOPs per trained token (forward + backward), without recomputation."""
    memory: MemoryEstimate
    chinchilla_tokens: int
    num_tokens: int
    num_steps: int
    grad_accum_steps: int
    estimated_hours: float
    fits: bool
    warnings: list[str] = field(default_factory=list)
    predicted_loss: float | None = None
    """Validation loss from the recipe's fitted scaling law (``llmflow ladder``), if one exists."""


def precision_bytes(train, device_type: str = "cuda") -> int:
    """Bytes per parameter copy, gradient and activation a ``TrainConfig`` computes in on
    ``device_type``: 2 in bf16 (float32 master weights counted apart), 4 in fp32.

    ``auto`` is bf16 on CUDA: a recipe's plan is for the GPUs it declares, so it plans bf16;
    preflight's rehearsal on a CPU plans fp32 unless the recipe asks for bf16.
    """
    import torch

    return torch.finfo(train.compute_dtype(device_type)).bits // 8


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6N + 12·L·C·T, N = non-embedding parameters + the output projection (tied or not).

    The input embedding is a lookup, not a matmul, so it is left out of N; the few norm weights
    stay in, as in nanoGPT's MFU estimate. The attention term
    counts QK^T and AV over the full T×T square, as PaLM's MFU convention does.
    """
    matmul_params = cfg.num_parameters(non_embedding=True) + cfg.vocab_size * cfg.hidden_size
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return 6 * matmul_params + attention


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
    per_block = block_activation_bytes(cfg, activation_bytes, tp)
    recomputed = checkpointed_blocks(cfg, activation_checkpointing, every_k)
    blocks = (cfg.num_layers - recomputed) * per_block
    if recomputed:
        blocks += recomputed * c * activation_bytes / tp + per_block
    return blocks + (c / tp + c) * activation_bytes


FLOAT32 = 4
"""Bytes of the float32 statistics a block keeps in any precision (RMSNorm's 1/rms, SDPA's
logsumexp)."""


def block_activation_bytes(cfg: ModelConfig, activation_bytes: int, tp: int = 1) -> float:
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
    """
    c, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    elements = 2 * c + (6 * c + 2 * kv + 4 * cfg.intermediate_size) / tp
    return elements * activation_bytes + (cfg.num_heads + 2) * FLOAT32 / tp


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
    b, local, p = micro_batch_size, seq_len / cp, activation_bytes
    kv = cfg.num_kv_heads * cfg.head_dim / tp
    if cp > 1:  # the whole rows' K and V, less the local ones of the block's count
        return AttentionExtra(per_layer=2 * b * (seq_len - local) * kv * p)
    q, pad = cfg.num_heads * cfg.head_dim / tp, BUCKET_PADDING
    copies = pad * (q + 2 * kv) + (1 + pad) * q  # padding of q, k, v; the bucketed output
    per_layer = b * seq_len * (copies * p + pad * cfg.num_heads / tp * FLOAT32)
    return AttentionExtra(per_layer=per_layer, once=b * seq_len * (2 + pad) * INDEX_BYTES)


def memory_per_gpu(
    cfg: ModelConfig,
    *,
    seq_len: int,
    micro_batch_size: int,
    num_gpus: int,
    param_dtype_bytes: int,
    optimizer: str,
    fsdp: bool,
    activation_checkpointing: bool | str,
    every_k: int = 2,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    dp_shard: int | None = None,
    dp_replicate: int = 1,
    micro_batches: int = 1,
    pp_schedule: str = "1f1b",
    packed: bool = False,
    device_type: str = "cuda",
    eval_batches: int = 4,
) -> MemoryEstimate:
    """Weights, gradients, optimizer states and activations on one GPU, and their peak together,
    for the layout ``dp_replicate x dp_shard x cp x tp x pp = num_gpus``.

    Parameters, their gradients and the optimizer states are float32 at any precision (the
    trainer's parameters are the master weights; FSDP2 reduces gradients in float32, autocast
    leaves them float32); ``param_dtype_bytes`` is what the matmuls compute in: FSDP2's gathered
    units, autocast's copies of the weights (without FSDP: kept for the backward pass) and the
    activations. A GPU holds its pipeline stage's parameters (ceil(L/pp) blocks, the embedding or the output
    projection: the first and last stage), tp-th of them (norm weights, replicated over TP,
    are left out). FSDP2 (ZeRO-3) shards those over ``dp_shard x cp`` (CP ranks hold the same
    parameters) and replicates them over ``dp_replicate`` (HSDP); it adds the two unsharded
    blocks it holds while gathering (the current one and the prefetched next one), and the
    root unit (embeddings, final norm) with its gradient, which FSDP2 keeps whole. With Muon
    the hidden matrices keep one momentum buffer and the rest AdamW's two moments.
    ``dp_shard`` defaults to the GPUs the other degrees leave.

    Activations (`activation_bytes_per_token`) are for ``micro_batch_size x seq_len / cp``
    tokens per micro-batch, with what packed rows and CP add (`attention_extra_bytes`: by the
    attention kernel of ``device_type``) and the loss's
    buffers vocab-parallel over tp (`loss_buffer_bytes`). With pipeline parallelism the first
    stage holds the activations of the micro-batches in flight (1F1B: min(pp, micro_batches);
    GPipe: all ``micro_batches``) and the last the loss; the fuller of the two is counted.

    Activations and gradients are never all live at once (measured on CPU with peak RSS
    sampled per phase of a step, 2 ranks; tests/flows/test_preflight_memory.py checks the total
    at several shapes). They peak together at one of three points:

    - the loss's forward pass: every activation and the loss's buffers (`loss_buffer_bytes`);
      no gradient exists yet, they were set to None after the last optimizer step;
    - the backward pass's start: every activation less the loss's logits chunk, and the last
      block's backward temporaries (`backward_working_bytes`);
    - the backward pass's end: every gradient, the first block's activations and, with FSDP,
      that block's unsharded gradient and the root's reduce-scattered shard beside its whole
      gradient; under TP the tied embedding's gradient buffers (`embedding_backward_bytes`).

    Outside those, beside weights and optimizer states: the optimizer step (the gradients and
    its temporaries, `optimizer_step_bytes`), a validation pass of ``micro_batch_size`` rows
    (`validation_bytes`) and a checkpoint save (`checkpoint_bytes`).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise BadInputError(f"optimizer={optimizer!r} must be one of {sorted(OPTIMIZER_STATES)}")
    if dp_shard is None:
        dp_shard = max(1, num_gpus // (dp_replicate * tp * cp * pp))
    shards = dp_shard * cp if fsdp else 1
    per_block = (cfg.num_parameters(non_embedding=True) - cfg.hidden_size) / cfg.num_layers
    root = cfg.num_parameters() - cfg.num_layers * per_block  # embedding, output, final norm
    stage_blocks = math.ceil(cfg.num_layers / pp)
    if pp > 1:  # NOTE: the first stage holds the embedding, the last the output projection
        root = cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    params = (stage_blocks * per_block + root) / tp
    if optimizer == "muon":
        hidden = hidden_matrix_parameters(cfg) / cfg.num_layers * stage_blocks / tp
        state_floats = hidden * OPTIMIZER_STATES["muon"]
        state_floats += (params - hidden) * OPTIMIZER_STATES["adamw"]
    else:
        state_floats = params * OPTIMIZER_STATES[optimizer]
    p = param_dtype_bytes
    # NOTE: the parameters are float32 at any precision (they are the master weights), so are
    # their gradients (FSDP2's reduce_dtype; autocast's float32 leaves); bf16 exists only as
    # FSDP2's gathered units or autocast's copies of the weights.
    weights = params * FLOAT32 / shards
    gradients = params * FLOAT32 / shards
    reducing = casts = 0.0
    if fsdp and shards > 1:
        weights += 2 * per_block / tp * p
        # NOTE: FSDP2 keeps the root unit (embedding, output projection, final norm) gathered
        # from forward to backward, and its gradient is whole until reduce-scattered.
        weights += root / tp * p
        gradients += root / tp * p
        reducing = (per_block + root / shards) / tp * p
    elif p < FLOAT32:
        # autocast's bf16 copy of each weight, saved for the backward pass (freed through it)
        casts = params * p
    tokens = micro_batch_size * seq_len / cp
    extra = attention_extra_bytes(
        cfg, seq_len=seq_len, micro_batch_size=micro_batch_size,
        activation_bytes=p, tp=tp, cp=cp, packed=packed, device_type=device_type,
    )  # fmt: skip
    activations = _stage_activations(
        cfg, tokens, p, activation_checkpointing, every_k, tp, pp,
        micro_batches, pp_schedule, extra,
    )  # fmt: skip
    first_block = tokens * block_activation_bytes(cfg, p, tp) + extra.per_layer
    backward_end = gradients + reducing + first_block
    backward_end += embedding_backward_bytes(cfg, tp, p if shards > 1 else FLOAT32, device_type)
    backward_start = activations - logits_chunk_bytes(cfg, int(tokens), tp)
    backward_start += backward_working_bytes(cfg, tokens, p, tp)
    largest = max(cfg.vocab_size * cfg.hidden_size, 2 * cfg.intermediate_size * cfg.hidden_size)
    step = optimizer_step_bytes(
        params / shards, largest / tp / shards, optimizer, device_type
    )  # fmt: skip
    validation = validation_bytes(cfg, tokens, p, tp, pp, extra, eval_batches) + casts
    return MemoryEstimate(
        weights_gb=weights / GB,
        gradients_gb=gradients / GB,
        optimizer_gb=state_floats * FLOAT32 / shards / GB,
        activations_gb=activations / GB,
        peak_live_gb=max(activations + casts, backward_start + casts, backward_end) / GB,
        optimizer_step_gb=step / GB,
        validation_gb=validation / GB,
        checkpoint_gb=checkpoint_bytes(cfg, tp, pp, optimizer, stage_blocks) / GB,
    )


EMBEDDING_BACKWARD_BUFFERS = {"cuda": 2, "cpu": 4}
"""(V/tp, C) buffers the tied embedding's backward adds under TP, beside its gradient."""


def embedding_backward_bytes(cfg: ModelConfig, tp: int, grad_bytes: int, device: str) -> float:
    """What the tied embedding's backward pass adds under tensor parallelism.

    In one process the fused loss and the embedding share one float32 gradient buffer
    (``model/loss.py`` `TiedGradient`); under TP (a DTensor weight) they do not: the embedding's
    dense (V/tp, C) gradient and its sum with the loss's are made beside the loss's gradient.
    On CPU the dense backward makes two more (measured: 4 buffers at the embedding's backward,
    tests/tasks/pretrain/test_planner_parallel_memory.py).
    """
    if tp == 1 or not cfg.tie_embeddings:
        return 0.0
    buffers = EMBEDDING_BACKWARD_BUFFERS.get(device, EMBEDDING_BACKWARD_BUFFERS["cuda"])
    return buffers * cfg.vocab_size / tp * cfg.hidden_size * grad_bytes


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


def checkpoint_bytes(
    cfg: ModelConfig, tp: int, pp: int, optimizer: str, stage_blocks: int
) -> float:
    """What a checkpoint save gathers on the GPU beside weights and optimizer states.

    - Under TP nothing: each rank writes and reads its own runs of canonical rows in place
      (``parallel/tp.py`` ``CanonicalRows`` and its DCP planners), so no tensor is gathered.
    - Under PP the final save gathers this stage's full state (every parameter whole, float32)
      on the GPU of every rank (``get_model_state_dict(cpu_offload=False)``; each pipeline
      group sends it to its first rank).
    """
    del optimizer  # NOTE: the optimizer's state is never gathered, whatever the layout
    if pp == 1:
        return 0.0
    c = cfg.hidden_size
    per_block = (cfg.num_parameters(non_embedding=True) - c) / cfg.num_layers
    return (stage_blocks * per_block + cfg.vocab_size * c + c) * FLOAT32


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
    cfg: ModelConfig,
    tokens: float,
    activation_bytes: int,
    activation_checkpointing: bool | str,
    every_k: int,
    tp: int,
    pp: int,
    micro_batches: int,
    pp_schedule: str,
    extra: AttentionExtra | None = None,
) -> float:
    """Activations of the fullest pipeline stage at the loss's forward pass (the whole model
    without PP): blocks, embedding output, the loss's hidden-state gradient and buffers."""
    extra = extra or AttentionExtra()
    recomputed = checkpointed_blocks(cfg, activation_checkpointing, every_k)
    kept_layers = cfg.num_layers - recomputed + (1 if recomputed else 0)
    whole = tokens * activation_bytes_per_token(
        cfg, activation_bytes, activation_checkpointing, every_k, tp
    )
    whole += kept_layers * extra.per_layer
    loss = loss_buffer_bytes(cfg, int(tokens), tp) + extra.once
    if pp == 1:
        return whole + loss
    c = cfg.hidden_size
    ends = tokens * (c / tp + c) * activation_bytes  # embedding output, hidden-state gradient
    stage = (whole - ends) * math.ceil(cfg.num_layers / pp) / cfg.num_layers
    in_flight = micro_batches if pp_schedule == "gpipe" else min(pp, micro_batches)
    first = in_flight * (stage + tokens * c / tp * activation_bytes) + extra.once
    last_in_flight = micro_batches if pp_schedule == "gpipe" else 1
    last = last_in_flight * (stage + tokens * c * activation_bytes) + loss
    return max(first, last)


def hidden_matrix_parameters(cfg: ModelConfig) -> int:
    """Parameters of the blocks' 2-D weights (attention and MLP projections): what Muon takes."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_block = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    per_block += 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_block


def plan(
    model_cfg: ModelConfig,
    *,
    seq_len: int,
    global_batch_tokens: int,
    num_tokens: int,
    num_gpus: int = 1,
    gpu_mem_gb: float = 80,
    mfu: float = 0.4,
    peak_tflops: float = 989,
    param_dtype_bytes: int = 2,
    optimizer: str = "adamw",
    fsdp: bool = True,
    micro_batch_size: int = 1,
    activation_checkpointing: bool | str = False,
    every_k: int = 2,
    layout=None,
    packed: bool = False,
) -> Plan:
    """Estimate a pretraining run and say whether it fits in GPU memory.

    Args:
        model_cfg: the model.
        seq_len: tokens per sequence.
        global_batch_tokens: tokens per optimizer step over all GPUs.
        num_tokens: tokens to train on.
        num_gpus: data-parallel GPUs.
        gpu_mem_gb: memory of one GPU (GB); a plan fits within `HEADROOM` of it.
        mfu: model FLOPs utilization expected.
        peak_tflops: dense peak of one GPU at the training precision (H100 SXM bf16: 989).
        param_dtype_bytes: bytes per parameter, gradient and activation (bf16: 2).
        optimizer: "adamw", "muon" (hidden matrices; AdamW for the rest), "lion" or "sgd".
        fsdp: shard weights, gradients and optimizer states across GPUs (ZeRO-3).
        micro_batch_size: sequences per GPU per forward pass.
        activation_checkpointing: recompute blocks in the backward pass: True or "full" (every
            block), "selective" (every ``every_k``-th block), False or "none".
        every_k: the selective interval.
        layout: a resolved ``parallel.config.Layout`` of the `num_gpus` (None: FSDP over all).
        packed: rows hold several documents (`attention_extra_bytes`: on CUDA their kernels
            keep nothing more than one document's).
    """
    _check_positive(seq_len=seq_len, global_batch_tokens=global_batch_tokens,
                    num_tokens=num_tokens, num_gpus=num_gpus, gpu_mem_gb=gpu_mem_gb, mfu=mfu,
                    peak_tflops=peak_tflops, micro_batch_size=micro_batch_size)  # fmt: skip
    memory_kwargs = dict(
        seq_len=seq_len, micro_batch_size=micro_batch_size, num_gpus=num_gpus,
        param_dtype_bytes=param_dtype_bytes, optimizer=optimizer, fsdp=fsdp,
        activation_checkpointing=activation_checkpointing, every_k=every_k, packed=packed,
    )  # fmt: skip
    if layout is not None and not layout.is_plain:
        memory_kwargs.update(tp=layout.tp, cp=layout.cp, pp=layout.pp, dp_shard=layout.dp_shard,
                             dp_replicate=layout.dp_replicate, pp_schedule=layout.pp_schedule)  # fmt: skip
    memory = memory_per_gpu(model_cfg, **memory_kwargs)
    fits = memory.total_gb <= HEADROOM * gpu_mem_gb
    per_token = flops_per_token(model_cfg, seq_len)
    # NOTE: checkpointing runs a recomputed block's forward twice: 8N instead of 6N of work.
    recomputed = checkpointed_blocks(model_cfg, activation_checkpointing, every_k)
    hardware_flops = per_token * num_tokens * (1 + recomputed / model_cfg.num_layers / 3)
    seconds = hardware_flops / (num_gpus * peak_tflops * 1e12 * mfu)
    data_parallel = layout.dp if layout is not None else num_gpus
    tokens_per_micro_step = micro_batch_size * seq_len * data_parallel
    params = model_cfg.num_parameters()
    result = Plan(
        num_parameters=params,
        num_non_embedding_parameters=model_cfg.num_parameters(non_embedding=True),
        flops_per_token=per_token,
        memory=memory,
        chinchilla_tokens=CHINCHILLA_TOKENS_PER_PARAM * params,
        num_tokens=num_tokens,
        num_steps=math.ceil(num_tokens / global_batch_tokens),
        grad_accum_steps=max(1, math.ceil(global_batch_tokens / tokens_per_micro_step)),
        estimated_hours=seconds / 3600,
        fits=fits,
    )
    result.warnings = _batch_warnings(model_cfg, result, seq_len, global_batch_tokens,
                                      tokens_per_micro_step)  # fmt: skip
    if not fits:
        result.warnings += _memory_fixes(model_cfg, memory, gpu_mem_gb, memory_kwargs)
    return result


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise BadInputError(f"{name}={value} must be > 0")


def _batch_warnings(
    cfg: ModelConfig, result: Plan, seq_len: int, global_batch_tokens: int, micro_tokens: int
) -> list[str]:
    warnings = []
    if seq_len > cfg.max_seq_len:
        warnings.append(
            f"seq_len={seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}: "
            "raise max_seq_len or extend the context (ABF/YaRN) first"
        )
    if global_batch_tokens % micro_tokens:
        warnings.append(
            f"global_batch_tokens={global_batch_tokens} is not a multiple of micro_batch_size x "
            f"seq_len x num_gpus = {micro_tokens}; each step will use "
            f"{result.grad_accum_steps * micro_tokens} tokens"
        )
    if result.num_tokens < result.chinchilla_tokens / 2:
        warnings.append(
            f"num_tokens={result.num_tokens:.3g} is under half the Chinchilla-optimal "
            f"{result.chinchilla_tokens:.3g} (20 x parameters): the model will be undertrained"
        )
    return warnings


def _memory_fixes(
    cfg: ModelConfig, memory: MemoryEstimate, gpu_mem_gb: float, kwargs: dict
) -> list[str]:
    """Propose the changes that shrink the largest parts, each with its new total."""
    budget = HEADROOM * gpu_mem_gb
    fixes = [f"needs {memory.total_gb:.1f} GB per GPU, over {budget:.1f} GB usable"]

    def total(**changes) -> float:
        return memory_per_gpu(cfg, **{**kwargs, **changes}).total_gb

    if not kwargs["fsdp"] and kwargs["num_gpus"] > 1:
        fixes.append(f"enable fsdp (shard states over {kwargs['num_gpus']} GPUs): "
                     f"{total(fsdp=True):.1f} GB")  # fmt: skip
    sharded = memory.weights_gb + memory.gradients_gb + memory.optimizer_gb
    if sharded > memory.activations_gb:
        for num_gpus in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            if num_gpus > kwargs["num_gpus"] and total(num_gpus=num_gpus, fsdp=True) <= budget:
                fixes.append(f"more sharding: fsdp over num_gpus={num_gpus}: "
                             f"{total(num_gpus=num_gpus, fsdp=True):.1f} GB")  # fmt: skip
                break
    if kwargs["micro_batch_size"] > 1:
        fixes.append(f"smaller micro-batch: micro_batch_size=1 (more gradient accumulation): "
                     f"{total(micro_batch_size=1):.1f} GB")  # fmt: skip
    if checkpointed_blocks(cfg, kwargs["activation_checkpointing"]) < cfg.num_layers:
        fixes.append(f"activation_checkpointing=full (about 33% more compute): "
                     f"{total(activation_checkpointing=True):.1f} GB")  # fmt: skip
    return fixes


def format_plan(p: Plan) -> str:
    """A human-readable summary of a plan, one fact per line."""
    m = p.memory
    lines = [
        f"parameters           {p.num_parameters / 1e6:,.1f}M "
        f"({p.num_non_embedding_parameters / 1e6:,.1f}M non-embedding)",
        f"FLOPs per token      {p.flops_per_token:.3e}",
        f"tokens               {p.num_tokens:.3e} (Chinchilla-optimal "
        f"{p.chinchilla_tokens:.3e}, x{p.num_tokens / p.chinchilla_tokens:.2f})",
        f"steps                {p.num_steps:,} (gradient accumulation {p.grad_accum_steps})",
        f"estimated time       {p.estimated_hours:,.2f} h",
        "memory per GPU (GB)  "
        f"weights {m.weights_gb:.2f} + optimizer {m.optimizer_gb:.2f} + activations and "
        f"gradients at their peak {m.peak_live_gb:.2f} (activations {m.activations_gb:.2f}, "
        f"gradients {m.gradients_gb:.2f}) = {m.total_gb:.2f}",
        f"  and beside weights and optimizer: optimizer step {m.optimizer_step_gb:.2f}, "
        f"validation {m.validation_gb:.2f}, checkpoint save {m.checkpoint_gb:.2f} (the total "
        f"takes the largest: {m.peak_gb:.2f})",
        f"fits                 {'yes' if p.fits else 'NO'}",
    ]
    if p.predicted_loss is not None:
        lines.append(f"predicted val loss   {p.predicted_loss:.4f} (fitted scaling law)")
    lines += [f"warning: {w}" for w in p.warnings]
    return "\n".join(lines)


def recipe_plan(
    pretrain,
    hardware,
    *,
    num_gpus: int | None = None,
    gpu_mem_gb: float | None = None,
    mfu: float | None = None,
) -> Plan:
    """The plan of a recipe's pretraining stages on the hardware it declares.

    ``pretrain`` is a ``PretrainConfig`` and ``hardware`` a ``HardwareConfig``; the keyword
    arguments replace the declared GPU count, memory and MFU (``llmflow plan --gpus ...``).

    Raises:
        BadInputError: the recipe has no pretraining stage (``NO_STAGE``): nothing to plan.
    """
    if not pretrain.stages:
        raise BadInputError(f"{NO_STAGE}: no pretraining tokens, steps, time or memory to plan")
    num_gpus = num_gpus or hardware.gpus
    train = pretrain.train
    batch = train.batch
    seq_len = max(s.mixture.seq_len for s in pretrain.stages)
    layout = train.parallel.resolve(num_gpus)  # the recipe's; plain FSDP2 at the default
    return plan(
        pretrain.train.model_config_obj(),
        seq_len=seq_len,
        global_batch_tokens=batch.micro_batch_size * batch.grad_accum_steps * seq_len * layout.dp,
        num_tokens=sum(s.mixture.num_tokens for s in pretrain.stages),
        num_gpus=num_gpus,
        gpu_mem_gb=gpu_mem_gb or hardware.gpu_mem_gb,
        mfu=mfu or hardware.mfu,
        peak_tflops=hardware.peak_tflops,
        param_dtype_bytes=precision_bytes(train),
        micro_batch_size=batch.micro_batch_size,
        optimizer=train.optimizer.name,
        activation_checkpointing=train.activation_checkpointing,
        every_k=train.activation_checkpointing_every_k,
        layout=layout,
        packed=True,  # packed rows hold several documents
    )


def extension_memory(pretrain, extend, hardware, num_gpus: int | None = None) -> list[str]:
    """One line per context-extension stage: its memory per GPU at its length, micro-batch and
    layout (the stage's ``parallel``, else ``pretrain.train.parallel``).

    ``extend`` is an ``ExtendConfig``. A stage over the usable memory gets a warning: long
    sequences need activation checkpointing or context parallelism its layout does not use
    (``llmflow plan`` proposes a layout that fits).
    """
    from llmflow.tasks.extend.config import extension_train_config

    num_gpus = num_gpus or hardware.gpus
    lines = []
    for stage in extend.stages:
        train = extension_train_config(pretrain.train, stage)
        layout = train.parallel.resolve(num_gpus, train.model_config_obj(), stage.seq_len)
        memory = memory_per_gpu(
            train.model_config_obj(), seq_len=stage.seq_len,
            micro_batch_size=stage.micro_batch_size, num_gpus=num_gpus,
            param_dtype_bytes=precision_bytes(train), optimizer=train.optimizer.name, fsdp=True,
            activation_checkpointing=train.activation_checkpointing,
            every_k=train.activation_checkpointing_every_k, tp=layout.tp, cp=layout.cp,
            pp=layout.pp, dp_shard=layout.dp_shard, dp_replicate=layout.dp_replicate,
            micro_batches=train.batch.grad_accum_steps, pp_schedule=layout.pp_schedule,
            packed=True,
        )  # fmt: skip
        fits = memory.total_gb <= HEADROOM * hardware.gpu_mem_gb
        where = "" if layout.is_plain else f" at tp={layout.tp} cp={layout.cp} pp={layout.pp}"
        lines.append(
            f"extension ctx{stage.seq_len:<7} {memory.total_gb:,.1f} GB per GPU{where} "
            f"(activations {memory.activations_gb:,.1f}): "
            + ("fits" if fits else "does NOT fit: needs activation checkpointing or context "
               "parallelism (`llmflow plan` proposes a layout), or a shorter seq_len")
        )  # fmt: skip
    return lines
