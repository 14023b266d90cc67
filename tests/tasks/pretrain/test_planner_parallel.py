"""The layout-aware memory, bubble and traffic estimates by hand, and the layout choice."""

import math

import pytest
import torch

from llmflow.model.config import ModelConfig, preset
from llmflow.model.transformer import Transformer
from llmflow.tasks.config import load_config
from llmflow.tasks.framework.errors import ConfigError
from llmflow.tasks.pretrain.layout_planner import (
    bubble_fraction,
    choose_layout,
    communication,
    parse_parallel,
    stage_layout_plans,
)
from llmflow.tasks.pretrain.parallel.config import Layout
from llmflow.tasks.pretrain.planner import (
    GB,
    HEADROOM,
    block_activation_bytes,
    loss_buffer_bytes,
    memory_per_gpu,
)

TINY = ModelConfig(vocab_size=512, hidden_size=96, num_heads=4, num_kv_heads=2,
                   intermediate_size=320, num_layers=4)  # fmt: skip
H, KV, INTER, A = 96, 2 * 24, 320, 4  # hidden, kv heads x head_dim, intermediate, heads


def test_block_activations_term_by_term():
    """Korthikanti's per-layer count redone for our block, by hand, bf16, without and with TP."""
    p = 2
    norms = 2 * H + 2 * H  # both RMSNorms' input and output
    matmul_inputs = 2 * H  # flattened inputs of qkv and gate/up (gathered whole under SP)
    attention = H + 2 * KV + H  # rotated q, k and v of the KV heads, SDPA output = o_proj input
    swiglu = 4 * INTER  # gate, up, silu(gate), product
    floats = (A + 2) * 4  # logsumexp per head, 1/rms per norm, float32
    assert (
        block_activation_bytes(TINY, p) == (norms + matmul_inputs + attention + swiglu) * p + floats
    )
    tp = 2
    sharded = (norms + attention + swiglu) / tp  # sequence- or head-sharded
    assert block_activation_bytes(TINY, p, tp) == (matmul_inputs + sharded) * p + floats / tp
    # no a*s*s term: the bytes per token do not depend on the sequence length
    paper = 34 * H + 5 * A * 4096  # Korthikanti's bytes per token at s = 4096, for contrast
    assert block_activation_bytes(TINY, p) < paper / 10


def _saved_bytes(model, docs, batch: int, seq_len: int) -> float:
    """Bytes autograd keeps for the first block of ``model`` (its parameters aside), each
    storage counted once."""
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = model.embed(torch.randint(0, 512, (batch, seq_len)))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model.layers[0](x, model.rope(torch.arange(seq_len)[None], x.dtype), docs)
    return sum(storages.values())


def test_block_formula_against_saved_tensors():
    """What autograd keeps for one block (float32): the formula plus RoPE's shared tables."""
    batch, seq_len = 2, 64
    measured = _saved_bytes(Transformer(TINY), None, batch, seq_len) / (batch * seq_len)
    rope_tables = 2 * 24 * 4 / batch  # cos and sin (their full-width storage) per position
    assert block_activation_bytes(TINY, 4) + rope_tables == pytest.approx(measured, rel=1e-6)


@pytest.mark.parametrize(
    "lengths,padding",
    [([8, 8, 48], 0.25), ([32, 32], 0.0), ([17, 47], 4 / 64), ([20, 27, 17], 4 / 64)],
)
def test_packed_rows_on_cpu_against_saved_tensors(lengths, padding):
    """Packed rows on CPU (``sdpa-buckets``): what autograd keeps for one block is the block's
    formula plus the planner's attention term, the documents' copies padded to their buckets.
    At the plan's padding (8-token documents padded to 16 and a 48-token one: 25%) it is exact;
    any documents of 16 tokens or more stay below it."""
    from llmflow.model.kernels import Documents
    from llmflow.tasks.pretrain.planner import BUCKET_PADDING, attention_extra_bytes

    model, batch, seq_len = Transformer(TINY), 2, 64
    cu = torch.tensor([0, *lengths]).cumsum(0)
    docs = Documents.of(batch, seq_len, cu_seqlens=torch.cat([cu, cu[1:] + seq_len]))
    rope_tables = 2 * 24 * 4 * seq_len  # cos and sin (their full-width storage)
    measured = _saved_bytes(model, docs, batch, seq_len) - rope_tables
    extra = attention_extra_bytes(TINY, seq_len=seq_len, micro_batch_size=batch,
                                  activation_bytes=4, packed=True, device_type="cpu")  # fmt: skip
    planned = batch * seq_len * block_activation_bytes(TINY, 4) + extra.per_layer + extra.once
    # by hand, per token: the padding of q, k, v and of the logsumexp, the bucketed output,
    # each slot's and each token's int64 index
    q = A * 24
    by_hand = (padding * (q + 2 * KV) + (1 + padding) * q + padding * A) * 4
    by_hand += (2 + padding) * 8
    unpacked = _saved_bytes(model, None, batch, seq_len) - rope_tables
    assert measured - unpacked == pytest.approx(batch * seq_len * by_hand)
    if padding == BUCKET_PADDING:
        assert measured == pytest.approx(planned)
    assert measured <= planned


