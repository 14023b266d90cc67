"""Long-context evaluation and the extension stage config, against hand computations."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from llmflow.model.config import preset
from llmflow.model.transformer import Transformer
from llmflow.tasks.extend.config import ExtendConfig, ExtensionStage
from llmflow.tasks.extend.longctx import (
    NEEDLE,
    passkey_grid,
    passkey_prompt,
    position_loss,
    with_rope,
)
from llmflow.tasks.extend.steps import extension_train_config
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.schedule import lr_multiplier


class CharTokenizer:
    """One id per byte: enough to check where the needle lands."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i % 256 for i in ids).decode(errors="replace")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return Transformer(
        preset("debug", vocab_size=256, hidden_size=32, num_layers=2, intermediate_size=64)
    ).eval()


def test_position_loss_matches_cross_entropy_by_hand(tiny):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, 40) for _ in range(3)] + [
        rng.integers(0, 256, 10)
    ]  # last too short
    curve = position_loss(tiny, docs, seq_len=32, num_buckets=4)
    assert curve["num_docs"] == 3 and curve["bucket_start"] == [0, 8, 16, 24]
    losses = []
    with torch.no_grad():
        for d in docs[:3]:
            ids = torch.tensor(d[:33], dtype=torch.long)[None]
            logits = tiny(ids[:, :-1])[0]
            losses.append(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none"))
    expected = torch.stack(losses).mean(0)
    for i, start in enumerate(curve["bucket_start"]):
        assert curve["loss"][i] == pytest.approx(
            float(expected[start : start + 8].mean()), rel=1e-5
        )


def test_passkey_prompt_places_needle_at_depth_and_grid_scores(tiny):
    tok = CharTokenizer()
    for depth in (0.1, 0.5, 0.9):
        ids, number = passkey_prompt(tok, 600, depth, random.Random(1))
        text = tok.decode(ids)
        needle_at = text.index("One of the special magic numbers")
        needle_len = len(NEEDLE.format(key="x", number=number)) - 1
        haystack_len = text.index("What is the special magic number") - needle_len
        # RULER's depth is the needle's position within the haystack (the question excluded).
        assert number in text and abs(needle_at / haystack_len - depth) < 0.1
        assert abs(len(ids) - 600) < 120
    grid = passkey_grid(tiny, tok, [200, 300], [0.2, 0.8], trials=1, max_new_tokens=2)
    assert np.array(grid["accuracy"]).shape == (2, 2)
    assert set(np.ravel(grid["accuracy"])) <= {0.0, 1.0}
    assert "{number}" in NEEDLE


def test_yarn_view_keeps_weights_and_changes_rope(tiny):
    scaling = {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    other = with_rope(tiny, rope_scaling=scaling)
    assert all(
        torch.equal(a, b)
        for a, b in zip(tiny.state_dict().values(), other.state_dict().values(), strict=False)
    )
    ids = torch.randint(0, 256, (1, 64))
    assert not torch.allclose(tiny(ids), other(ids))


def test_extension_stage_config_restarts_schedule_and_raises_rope_base():
    base = TrainConfig(max_steps=10)
    stage = ExtensionStage(
        seq_len=512, rope_theta=40000, num_tokens=8192, lr=1e-3, warmup_steps=2, micro_batch_size=4
    )
    cfg = extension_train_config(base, stage)
    model = cfg.model_config_obj()
    assert (model.max_seq_len, model.rope_theta) == (512, 40000)
    assert cfg.schedule.per_stage and cfg.schedule.name == "cosine" and cfg.optimizer.lr == 1e-3
    assert cfg.num_tokens == 8192 and cfg.max_steps is None
    # The stage's own schedule: warmup from its first step, whatever the global step count.
    assert lr_multiplier(0, cfg.schedule, 4) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="strictly increasing"):
        ExtendConfig(stages=[stage, stage], weights={"prose": 1.0})
