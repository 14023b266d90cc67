import math

import torch
import torch.nn.functional as F

from llmflow.model.loss import causal_lm_loss


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
