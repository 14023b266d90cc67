"""model/moe.py: the router against hand computations, the block against a naive per-token loop
(outputs and gradients), grouped_mm against its per-expert fallback, the sparse-layer pattern and
parameter counts, the expert-load counts (once per training forward, also under activation
checkpointing), the auxiliary losses' gradients, and bf16."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from llmflow.model.config import ModelConfig
from llmflow.model.moe import (
    HAS_GROUPED_MM,
    MoE,
    Router,
    _grouped_mm_loop,
    grouped_mm,
    load_balancing_loss,
    moe_layers,
    router_z_loss,
)
from llmflow.model.transformer import MLP, Transformer

HIDDEN, EXPERTS, WIDTH = 16, 4, 12


def moe_config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=64, hidden_size=HIDDEN, num_layers=2, num_heads=2, num_kv_heads=1,
                  intermediate_size=24, max_seq_len=32, num_experts=EXPERTS,
                  num_experts_per_tok=2, moe_intermediate_size=WIDTH, hf_model_type="mixtral")  # fmt: skip
    return ModelConfig(**{**fields, **overrides})


def filled_moe(cfg: ModelConfig, seed: int = 0) -> MoE:
    """A block with every weight drawn (the block alone leaves them to `init_weights`)."""
    moe = MoE(cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return moe


# ------------------------------------------------------------------------------ the router
def hand_route(x, weight, bias, scoring, top_k, norm):
    """Per token (lists of floats): the chosen experts and their weights, by hand."""
    chosen = []
    for row in x:
        logits = [sum(a * b for a, b in zip(row, w, strict=True)) for w in weight]
        if scoring == "softmax":
            total = sum(math.exp(v) for v in logits)
            scores = [math.exp(v) / total for v in logits]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        ranked = sorted(range(len(scores)), key=lambda e: -(scores[e] + bias[e]))[:top_k]
        picked = [scores[e] for e in ranked]
        if norm:
            picked = [p / sum(picked) for p in picked]
        chosen.append((ranked, picked))
    return chosen


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm", [True, False])
def test_router_picks_and_weights_the_top_k_as_by_hand(scoring, norm):
    cfg = moe_config(hidden_size=4, num_heads=1, scoring_func=scoring, norm_topk_prob=norm)
    router = Router(cfg)
    weight = [[1.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, -1.0, 0.5],
              [0.3, 0.3, 0.3, 0.3]]  # fmt: skip
    x = [[0.5, 0.2, -1.0, 0.1], [-0.3, 0.9, 0.4, 2.0], [1.5, -0.5, 0.0, 0.0]]
    with torch.no_grad():
        router.weight.copy_(torch.tensor(weight))
    for bias in ([0.0] * 4, [0.0, 0.0, 0.0, 5.0]):  # a large bias forces expert 3 in
        with torch.no_grad():
            router.expert_bias.copy_(torch.tensor(bias))
        _, _, ids, weights = router(torch.tensor(x))
        for t, (experts, picked) in enumerate(hand_route(x, weight, bias, scoring, 2, norm)):
            assert ids[t].tolist() == experts
            assert weights[t].tolist() == pytest.approx(picked, abs=1e-6)
        if bias[3]:
            assert (ids == 3).any(dim=1).all()  # selection moved, the weights did not get it


def test_bias_changes_selection_but_not_the_weights():
    cfg = moe_config(hidden_size=4, num_heads=1, norm_topk_prob=False)
    router = Router(cfg)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        router.weight.copy_(torch.randn(EXPERTS, 4, generator=torch.Generator().manual_seed(2)))
    _, scores, ids, weights = router(x)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    _, scores_b, ids_b, weights_b = router(x)
    assert torch.equal(scores, scores_b) and not torch.equal(ids, ids_b)
    assert torch.equal(weights_b, scores.gather(1, ids_b))  # unbiased scores of the chosen


def test_load_balancing_and_z_loss_are_their_docstring_formulas():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, EXPERTS, generator=generator)
    scores = logits.softmax(-1) * 0.7  # not normalised: the loss normalises per token
    ids = scores.topk(2, dim=-1).indices
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    n, rows = 6, scores.tolist()
    probs = [[v / sum(row) for v in row] for row in rows]
    mean_p = [sum(probs[t][e] for t in range(n)) / n for e in range(EXPERTS)]
    by_hand = (EXPERTS / 2) * sum(counts[e].item() / n * mean_p[e] for e in range(EXPERTS))
    assert load_balancing_loss(scores, counts, 2).item() == pytest.approx(by_hand, rel=1e-6)
    lse = [math.log(sum(math.exp(v) for v in row)) for row in logits.tolist()]
    assert router_z_loss(logits).item() == pytest.approx(sum(v * v for v in lse) / n, rel=1e-6)
    # balanced: every expert gets N*k/E tokens and mean probability 1/E -> exactly 1
    uniform = torch.full((8, EXPERTS), 1.0 / EXPERTS)
    balanced = torch.full((EXPERTS,), 8 * 2 // EXPERTS)
    assert load_balancing_loss(uniform, balanced, 2).item() == pytest.approx(1.0)


# ------------------------------------------------------------------------------ the block
def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through its k experts one by one, weighted, plus the shared experts."""
    tokens = x.reshape(-1, x.shape[-1])
    _, _, ids, weights = moe.router(tokens)
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    rows = []
    for t in range(tokens.shape[0]):
        y = tokens.new_zeros(tokens.shape[1])
        for j in range(ids.shape[1]):
            e = ids[t, j].item()
            gate, up = (gate_up[e] @ tokens[t]).chunk(2)
            y = y + weights[t, j] * (down[e] @ (F.silu(gate) * up))
        if moe.shared_experts is not None:
            gate, up = (moe.shared_experts.gate_up_proj.weight @ tokens[t]).chunk(2)
            y = y + moe.shared_experts.down_proj.weight @ (F.silu(gate) * up)
        rows.append(y)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("loop", [True, False])
