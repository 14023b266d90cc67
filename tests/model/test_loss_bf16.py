"""The fused loss and the model in bf16: bf16 operands, a float32 accumulator, no dtype mix.

Tolerance: bf16 keeps 8 significant bits, a unit roundoff u = 2**-8 ~ 3.9e-3. Each logit and
each chunk's gradient product is rounded to bf16 once (relative error <= u per element, about
u / sqrt(3) on average for independent roundings), and the chunks are summed in float32. So the
gradients' relative Frobenius error against a float64 computation on the same bf16 inputs is
about u / 2; we allow 2u (7.8e-3), a bound a float32 accumulator with bf16 operands meets and a
gradient summed in bf16 across many chunks would not. The loss is a float32 mean of float32
log-softmaxes over bf16 logits: its error is far below u.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmflow.model.config import preset
from llmflow.model.loss import linear_cross_entropy
from llmflow.model.transformer import Transformer

U = 2.0**-8  # bf16's unit roundoff


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-2])
def test_fused_loss_in_bf16_matches_cross_entropy_on_the_upcast_full_logits(z_loss_weight):
    torch.manual_seed(0)
    hidden = torch.randn(4, 32, 64).bfloat16().requires_grad_()
    weight = (torch.randn(500, 64) / 8).bfloat16().requires_grad_()
    labels = torch.randint(0, 500, (4, 32))
    labels[0, :5] = -100
    # reference in float64 on the same bf16 values
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logits = F.linear(h64, w64).reshape(-1, 500)
    valid = labels.reshape(-1) != -100
    lse = torch.logsumexp(logits, -1)
    ref = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100)
    ref = ref + z_loss_weight * (lse.square() * valid).sum() / valid.sum()
    ref.backward()
    loss, _ = linear_cross_entropy(hidden, weight, labels, z_loss_weight, chunk_rows=16)
    loss.backward()
    assert loss.dtype == torch.float32
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    # the logits were rounded to bf16 before the softmax: a relative error of order u/sqrt(V)
    assert abs(loss.item() - ref.item()) / ref.item() < U / 4
    assert rel_err(hidden.grad, h64.grad) < 2 * U
    assert rel_err(weight.grad, w64.grad) < 2 * U


@pytest.mark.parametrize("tie", [True, False])
def test_a_bf16_model_trains_a_step_with_the_fused_loss(tie):
    torch.manual_seed(0)
    cfg = preset("debug", tie_embeddings=tie)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    loss32 = model(ids, labels=ids)[0]
    model = model.to(torch.bfloat16)
    loss, _ = model(ids, labels=ids)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.bfloat16 for g in grads)
    assert all(torch.isfinite(g.float()).all() for g in grads)
    # same weights rounded to bf16: the loss moves by far less than its own size
    assert abs(loss.item() - loss32.item()) < 0.02 * loss32.item()


@pytest.mark.parametrize("tie", [True, False])
def test_cpu_autocast_bf16_gives_float32_gradients_close_to_float32(tie):
    torch.manual_seed(0)
    cfg = preset("debug", tie_embeddings=tie)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    model(ids, labels=ids)[0].backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = model(ids, labels=ids)
    loss.backward()
    total = sum(ref[n].double().square().sum() for n in ref).sqrt()
    err = sum((p.grad.double() - ref[n]).square().sum() for n, p in model.named_parameters())
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    # bf16 activations through a few layers: each op adds ~u of relative error
    assert (err.sqrt() / total).item() < 8 * U
