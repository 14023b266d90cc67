"""bench_quality_per_compute: WikiText articles split at titles, GPT-2 masked within documents."""

from __future__ import annotations

import torch

from benchmarks.bench_quality_per_compute import document_mask, wiki_articles

WIKI = " \n = Alpha = \n \n Alpha text . \n \n = = History = = \n \n More alpha . \n = Beta = \n \n Beta .\n"


def test_articles_start_at_title_lines_not_section_titles():
    articles = wiki_articles(WIKI)
    assert len(articles) == 2
    assert articles[0].startswith(" = Alpha = ") and "= = History = =" in articles[0]
    assert articles[1] == " = Beta = \n \n Beta .\n"


def test_document_mask_makes_packed_gpt2_equal_to_separate_documents():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    a, b = torch.randint(0, 50, (1, 5)), torch.randint(0, 50, (1, 3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    with torch.no_grad():
        packed = model(
            input_ids=torch.cat([a, b], 1),
            position_ids=positions,
            attention_mask=document_mask(positions),
        ).logits
        separate = torch.cat([model(input_ids=a).logits, model(input_ids=b).logits], 1)
        unmasked = model(input_ids=torch.cat([a, b], 1)).logits
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-5)
    assert (unmasked[:, 5:] - separate[:, 5:]).abs().max() > 1e-3