def test_block_equals_a_naive_per_token_loop_outputs_and_gradients(shared, loop):
    if not loop and not HAS_GROUPED_MM:
        pytest.skip("torch has no _grouped_mm")
    moe = filled_moe(moe_config(n_shared_experts=shared)).train()
    moe.experts.use_loop = loop
    x = torch.randn(3, 7, HIDDEN, generator=torch.Generator().manual_seed(4))
    grad = torch.randn(3, 7, HIDDEN, generator=torch.Generator().manual_seed(5))
    results = []
    for fn in (moe, lambda v: naive_moe(moe, v)):
        moe.zero_grad()
        xx = x.clone().requires_grad_()
        y = fn(xx)
        y.backward(grad)
        results.append(
            (y.detach(), xx.grad, {n: p.grad.clone() for n, p in moe.named_parameters()})
        )
    (y, gx, gp), (y_ref, gx_ref, gp_ref) = results
    assert (y - y_ref).abs().max() < 1e-5
    assert (gx - gx_ref).abs().max() < 1e-5
    assert set(gp) == set(gp_ref) and "router.weight" in gp
    for name in gp:  # the router learns through the routing weights
        assert (gp[name] - gp_ref[name]).abs().max() < 1e-5, name
    assert gp["router.weight"].abs().max() > 0


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="torch has no _grouped_mm")
def test_grouped_mm_equals_the_per_expert_loop_with_experts_without_rows():
    generator = torch.Generator().manual_seed(6)
    counts = torch.tensor([3, 0, 5, 0, 2])  # two experts get no rows
    x = torch.randn(int(counts.sum()), 8, generator=generator)
    weight = torch.randn(5, 6, 8, generator=generator)
    offsets = counts.cumsum(0).to(torch.int32)
    assert (
        grouped_mm(x, weight, offsets) - _grouped_mm_loop(x, weight, offsets)
    ).abs().max() < 1e-5
    # the experts' forward and backward both ways, the same rows (the zero-row experts' weight
    # gradients are zero both ways)
    moe = filled_moe(moe_config(num_experts=5))
    rows = x.new_empty(10, HIDDEN).normal_(generator=generator)
    grad = torch.randn(10, HIDDEN, generator=generator)
    results = []
    for loop in (True, False):
        moe.zero_grad()
        moe.experts.use_loop = loop
        xx = rows.clone().requires_grad_()
        out = moe.experts(xx, counts)
        out.backward(grad)
        results.append((out.detach(), xx.grad, moe.experts.gate_up_proj.grad.clone(),
                        moe.experts.down_proj.grad.clone()))  # fmt: skip
    for a, b in zip(*results, strict=True):
        assert (a - b).abs().max() < 1e-5
    for grad_weight in results[0][2:]:
        assert not grad_weight[1].any() and not grad_weight[3].any()


# ------------------------------------------------------------------------------ the model
@pytest.mark.parametrize(
    ("overrides", "sparse"),
    [
        (dict(decoder_sparse_step=2), [1, 3, 5]),
        (dict(decoder_sparse_step=2, mlp_only_layers=[3]), [1, 5]),
        (dict(first_k_dense_replace=2), [2, 3, 4, 5]),
        (dict(decoder_sparse_step=1, n_shared_experts=1, first_k_dense_replace=1), [1, 2, 3, 4, 5]),
    ],
)
def test_sparse_layers_and_parameter_counts(overrides, sparse):
    cfg = moe_config(num_layers=6, **overrides)
    model = Transformer(cfg)
    kinds = [type(block.mlp) for block in model.layers]
    assert [i for i, k in enumerate(kinds) if k is MoE] == sparse
    assert all(k is MLP for i, k in enumerate(kinds) if i not in sparse)
    assert [i for i, _ in moe_layers(model)] == sparse
    total = sum(p.numel() for p in model.parameters())
    assert cfg.num_parameters() == total
    # active: each sparse layer's routed experts counted k of E times
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - routed + routed * cfg.num_experts_per_tok // cfg.num_experts
    assert cfg.active_parameters() == active