@pytest.mark.parametrize("packed", [False, True])
def test_cp_attention_on_cpu_keeps_its_inputs_output_and_logsumexp(packed):
    """Under CP on CPU, ``SequenceShard.attend`` keeps the local q, the whole rows' K and V,
    its output and float32 logsumexp for the backward pass: no mask and no segment copies, so
    the planner's CP term is the gathered K and V alone (rank 1 of cp=2, documents crossing
    the chunks)."""
    from llmflow.model.attention import document_ids
    from llmflow.model.context import SequenceShard
    from llmflow.tasks.pretrain.parallel.cp import gather_order, zigzag_index

    batch, seq_len, cp, dim = 2, 64, 2, 24
    cu = torch.tensor([0, 5, 19, 64, 74, 96, 97, 128] if packed else [0, 64, 128])
    doc_ids = document_ids(batch, seq_len, None, cu) if packed else None
    shard = SequenceShard(None, zigzag_index(seq_len, cp, 1), gather_order(seq_len, cp), doc_ids)
    local = seq_len // cp
    q = torch.randn(batch, A, local, dim, requires_grad=True)
    k, v = (torch.randn(batch, 2, seq_len, dim, requires_grad=True) for _ in range(2))
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        shard.attend(q, k, v)
    tokens = batch * local
    kept = tokens * A * dim * 4 + 2 * batch * seq_len * KV * 4  # q; whole rows' K and V
    kept += tokens * A * dim * 4 + tokens * A * 4  # output, logsumexp
    assert sum(storages.values()) == kept


@pytest.mark.parametrize("cp", [1, 2])
def test_packed_rows_on_cuda_keep_no_mask(cp):
    """On CUDA packed rows run ``varlen`` or ``flex``: KV heads shared, no mask, nothing beyond
    one document per row's attention; under CP only the whole rows' K and V of the KV heads."""
    from llmflow.tasks.pretrain.planner import attention_extra_bytes

    kwargs = dict(seq_len=256, micro_batch_size=2, num_gpus=2, param_dtype_bytes=2, cp=cp,
                  optimizer="adamw", fsdp=True, activation_checkpointing="none")  # fmt: skip
    assert memory_per_gpu(TINY, packed=True, **kwargs) == memory_per_gpu(TINY, **kwargs)
    extra = attention_extra_bytes(TINY, seq_len=256, micro_batch_size=2, activation_bytes=2,
                                  cp=cp, packed=True)  # fmt: skip
    assert extra.once == 0
    assert extra.per_layer == 2 * 2 * (256 - 256 / cp) * KV * 2  # K and V, 2 rows, bf16


def test_layout_memory_by_hand():
    """tp=2, cp=2, pp=2, dp_shard=2 on 16 GPUs: states divide by tp and the stage, shard over
    dp_shard x cp; activations of s/cp tokens, 1F1B's pp micro-batches in flight."""
    cfg, p = TINY, 2
    kwargs = dict(seq_len=256, micro_batch_size=2, num_gpus=16, param_dtype_bytes=p,
                  optimizer="adamw", fsdp=True, activation_checkpointing="none")  # fmt: skip
    m = memory_per_gpu(cfg, tp=2, cp=2, pp=2, dp_shard=2, micro_batches=4, **kwargs)
    per_block = (cfg.num_parameters(non_embedding=True) - H) / 4
    stage = (2 * per_block + 512 * H + H) / 2  # 2 blocks + embedding (or output) + norm, / tp
    shards = 2 * 2
    root = (512 * H + H) / 2
    # float32 shards (the master weights, their gradients), FSDP2's gathered units in bf16
    assert m.weights_gb == pytest.approx(
        (stage * 4 / shards + 2 * per_block / 2 * p + root * p) / GB
    )
    assert m.gradients_gb == pytest.approx((stage * 4 / shards + root * p) / GB)
    assert m.optimizer_gb == pytest.approx(stage * 2 * 4 / shards / GB)  # m, v
    tokens = 2 * 256 / 2
    block = block_activation_bytes(cfg, p, 2)
    first = 2 * tokens * (2 * block + H / 2 * p)  # 2 in flight: 2 blocks + embedding output
    last = tokens * (2 * block + H * p) + loss_buffer_bytes(cfg, int(tokens), 2)
    # CP (on CUDA): every layer keeps K and V of the whole rows, KV heads / tp, instead of its
    # local s/cp ones; no mask
    per_layer = 2 * 2 * (256 - 128) * KV / 2 * p
    first += 2 * 2 * per_layer  # 2 layers, 2 micro-batches in flight
    last += 2 * per_layer
    assert m.activations_gb == pytest.approx(max(first, last) / GB)
    # CPU: the document-segment kernel keeps the same (its copies are made again in the
    # backward pass); packed rows change nothing under CP, on either device
    for device in ("cpu", "cuda"):
        for packed in (False, True):
            other = memory_per_gpu(cfg, tp=2, cp=2, pp=2, dp_shard=2, micro_batches=4,
                                   device_type=device, packed=packed, **kwargs)  # fmt: skip
            assert other.activations_gb == m.activations_gb
    gpipe = memory_per_gpu(cfg, tp=2, cp=2, pp=2, dp_shard=2, micro_batches=4,
                           pp_schedule="gpipe", **kwargs)  # fmt: skip
    assert gpipe.activations_gb > m.activations_gb  # all 4 micro-batches in flight
    plain = memory_per_gpu(cfg, **kwargs)
    assert plain == memory_per_gpu(cfg, dp_shard=16, **kwargs)  # the default is FSDP over all


