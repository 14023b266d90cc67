import pytest
import torch

from llmflow.model.attention import document_ids, document_mask
from llmflow.model.config import ModelConfig
from llmflow.model.transformer import Transformer

CFG = ModelConfig(vocab_size=100, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def test_document_ids_from_cu_seqlens_and_position_ids_agree():
    # B=2, T=4 with docs [3, 1 | 4], the example in Transformer.forward's docstring.
    cu_seqlens = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    position_ids = torch.tensor([[0, 1, 2, 0], [0, 1, 2, 3]])
    from_cu = document_ids(2, 4, cu_seqlens=cu_seqlens)
    from_positions = document_ids(2, 4, position_ids=position_ids)
    assert from_cu.tolist() == [[1, 1, 1, 2], [3, 3, 3, 3]]
    assert document_mask(from_cu).equal(document_mask(from_positions))


def test_one_document_per_row_needs_no_mask():
    assert document_ids(2, 4, cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32)) is None
    assert document_ids(2, 4, position_ids=torch.arange(4).expand(2, 4)) is None
    assert document_ids(2, 4) is None


def test_document_mask_is_block_diagonal_causal():
    mask = document_mask(torch.tensor([[0, 0, 1, 1, 1]]))[0, 0].int()
    expected = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]
    assert mask.tolist() == expected


@pytest.mark.parametrize("nope_interval", [0, 2])
def test_packed_documents_give_the_same_logits_as_alone(nope_interval):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**CFG.to_dict(), "nope_interval": nope_interval})).eval()
    doc_a, doc_b, doc_c = (torch.randint(0, 100, (1, n)) for n in (5, 3, 8))
    packed = torch.cat([torch.cat([doc_a, doc_b], 1), doc_c])  # (2, 8): [5, 3 | 8]
    cu_seqlens = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    position_ids = torch.tensor([list(range(5)) + list(range(3)), list(range(8))])
    with torch.no_grad():
        logits = model(packed, position_ids=position_ids, cu_seqlens=cu_seqlens)
        for got, doc in ((logits[0, :5], doc_a), (logits[0, 5:], doc_b), (logits[1], doc_c)):
            torch.testing.assert_close(got, model(doc)[0], atol=1e-5, rtol=0)
        # Without the mask the second document would see the first one.
        leaky = model(packed, position_ids=position_ids, cu_seqlens=torch.tensor([0, 8, 16]))
        assert (leaky[0, 5:] - logits[0, 5:]).abs().max() > 1e-3


def test_masked_path_gradients_stay_inside_documents():
    torch.manual_seed(0)
    model = Transformer(CFG)
    embeddings = {}
    model.embed.register_forward_hook(lambda m, i, out: embeddings.setdefault("x", out))
    input_ids = torch.randint(0, 100, (1, 8))
    logits = model(input_ids, cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32))
    embeddings["x"].retain_grad()
    logits[0, 5].sum().backward()  # a token of the second document
    grad_per_token = embeddings["x"].grad[0].abs().sum(-1)
    assert (grad_per_token[:4] == 0).all() and (grad_per_token[4:6] > 0).all()


def test_positions_follow_cu_seqlens_when_not_given():
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    input_ids = torch.randint(0, 100, (2, 8))
    cu_seqlens = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2], list(range(8))])
    with torch.no_grad():
        implicit = model(input_ids, cu_seqlens=cu_seqlens)
        explicit = model(input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens)
    assert torch.equal(implicit, explicit)


@pytest.mark.parametrize("kernel", ["auto", "dense"])
@pytest.mark.parametrize("masked", [False, True])
def test_every_cpu_kernel_agrees_with_attention_written_out_by_hand(masked, kernel):
    """Shared k/v (one document per row, or per-document buckets) and the dense reference."""
    from llmflow.model.kernels import Documents, attend, use_attention_kernel

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1], [2, 2, 2, 2, 2, 2]])
    docs = Documents.of(2, 6, cu_seqlens=torch.tensor([0, 3, 6, 12])) if masked else None
    allowed = document_mask(doc_ids) if masked else torch.ones(6, 6, dtype=torch.bool).tril()
    k_full, v_full = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ k_full.transpose(-1, -2)) / 8**0.5
    expected = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v_full
    with use_attention_kernel(kernel):
        out = attend(*(t.transpose(1, 2) for t in (q, k, v)), docs).transpose(1, 2)
    torch.testing.assert_close(out, expected)
