import math
import time

import torch

from llmflow.model.config import ModelConfig, preset
from llmflow.model.loss import causal_lm_loss
from llmflow.model.transformer import Transformer


def test_debug_preset_is_about_2m_and_trains_fast():
    torch.manual_seed(0)
    cfg = preset("debug")
    model = Transformer(cfg)
    assert 1.5e6 <= sum(p.numel() for p in model.parameters()) <= 2.5e6
    input_ids = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # NOTE: one thread and this thread's CPU time, so a busy machine does not fail the test.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = []
        for _ in range(3):
            start = time.thread_time()
            loss, _ = causal_lm_loss(model(input_ids[:, :-1]), input_ids[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seconds.append(time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    assert min(seconds) < 1.0, seconds  # about 0.35 s for 4 x 256 tokens on one core


def test_init_std_and_residual_scaling():
    cfg = ModelConfig(hidden_size=256, num_heads=4, intermediate_size=512, num_layers=8)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    residual_std = 0.02 / math.sqrt(2 * 8)
    layer = model.layers[0]
    assert abs(model.embed.weight.std().item() - 0.02) < 1e-3
    assert abs(layer.attn.qkv_proj.weight.std().item() - 0.02) < 1e-3
    assert abs(layer.attn.o_proj.weight.std().item() - residual_std) < 2e-4
    assert abs(layer.mlp.down_proj.weight.std().item() - residual_std) < 2e-4
    assert torch.equal(layer.attn_norm.weight, torch.ones(256))


def test_init_seed_is_deterministic_and_leaves_global_rng_alone():
    model_a, model_b = Transformer(ModelConfig()), Transformer(ModelConfig())
    torch.manual_seed(123)
    model_a.init_weights(seed=7)
    after = torch.rand(1)
    torch.manual_seed(123)
    model_b.init_weights(seed=7)
    assert torch.equal(torch.rand(1), after)
    for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_untied_head_and_tied_head_share_embedding_only_when_tied():
    tied, untied = Transformer(ModelConfig()), Transformer(ModelConfig(tie_embeddings=False))
    assert tied.lm_head is None and tied.output_weight() is tied.embed.weight
    assert untied.output_weight() is untied.lm_head.weight
    assert "lm_head.weight" not in tied.state_dict()


def test_qk_norm_changes_the_function_and_is_trainable():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(qk_norm=True, num_layers=1))
    input_ids = torch.randint(0, 8192, (1, 6))
    before = model(input_ids).detach()
    with torch.no_grad():
        model.layers[0].attn.q_norm.weight.mul_(3.0)
    assert (model(input_ids) - before).abs().max() > 1e-4
    model(input_ids).sum().backward()
    assert model.layers[0].attn.k_norm.weight.grad is not None


def test_meta_device_build_then_materialize():
    cfg = ModelConfig(num_layers=1)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    reference = Transformer(cfg)
    assert torch.equal(model.rope.inv_freq, reference.rope.inv_freq)
    assert torch.isfinite(model(torch.zeros(1, 4, dtype=torch.long))).all()


BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7: bf16 keeps 8 significant bits


def _position_sensitive_model(num_layers: int) -> Transformer:
    """A random model whose attention is sharp enough for its logits to depend on positions.

    At init attention is near uniform, so a RoPE or softmax precision bug would hide; the q/k/v
    projections x4 make attention peaked, as in a trained model.
    """
    torch.manual_seed(0)
    model = Transformer(ModelConfig(num_layers=num_layers))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "qkv_proj" in name:
                param.mul_(4)
    return model


def assert_within_bf16_rounding(low: torch.Tensor, reference: torch.Tensor) -> None:
    """bf16 logits stay within about one bf16 rounding of the fp32 ones, relative to their scale.

    Rounding the output alone moves a logit by up to eps/2 of its size; the bf16 matmuls and
    residual adds before it (norms and RoPE tables in fp32) add a few smaller ones. Measured on
    ``_position_sensitive_model(2)``: RMS error 0.88 eps x RMS logit, max error 0.81 eps x max
    |logit|. RoPE angles computed in bf16 give 1.43 and 1.96: the bounds (1.2 eps RMS, 1.5 eps
    max, i.e. about 1% of the logit scale) catch that.
    """
    error = low.float() - reference
    assert error.pow(2).mean().sqrt() < 1.2 * BF16_EPS * reference.pow(2).mean().sqrt()
    assert error.abs().max() < 1.5 * BF16_EPS * reference.abs().max()


def test_bf16_forward_runs_and_tracks_fp32():
    model = _position_sensitive_model(num_layers=2)
    input_ids = torch.randint(0, 8192, (2, 128))
    reference = model(input_ids)
    low = model.to(torch.bfloat16)(input_ids)
    assert low.dtype == torch.bfloat16
    assert_within_bf16_rounding(low, reference)


def test_autocast_keeps_rotated_heads_in_low_precision():
    from llmflow.model.rope import apply_rotary

    model = _position_sensitive_model(num_layers=1)
    cos, sin = model.rope(torch.arange(16)[None], torch.float32)  # float32 tables, as in forward
    heads = torch.randn(2, 16, 4, 32, dtype=torch.bfloat16)
    assert apply_rotary(heads, cos, sin).dtype == torch.bfloat16
    input_ids = torch.randint(0, 8192, (2, 128))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids)
    assert_within_bf16_rounding(logits, model(input_ids))


def test_compiled_blocks_match_eager_loss_and_gradients():
    """``compile: true`` compiles each block as the trainer does; the fused custom kernels
    (rotary with a hand-written backward, SwiGLU) must lower through inductor and give the
    eager loss and gradients."""
    torch.manual_seed(0)
    eager = Transformer(ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2))
    compiled = Transformer(eager.cfg)
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.layers:
        block.compile()
    ids = torch.randint(0, eager.cfg.vocab_size, (2, 32))
    losses = [m(ids[:, :-1], labels=ids[:, 1:])[0] for m in (eager, compiled)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