def _simulated_bubble(pp: int, m: int, schedule: str) -> float:
    """Idle share of a pipeline step, from a schedule simulated op by op (forward 1 unit,
    backward 2), against the ideal m x 3 units."""
    forward, backward = 1.0, 2.0
    f_end = [[0.0] * m for _ in range(pp)]
    b_end = [[0.0] * m for _ in range(pp)]
    if schedule == "gpipe":
        for s in range(pp):
            for i in range(m):
                ready = max(f_end[s - 1][i] if s else 0.0, f_end[s][i - 1] if i else 0.0)
                f_end[s][i] = ready + forward
        for s in reversed(range(pp)):
            for i in range(m):
                ready = max(b_end[s + 1][i] if s < pp - 1 else f_end[s][m - 1],
                            b_end[s][i - 1] if i else f_end[s][m - 1])  # fmt: skip
                b_end[s][i] = ready + backward
    else:  # 1F1B: stage s runs pp - s warm-up forwards, then alternates, then drains
        order = []
        for s in range(pp):
            warm = min(pp - s, m)
            ops = [("f", i) for i in range(warm)]
            for i in range(m - warm):
                ops += [("b", i), ("f", warm + i)]
            ops += [("b", i) for i in range(m - warm, m)]
            order.append(ops)
        clock, done = [0.0] * pp, [0] * pp
        while any(done[s] < len(order[s]) for s in range(pp)):
            for s in range(pp):
                while done[s] < len(order[s]):
                    kind, i = order[s][done[s]]
                    if kind == "f":
                        dep = f_end[s - 1][i] if s else 0.0
                        if s and dep == 0.0:
                            break
                        clock[s] = max(clock[s], dep) + forward
                        f_end[s][i] = clock[s]
                    else:
                        dep = b_end[s + 1][i] if s < pp - 1 else f_end[s][i]
                        if dep == 0.0:
                            break
                        clock[s] = max(clock[s], dep) + backward
                        b_end[s][i] = clock[s]
                    done[s] += 1
    makespan = max(b_end[0])
    ideal = m * (forward + backward)
    return (makespan - ideal) / ideal


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 32)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_matches_a_simulated_schedule(pp, m, schedule):
    assert bubble_fraction(pp, m) == pytest.approx(_simulated_bubble(pp, m, schedule))


def test_communication_by_hand():
    cfg, p = TINY, 2
    layout = Layout(dp_replicate=1, dp_shard=2, tp=2, cp=2, pp=1)
    c = communication(cfg, layout, seq_len=256, micro_batch_size=2, micro_batches=3,
                      activation_bytes=p)  # fmt: skip
    residual = 2 * 128 * H * p  # b x s/cp x h
    assert c.tp_gb * GB == pytest.approx(8 * residual * (1 / 2) * 4 * 3)  # 4 layers, 3 micro
    kv = 2 * 2 * 256 * KV / 2 * p  # K and V over the whole sequence, kv heads / tp
    assert c.cp_gb * GB == pytest.approx(2 * kv * (1 / 2) * 4 * 3)  # gather, reduce-scatter
    assert c.pp_gb == 0
    full = communication(cfg, layout, seq_len=256, micro_batch_size=2, micro_batches=3,
                         activation_bytes=p, activation_checkpointing="full")  # fmt: skip
    assert full.tp_gb == pytest.approx(c.tp_gb * 12 / 8)  # recomputation repeats the forward


