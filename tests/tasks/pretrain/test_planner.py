import math

import pytest
import torch

from llmflow.model import loss as loss_module
from llmflow.model.config import PRESETS, ModelConfig, preset
from llmflow.model.transformer import Transformer
from llmflow.tasks.pretrain.planner import (
    GB,
    activation_bytes_per_token,
    flops_per_token,
    format_plan,
    memory_per_gpu,
    plan,
)

DEBUG_PARAMS = 1_836_160  # counted by hand in test_debug_counts_by_hand


def test_debug_counts_by_hand():
    # vocab 8192, hidden 128, 4 layers, 4 heads / 2 KV heads of 32, intermediate 384, tied.
    per_layer = 128 * (4 + 2 * 2) * 32 + 128 * 128 + 3 * 128 * 384 + 2 * 128
    non_embedding = 4 * per_layer + 128
    assert non_embedding == 787_584
    assert non_embedding + 8192 * 128 == DEBUG_PARAMS
    result = plan(preset("debug"), seq_len=256, global_batch_tokens=8192, num_tokens=10**7)
    assert result.num_parameters == DEBUG_PARAMS
    assert result.num_non_embedding_parameters == non_embedding
    assert result.chinchilla_tokens == 20 * DEBUG_PARAMS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameters_equal_the_real_model(name):
    cfg = preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    p = plan(cfg, seq_len=cfg.max_seq_len, global_batch_tokens=10**6, num_tokens=10**9)
    assert p.num_parameters == sum(t.numel() for t in model.parameters())


def test_flops_per_token_by_hand():
    # 6 x (non-embedding + output projection) + 12 x layers x hidden x seq_len
    assert flops_per_token(preset("debug"), 256) == 6 * (787_584 + 8192 * 128) + 12 * 4 * 128 * 256
    untied = ModelConfig(tie_embeddings=False)
    assert flops_per_token(untied, 100) == 6 * (787_584 + 8192 * 128) + 12 * 4 * 128 * 100


def test_steps_accumulation_and_hours_by_hand():
    cfg = preset("135m")
    kwargs = dict(seq_len=2048, global_batch_tokens=2**20, num_tokens=10**10, num_gpus=8,
                  micro_batch_size=8, mfu=0.5, peak_tflops=1000)  # fmt: skip
    p = plan(cfg, **kwargs)
    assert p.num_steps == math.ceil(10**10 / 2**20)
    assert p.grad_accum_steps == 2**20 // (8 * 2048 * 8)
    expected_seconds = flops_per_token(cfg, 2048) * 10**10 / (8 * 1000e12 * 0.5)
    assert p.estimated_hours == pytest.approx(expected_seconds / 3600)
    slower = plan(cfg, activation_checkpointing=True, **kwargs)
    assert slower.estimated_hours == pytest.approx(p.estimated_hours * 4 / 3)


