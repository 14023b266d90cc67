import pytest
import torch
from transformers import SmolLM3Config
from transformers.modeling_rope_utils import _compute_yarn_parameters
from transformers.models.smollm3.modeling_smollm3 import SmolLM3RotaryEmbedding
from transformers.models.smollm3.modeling_smollm3 import apply_rotary_pos_emb as hf_apply

from llmflow.model.config import ModelConfig
from llmflow.model.hf import hf_config
from llmflow.model.rope import RotaryEmbedding, apply_rotary, rope_parameters, yarn_inv_freq

YARN_SETTINGS = [
    dict(factor=4.0, original_max_position_embeddings=256),
    dict(factor=8.0, original_max_position_embeddings=512, beta_fast=16, beta_slow=2),
    dict(factor=2.0, original_max_position_embeddings=1024, attention_factor=0.8),
    dict(factor=16.0, original_max_position_embeddings=128, mscale=0.707, mscale_all_dim=1.0),
    dict(factor=3.0, original_max_position_embeddings=300, beta_fast=40, truncate=False),
    dict(factor=1.0, original_max_position_embeddings=256),
]


def _cfgs(scaling: dict | None, theta: float = 10000.0):
    max_len = (
        int(scaling["factor"] * scaling["original_max_position_embeddings"]) if scaling else 256
    )
    ours = ModelConfig(
        hidden_size=256, num_heads=4, rope_theta=theta, max_seq_len=max_len, rope_scaling=scaling
    )
    theirs = SmolLM3Config(**{k: v for k, v in hf_config(ours).items() if k != "dtype"})
    return ours, theirs


@pytest.mark.parametrize("setting", YARN_SETTINGS)
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_yarn_parameters_match_transformers(setting, theta):
    ours, theirs = _cfgs({"rope_type": "yarn", **setting}, theta)
    inv_freq, attention_factor = rope_parameters(ours)
    ref_inv_freq, ref_attention_factor = _compute_yarn_parameters(theirs)
    torch.testing.assert_close(inv_freq, ref_inv_freq, atol=1e-6, rtol=0)
    assert attention_factor == ref_attention_factor


def test_yarn_interpolates_low_frequencies_and_keeps_high_ones():
    base, _ = rope_parameters(ModelConfig(hidden_size=256, num_heads=4))
    # With a 4096 original context, dims 0..9 turn more than beta_fast=32 times and dims from
    # 23 on fewer than beta_slow=1 time (hand-computed from the correction-dimension formula).
    inv_freq, factor = yarn_inv_freq(64, 10000.0, 4.0, 4096)
    assert torch.equal(inv_freq[:10], base[:10])  # fast dims: extrapolated (unchanged)
    torch.testing.assert_close(inv_freq[23:], base[23:] / 4)  # slow dims: interpolated
    assert (inv_freq[11:23] < base[11:23]).all() and (inv_freq[11:23] > base[11:23] / 4).all()
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


@pytest.mark.parametrize(
    "scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}]
)
def test_cos_sin_and_rotation_match_transformers(scaling):
    ours, theirs = _cfgs(scaling, theta=50000.0)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1], [5, 100, 200, 255, 17, 3]])
    x = torch.randn(2, 6, 3, ours.head_dim)  # (B, T, H, D)
    cos, sin = RotaryEmbedding(ours)(positions, torch.float32)
    ref_cos, ref_sin = SmolLM3RotaryEmbedding(theirs)(x, positions)
    torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0)
    ref, _ = hf_apply(x.transpose(1, 2), x.transpose(1, 2), ref_cos, ref_sin)  # HF: (B, H, T, D)
    torch.testing.assert_close(apply_rotary(x, cos, sin), ref.transpose(1, 2))


def test_rotation_preserves_relative_position():
    """q·k after RoPE depends only on the distance between positions."""
    rope = RotaryEmbedding(ModelConfig())
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)

    def score(i: int, j: int) -> torch.Tensor:
        cos, sin = rope(torch.tensor([[i, j]]), torch.float32)
        rq = apply_rotary(q, cos[:, :1], sin[:, :1])
        rk = apply_rotary(k, cos[:, 1:], sin[:, 1:])
        return (rq * rk).sum()

    torch.testing.assert_close(score(3, 1), score(10, 8), atol=1e-5, rtol=0)


def test_frequencies_stay_float32_when_model_is_cast():
    rope = RotaryEmbedding(ModelConfig(rope_theta=1e6))
    expected = rope.inv_freq.clone()
    rope.to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope.inv_freq, expected)