def test_parse_parallel_and_bad_overrides_name_the_field():
    assert parse_parallel("tp=2,cp=4,pp=1") == {"tp": 2, "cp": 4, "pp": 1}
    assert parse_parallel("pp=2, pp_schedule=gpipe") == {"pp": 2, "pp_schedule": "gpipe"}
    with pytest.raises(ConfigError, match=r"pretrain.train.parallel.tq is not a field"):
        parse_parallel("tq=2")
    with pytest.raises(ConfigError, match=r"pretrain.train.parallel.tp='two' is not an integer"):
        parse_parallel("tp=two")
    with pytest.raises(ConfigError, match=r"pretrain.train.parallel.cp=0"):
        parse_parallel("cp=0")
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        parse_parallel("tp")


def _recipe():
    config = load_config("configs/smollm3-3b.yaml", [])
    return config


def test_smollm3_3b_every_stage_fits_80gb_with_the_chosen_layout():
    config = _recipe()
    model = config.pretrain.train.model_config_obj()
    plans = stage_layout_plans(config.pretrain, config.extend, config.hardware)
    assert [s for _, s, _ in plans] == [4096] * 3 + [32768, 65536]
    for name, seq_len, plan in plans:
        assert plan.fits, (name, plan.memory.total_gb)
        assert plan.memory.total_gb <= HEADROOM * 80
        assert model.num_heads % plan.layout.tp == 0 and model.num_kv_heads % plan.layout.tp == 0
        assert plan.layout.world_size == 288
        assert seq_len % (2 * plan.layout.cp) == 0 or plan.layout.cp == 1
    assert [p.global_batch for _, _, p in plans] == [576] * 3 + [288, 288]  # the recipe's kept
    # the recipe's extension layouts are the ones the planner chooses on its own
    free = load_config("configs/smollm3-3b.yaml", [])
    for stage in free.extend.stages:
        stage.parallel, stage.grad_accum_steps = None, None
    chosen = stage_layout_plans(free.pretrain, free.extend, free.hardware)
    for (_, _, set_plan), (_, _, free_plan) in zip(plans, chosen, strict=True):
        assert set_plan.layout == free_plan.layout and free_plan.fits


def test_plain_fsdp_does_not_fit_the_long_stages():
    """Without model parallelism the 32k and 64k stages are over 80 GB: the choice matters."""
    config = _recipe()
    model = config.pretrain.train.model_config_obj()
    for stage in config.extend.stages:
        plain = memory_per_gpu(model, seq_len=stage.seq_len, micro_batch_size=1, num_gpus=288,
                               param_dtype_bytes=2, optimizer="adamw", fsdp=True,
                               activation_checkpointing="none")  # fmt: skip
        assert plain.total_gb > 80


def test_tensor_parallelism_grows_until_the_layer_fits():
    """On one node of small GPUs with CP and PP fixed at 1, tp is the smallest that fits with
    the chosen checkpointing: half of it is over the GPU (and would cost less)."""
    config = _recipe()
    model = preset("3b")
    hw = config.hardware.model_copy(update={"nodes": 1})
    kwargs = dict(global_batch=8, fixed={"cp": 1, "pp": 1, "dp_replicate": 1})
    plan = choose_layout(model, 8192, 1, hw, gpu_mem_gb=24, **kwargs)
    assert plan.fits and plan.layout.tp > 1
    assert model.num_heads % plan.layout.tp == 0 and model.num_kv_heads % plan.layout.tp == 0
    smaller = memory_per_gpu(model, seq_len=8192, micro_batch_size=1, num_gpus=8,
                             param_dtype_bytes=2, optimizer="adamw", fsdp=True,
                             activation_checkpointing=plan.activation_checkpointing,
                             tp=plan.layout.tp // 2, packed=True)  # fmt: skip
    assert smaller.total_gb > HEADROOM * 24
    at_80 = choose_layout(model, 8192, 1, hw, gpu_mem_gb=80, **kwargs)
    assert at_80.layout.tp < plan.layout.tp or at_80.activation_checkpointing == "none"


def test_a_fixed_layout_is_respected_and_a_bad_one_names_the_field():
    config = _recipe()
    model = config.pretrain.train.model_config_obj()
    plan = choose_layout(model, 4096, 2, config.hardware, global_batch=576,
                         fixed={"tp": 2, "cp": 2, "pp": 1})  # fmt: skip
    assert (plan.layout.tp, plan.layout.cp, plan.layout.pp, plan.layout.dp) == (2, 2, 1, 72)
    assert plan.micro_batch_size * plan.grad_accum_steps == 8  # 576 sequences over 72 ranks
    with pytest.raises(ConfigError, match=r"pretrain.train.parallel.tp=3"):
        choose_layout(model, 4096, 2, config.hardware, global_batch=576, fixed={"tp": 3})
    with pytest.raises(ConfigError, match=r"pretrain.train.parallel.pp=48 exceeds"):
        choose_layout(model, 4096, 2, config.hardware, global_batch=576, fixed={"pp": 48})
    assert math.isclose(plan.bubble, 0.0)