def test_memory_breakdown_by_hand():
    cfg = preset("debug")
    p = plan(cfg, seq_len=256, global_batch_tokens=8192, num_tokens=10**7, fsdp=False,
             micro_batch_size=2, param_dtype_bytes=2)  # fmt: skip
    m = p.memory
    # float32 parameters (the master weights) and gradients at any precision; m and v
    assert m.weights_gb == pytest.approx(DEBUG_PARAMS * 4 / GB)
    assert m.gradients_gb == pytest.approx(DEBUG_PARAMS * 4 / GB)
    assert m.optimizer_gb == pytest.approx(DEBUG_PARAMS * 4 * 2 / GB)
    per_block = (8 * 128 + 2 * 64 + 4 * 384) * 2 + (4 + 2) * 4  # + 1/rms, logsumexp floats
    per_token = 4 * per_block + 2 * 128 * 2  # blocks, embedding output, hidden-state gradient
    chunk_elements = getattr(loss_module, "CHUNK_ELEMENTS", None)  # None: not chunked
    chunk = 2 * 256 if chunk_elements is None else min(chunk_elements // 8192, 2 * 256)
    loss = 8 * chunk * 8192 + 4 * 8192 * 128  # chunk's logits + log-probs, weight gradient
    assert m.activations_gb == pytest.approx((2 * 256 * per_token + loss) / GB)
    # gradients (all of them, no FSDP) and the first block's activations at the backward's end;
    # without FSDP autocast's bf16 copies of the weights live with the activations
    backward_end = DEBUG_PARAMS * 4 + 2 * 256 * per_block
    casts = DEBUG_PARAMS * 2
    assert m.peak_live_gb == pytest.approx(max(m.activations_gb + casts / GB, backward_end / GB))
    # the optimizer step: the gradients and foreach's float32 temporary of every parameter
    assert m.optimizer_step_gb == pytest.approx(DEBUG_PARAMS * 4 * 2 / GB)
    assert m.total_gb == pytest.approx(
        m.weights_gb + m.optimizer_gb + max(m.peak_live_gb, m.optimizer_step_gb, m.validation_gb)
    )


def test_activations_and_gradients_peak_apart():
    """Short sequences peak at the backward's end (all gradients), long ones in the loss's
    forward (all activations); never both at once: the total is below their sum."""
    cfg = preset("135m")
    kwargs = dict(micro_batch_size=1, num_gpus=2, param_dtype_bytes=4, optimizer="adamw",
                  fsdp=True, activation_checkpointing="none")  # fmt: skip
    short, long = (
        memory_per_gpu(cfg, seq_len=64, **kwargs),
        memory_per_gpu(cfg, seq_len=512, **kwargs),
    )
    assert short.peak_live_gb > short.gradients_gb > short.activations_gb
    assert long.peak_live_gb == long.activations_gb > long.gradients_gb
    for m in (short, long):
        assert m.total_gb < m.weights_gb + m.optimizer_gb + m.gradients_gb + m.activations_gb


def test_fsdp_shards_states_and_adds_gathered_blocks():
    cfg = preset("1.7b")
    kwargs = dict(seq_len=2048, global_batch_tokens=2**21, num_tokens=10**11, num_gpus=8)
    sharded, replicated = plan(cfg, **kwargs), plan(cfg, fsdp=False, **kwargs)
    per_layer = (cfg.num_parameters(non_embedding=True) - cfg.hidden_size) / cfg.num_layers
    assert sharded.memory.optimizer_gb == pytest.approx(replicated.memory.optimizer_gb / 8)
    root = cfg.num_parameters() - cfg.num_layers * per_layer  # embedding + final norm, whole
    assert sharded.memory.weights_gb == pytest.approx(
        replicated.memory.weights_gb / 8 + (2 * per_layer + root) * 2 / GB
    )
    assert sharded.memory.gradients_gb == pytest.approx(
        replicated.memory.gradients_gb / 8 + root * 2 / GB
    )
    assert sharded.memory.activations_gb == replicated.memory.activations_gb


def test_activation_estimate_matches_saved_tensors():
    """The per-block formula against what autograd really keeps (float32, eager)."""
    cfg = ModelConfig(vocab_size=512, hidden_size=96, num_heads=4, num_kv_heads=2,
                      intermediate_size=320, num_layers=1)  # fmt: skip
    model = Transformer(cfg)
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):  # parameters are not activations
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    batch, seq_len = 2, 50
    x = model.embed(torch.randint(0, 512, (batch, seq_len)))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model.layers[0](x, model.rope(torch.arange(seq_len)[None], x.dtype), None)
    measured = sum(storages.values()) / (batch * seq_len)
    block_estimate = activation_bytes_per_token(cfg, 4, False) - 2 * 96 * 4
    assert block_estimate == pytest.approx(measured, rel=0.1)


def test_not_fitting_plan_proposes_fixes_that_fit():
    cfg = preset("1.7b")
    kwargs = dict(seq_len=2048, global_batch_tokens=2**20, num_tokens=10**11, gpu_mem_gb=80)
    p = plan(cfg, micro_batch_size=16, **kwargs)
    assert not p.fits
    text = " ".join(p.warnings)
    assert "micro_batch_size=1" in text and "activation_checkpointing=full" in text
    assert plan(cfg, micro_batch_size=1, **kwargs).fits
    assert plan(cfg, micro_batch_size=16, activation_checkpointing=True, **kwargs).fits


def test_large_model_on_small_gpus_proposes_more_sharding():
    p = plan(preset("3b"), seq_len=4096, global_batch_tokens=2**21, num_tokens=10**11,
             num_gpus=2, gpu_mem_gb=24, activation_checkpointing=True)  # fmt: skip
    assert not p.fits
    fix = next(w for w in p.warnings if "more sharding" in w)
    num_gpus = int(fix.split("num_gpus=")[1].split(":")[0])
    assert plan(preset("3b"), seq_len=4096, global_batch_tokens=2**21, num_tokens=10**11,
                num_gpus=num_gpus, gpu_mem_gb=24, activation_checkpointing=True).fits  # fmt: skip


