import math

import pytest
import torch
import torch.nn.functional as F

from llmflow.model.config import ModelConfig
from llmflow.model.loss import causal_lm_loss, linear_cross_entropy
from llmflow.model.transformer import Transformer


def test_cross_entropy_ignores_masked_labels():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :2] = -100
    loss, metrics = causal_lm_loss(logits, labels)
    expected = F.cross_entropy(logits[labels != -100], labels[labels != -100])
    torch.testing.assert_close(loss, expected)
    assert metrics["z_loss"] == 0 and torch.equal(metrics["ce"], loss.detach())


def test_z_loss_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [1.0, 1.0]]])  # logsumexp: ln 4, 1 + ln 2
    labels = torch.tensor([[1, -100]])
    loss, metrics = causal_lm_loss(logits, labels, z_loss_weight=0.5)
    ce = math.log(4.0) - math.log(3.0)  # only the first token counts
    assert metrics["ce"].item() == torch.tensor(ce).item() or abs(metrics["ce"].item() - ce) < 1e-6
    assert abs(metrics["z_loss"].item() - math.log(4.0) ** 2) < 1e-6
    assert abs(loss.item() - (ce + 0.5 * math.log(4.0) ** 2)) < 1e-6


def test_z_loss_path_matches_plain_path_and_backpropagates():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 7, requires_grad=True)
    labels = torch.randint(0, 7, (3, 4))
    plain, _ = causal_lm_loss(logits, labels)
    with_z, metrics = causal_lm_loss(logits, labels, z_loss_weight=1e-4)
    torch.testing.assert_close(metrics["ce"], plain.detach())
    with_z.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_all_labels_masked_gives_zero_not_nan():
    loss, _ = causal_lm_loss(torch.randn(1, 3, 5), torch.full((1, 3), -100), z_loss_weight=1e-4)
    assert loss.item() == 0.0


@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-2])
@pytest.mark.parametrize("grad_scale", [0.7, -1.3])
@pytest.mark.parametrize("chunk_rows", [None, 3, 1])
def test_fused_linear_cross_entropy_matches_autograd(z_loss_weight, grad_scale, chunk_rows):
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 7))
    labels[0, 3] = labels[1, -1] = -100
    loss, metrics = causal_lm_loss(F.linear(hidden, weight), labels, z_loss_weight)
    (loss * grad_scale).backward()
    expected = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    fused, fused_metrics = linear_cross_entropy(hidden, weight, labels, z_loss_weight, chunk_rows)
    (fused * grad_scale).backward()
    torch.testing.assert_close(fused, loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(fused_metrics["z_loss"], metrics["z_loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(hidden.grad, expected[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight.grad, expected[1], rtol=1e-5, atol=1e-7)


def test_chunked_loss_without_gradients_and_with_a_frozen_weight_matches_the_full_logits():
    torch.manual_seed(1)
    hidden = torch.randn(11, 8, requires_grad=True)
    weight = torch.randn(30, 8)  # frozen: no gradient is computed for it
    labels = torch.randint(0, 30, (11,))
    labels[4] = -100
    expected, _ = causal_lm_loss(F.linear(hidden, weight), labels, 1e-2)
    expected.backward()
    want = hidden.grad.clone()
    hidden.grad = None
    with torch.no_grad():
        no_grad, _ = linear_cross_entropy(hidden, weight, labels, 1e-2, chunk_rows=4)
    torch.testing.assert_close(no_grad, expected.detach(), rtol=1e-6, atol=0)
    loss, _ = linear_cross_entropy(hidden, weight, labels, 1e-2, chunk_rows=4)
    loss.backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, want, rtol=1e-5, atol=1e-7)


def test_chunked_loss_never_allocates_the_full_logits():
    from torch.profiler import ProfilerActivity, profile

    hidden = torch.randn(512, 16, requires_grad=True)
    weight = torch.randn(4096, 16, requires_grad=True)
    labels = torch.randint(0, 4096, (512,))
    full_logits = 512 * 4096 * 4
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss, _ = linear_cross_entropy(hidden, weight, labels, chunk_rows=64)
        loss.backward()
    per_call = max(
        e.cpu_memory_usage / max(e.count, 1) for e in prof.key_averages() if e.cpu_memory_usage > 0
    )
    assert per_call < full_logits / 4, (per_call, full_logits)


def test_fused_linear_cross_entropy_refuses_a_second_backward():
    hidden = torch.randn(3, 4, requires_grad=True)
    loss, _ = linear_cross_entropy(hidden, torch.randn(6, 4), torch.tensor([1, 2, -100]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass"):
        loss.backward()


def test_model_with_labels_returns_the_loss_of_its_logits():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=2)
    model = Transformer(cfg)
    ids = torch.randint(0, 64, (2, 9))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    expected, _ = causal_lm_loss(model(ids), labels, 1e-3)
    loss, metrics = model(ids, labels=labels, z_loss_weight=1e-3)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    assert set(metrics) == {"ce", "z_loss"}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_model_gradients_with_labels_equal_those_of_its_full_logits(tie):
    # the tied weight's gradient sums the loss's share (computed in the forward) and the
    # embedding's rows (TiedGradient); autograd on the full logits is the reference
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=2,
        tie_embeddings=tie,
    )  # fmt: skip
    model = Transformer(cfg)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    expected_loss, _ = causal_lm_loss(model(ids), labels, 1e-3)
    expected_loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    loss, _ = model(ids, labels=labels, z_loss_weight=1e-3)
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_tied_embedding_backward_makes_no_vocabulary_sized_tensor():
    # autograd summed the loss's and the embedding's (V, C) gradients out of place: the dense
    # embedding gradient and the sum were two more (V, C) tensors at the end of the backward
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = ModelConfig(vocab_size=4096, hidden_size=16, num_heads=2, num_kv_heads=1, num_layers=1)
    model = Transformer(cfg)
    ids = torch.randint(0, 4096, (1, 33))
    loss, _ = model(ids[:, :-1], labels=ids[:, 1:])
    made = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() == 4096 * 16:
                made.append(out.untyped_storage().data_ptr())
            return out

    with Record():
        loss.backward()
    assert len(set(made)) == 1  # the loss's buffer only (3 before: + dense embedding grad, sum)
    assert model.embed.weight.grad.untyped_storage().data_ptr() == made[0]