def routed_counts(model: Transformer, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each sparse layer's tokens per expert, by routing its captured input again."""
    inputs, hooks = {}, []
    for index, moe in moe_layers(model):
        hooks.append(moe.register_forward_pre_hook(
            lambda m, args, i=index: inputs.setdefault(i, args[0].detach())))  # fmt: skip
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    counts = {}
    for index, moe in moe_layers(model):
        chosen = moe.router(inputs[index].reshape(-1, HIDDEN))[2]
        counts[index] = torch.bincount(chosen.reshape(-1), minlength=EXPERTS).float()
    return counts


@pytest.mark.parametrize("checkpointed", [False, True])
def test_tokens_per_expert_counts_one_training_forward_once(checkpointed):
    torch.manual_seed(0)
    model = Transformer(moe_config())
    ids = torch.randint(0, 64, (2, 16))
    expected = routed_counts(model, ids)
    for _, moe in moe_layers(model):
        assert not moe.tokens_per_expert.any()  # a no-grad forward counts nothing
    model.eval()
    model(ids).sum().backward()
    for _, moe in moe_layers(model):
        assert not moe.tokens_per_expert.any()  # nor does an eval forward
    model.train()
    if checkpointed:  # non-reentrant recompute in the backward must not count again
        x = model.embed(ids)
        rope = model.rope(torch.arange(16)[None], x.dtype)
        for block in model.layers:
            x = checkpoint(block, x, rope, None, use_reentrant=False)
        model.norm(x).sum().backward()
    else:
        model(ids).sum().backward()
    for index, moe in moe_layers(model):
        assert torch.equal(moe.tokens_per_expert, expected[index])
        assert moe.tokens_per_expert.sum().item() == 2 * 16 * 2
        assert set(moe.last_metrics) == {"router_entropy", "aux_loss", "z_loss"}


@pytest.mark.parametrize("coefs", [(1.0, 0.0), (0.0, 0.1), (1.0, 0.1)])
def test_auxiliary_losses_reach_the_router_as_autograd_of_the_formulas(coefs):
    aux, z = coefs
    plain = filled_moe(moe_config()).train()
    with_aux = filled_moe(moe_config(router_aux_loss_coef=aux, router_z_loss_coef=z)).train()
    with_aux.aux_scale = 0.5  # one of two micro-batches
    x = torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(7))
    grads = []
    for moe in (plain, with_aux):
        moe(x).sum().backward()
        grads.append(moe.router.weight.grad.clone())
    # by hand: the same router's losses on the same tokens, through autograd
    router = filled_moe(moe_config()).router
    logits, scores, ids, _ = router(x.reshape(-1, HIDDEN))
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    loss = aux * load_balancing_loss(scores, counts, 2) + z * router_z_loss(logits)
    (0.5 * loss).backward()
    # the difference of two float32 gradients of size ~4: within a few ulps of 4 (1e-5), while
    # the auxiliary losses' own gradient is of size 1e-2
    assert (grads[1] - grads[0] - router.weight.grad).abs().max() < 1e-5
    assert router.weight.grad.abs().max() > 1e-3
    # the block's output itself is unchanged by the auxiliary losses
    with torch.no_grad():
        assert torch.equal(plain(x), with_aux(x))


def test_bf16_forward_is_close_to_float32():
    moe = filled_moe(moe_config(n_shared_experts=1)).train()
    x = torch.randn(4, 32, HIDDEN, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        y32, ids32 = moe(x), moe.router(x.reshape(-1, HIDDEN))[2]
        moe16 = filled_moe(moe_config(n_shared_experts=1)).to(torch.bfloat16)
        y16 = moe16(x.bfloat16()).float()
        ids16 = moe16.router(x.reshape(-1, HIDDEN).bfloat16())[2]
    assert y16.dtype == torch.float32 and torch.isfinite(y16).all()
    # a token whose two best scores nearly tie may pick another expert in bf16: compare the
    # tokens routed alike (nearly all of them)
    same = (ids32.sort(-1).values == ids16.sort(-1).values).all(-1)
    assert same.float().mean() > 0.9
    # bf16 keeps 8 significant bits: each of the ~6 roundings on the way (input, weights, the
    # gate/up outputs, silu * up, the down output, the weighted sum) is within 2^-9 of its
    # value, so the output is within a few percent of its scale; 5% leaves room for sums
    scale = y32.abs().max()
    err = (y16 - y32).reshape(-1, HIDDEN)[same].abs().max()
    assert err < 0.05 * scale