def test_sanity_warnings():
    p = plan(preset("debug"), seq_len=512, global_batch_tokens=1000, num_tokens=10**5)
    text = " ".join(p.warnings)
    assert "max_seq_len" in text and "not a multiple" in text and "undertrained" in text
    assert p.fits


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="seq_len=0"):
        plan(preset("debug"), seq_len=0, global_batch_tokens=1, num_tokens=1)
    with pytest.raises(ValueError, match="optimizer='adam'"):
        plan(preset("debug"), seq_len=8, global_batch_tokens=8, num_tokens=8, optimizer="adam")


def test_format_plan_mentions_every_part():
    p = plan(preset("135m"), seq_len=2048, global_batch_tokens=2**20, num_tokens=10**10)
    text = format_plan(p)
    for word in ("parameters", "FLOPs", "Chinchilla", "steps", "weights", "gradients",
                 "optimizer", "activations", "fits"):  # fmt: skip
        assert word in text


def test_format_plan_states_active_parameters_of_a_mixture_only():
    """30b-a3b: 30.5B parameters, 3.35B a token goes through (Qwen3-30B-A3B's own figures);
    a dense plan's line is as it was."""
    moe = format_plan(plan(preset("30b-a3b"), seq_len=4096, global_batch_tokens=2**22,
                           num_tokens=10**12, num_gpus=64))  # fmt: skip
    assert "parameters           30,532.1M (29,909.8M non-embedding; 3,353.0M active per " in moe
    dense = format_plan(plan(preset("debug"), seq_len=256, global_batch_tokens=2**12,
                             num_tokens=10**6))  # fmt: skip
    assert f"parameters           {DEBUG_PARAMS / 1e6:,.1f}M (0.8M non-embedding)\n" in dense


def test_muon_states_by_hand_and_against_the_real_optimizer_split():
    from llmflow.tasks.pretrain.optim import split_parameters
    from llmflow.tasks.pretrain.planner import hidden_matrix_parameters

    cfg = preset("debug")
    hidden = 4 * (128 * (4 + 2 * 2) * 32 + 128 * 128 + 3 * 128 * 384)
    assert hidden_matrix_parameters(cfg) == hidden
    with torch.device("meta"):
        model = Transformer(cfg)
    assert sum(p.numel() for _, p in split_parameters(model)["hidden_matrix"]) == hidden
    kwargs = dict(seq_len=256, global_batch_tokens=8192, num_tokens=10**7, fsdp=False,
                  param_dtype_bytes=2)  # fmt: skip
    adamw = plan(cfg, optimizer="adamw", **kwargs).memory
    muon = plan(cfg, optimizer="muon", **kwargs).memory
    # momentum for the hidden matrices; m + v for the rest
    assert muon.optimizer_gb == pytest.approx((hidden + (DEBUG_PARAMS - hidden) * 2) * 4 / GB)
    assert adamw.optimizer_gb - muon.optimizer_gb == pytest.approx(hidden * 4 / GB)


def test_selective_checkpointing_lies_between_none_and_full():
    cfg = preset("debug")  # 4 layers: selective every 2nd recomputes blocks 2 and 4
    per_block = (8 * 128 + 2 * 64 + 4 * 384) * 2 + (4 + 2) * 4  # + 1/rms, logsumexp floats
    rest = 2 * 128 * 2  # the embedding's output and the loss's hidden-state gradient
    sel = activation_bytes_per_token(cfg, 2, "selective", every_k=2)
    assert sel == 2 * per_block + 2 * 128 * 2 + per_block + rest
    assert activation_bytes_per_token(cfg, 2, "full") == 4 * 128 * 2 + per_block + rest
    assert activation_bytes_per_token(cfg, 2, "none") == 4 * per_block + rest


def test_recipe_plan_reads_the_optimizer_and_activation_checkpointing():
    from llmflow.tasks.config import load_config
    from llmflow.tasks.pretrain.planner import recipe_plan

    def total(*overrides):
        config = load_config("configs/smollm3-3b.yaml", list(overrides))
        return recipe_plan(config.pretrain, config.hardware).memory

    base = total("pretrain.train.activation_checkpointing=none",
                 "pretrain.train.optimizer.name=adamw")  # fmt: skip
    ac = total(
        "pretrain.train.activation_checkpointing=full", "pretrain.train.optimizer.name=adamw"
    )
    muon = total(
        "pretrain.train.activation_checkpointing=none", "pretrain.train.optimizer.name=muon"
    )
    assert ac.activations_gb < base.activations_gb / 3
    assert muon.optimizer_gb < base.optimizer_gb
    assert ac.total_gb != base.total_gb and muon.total_gb != base.total_gb
