"""Long-context evaluation, the extension stage config and the longctx step."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import BaseModel

from llmflow.model.config import preset
from llmflow.model.hf import save_model
from llmflow.model.transformer import Transformer
from llmflow.tasks.extend.config import (
    ExtendConfig,
    ExtensionStage,
    LongContextEvalConfig,
    extension_train_config,
)
from llmflow.tasks.extend.longctx import (
    NEEDLE,
    LongContextEval,
    longctx,
    passkey_grid,
    passkey_prompt,
    position_loss,
    with_rope,
)
from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.step import Metrics, step
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
    assert "{number}" in NEEDLE


class ShallowReader(torch.nn.Module):
    """A stub model over ``CharTokenizer`` ids: greedily spells the passkey when the needle sits
    in the first half of the haystack and the prompt is under 500 characters, else ``00000``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        text = CharTokenizer().decode(ids[0].tolist())
        prompt, _, generated = text.rpartition("mentioned in the provided text is")
        number = re.search(r"is: (\d+)\.", prompt).group(1)
        needle_at = prompt.index("One of the special")
        needle_len = prompt.index(".", needle_at) + 1 - needle_at
        depth = needle_at / (prompt.index("What is the special") - needle_len)
        answer = " " + (number if depth < 0.5 and len(prompt) < 500 else "00000") + "."
        logits = torch.zeros(1, ids.shape[1], 256)
        logits[0, -1, ord(answer[min(len(generated), len(answer) - 1)])] = 1.0
        return logits


def test_passkey_grid_scores_each_length_and_depth():
    grid = passkey_grid(
        ShallowReader(), CharTokenizer(), [300, 400, 600], [0.2, 0.8], trials=2, max_new_tokens=7
    )
    assert grid["lengths"] == [300, 400, 600] and grid["depths"] == [0.2, 0.8]
    assert grid["accuracy"] == [[1.0, 0.0], [1.0, 0.0], [0.0, 0.0]]


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


def test_yarn_scaling_extends_past_the_last_trained_length():
    stages = [
        ExtensionStage(seq_len=512, rope_theta=4e4, num_tokens=1, lr=1e-3),
        ExtensionStage(seq_len=1024, rope_theta=1.6e5, num_tokens=1, lr=1e-3),
    ]
    cfg = ExtendConfig(stages=stages, weights={"prose": 1.0}, yarn_factor=4.0)
    scaling = cfg.yarn_scaling()
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 4.0
    assert scaling["original_max_position_embeddings"] == 1024  # the last trained length
    model = preset("debug", max_seq_len=4096, rope_scaling=scaling)  # a valid ModelConfig
    assert model.rope_scaling["beta_fast"] == 32.0 and model.rope_scaling["beta_slow"] == 1.0


# ------------------------------------------------------------------------------ the step


class FixtureSpec(BaseModel):
    kind: str


@step("test-longctx-input")
def fixture_output(cfg: FixtureSpec, out: Path) -> Metrics:
    """Two tiny models (before/after extension), a byte-level tokenizer, tokenized documents."""
    if cfg.kind in ("before", "after"):
        seq_len = 32 if cfg.kind == "before" else 64
        mc = preset("debug", vocab_size=300, hidden_size=32, num_layers=2, max_seq_len=seq_len)
        model = Transformer(mc)
        model.init_weights(seed=0)
        save_model(model, mc, out / "final")
    elif cfg.kind == "tokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_tokens([chr(c) for c in range(32, 127)])
        tok.save(str(out / "tokenizer.json"))
    else:
        rng = np.random.default_rng(0)
        folder = out / "validation" / "prose"
        folder.mkdir(parents=True)
        docs = [rng.integers(0, 300, n).astype(np.uint16) for n in (80, 90, 20)]
        np.concatenate(docs).tofile(folder / "tokens.bin")
        np.save(folder / "offsets.npy", np.cumsum([0, *map(len, docs)]))
        meta = {
            "dtype": "uint16",
            "train": {},
            "validation": {"prose": {"dir": "validation/prose"}},
        }
        (out / "meta.json").write_text(json.dumps(meta))
    return {}


def test_longctx_step_compares_before_after_and_yarn(tmp_path):
    graph = Graph()
    inputs = {k: graph.add(fixture_output, FixtureSpec(kind=k), k) for k in
              ("before", "after", "tokenizer", "tokenized")}  # fmt: skip
    stage = ExtensionStage(seq_len=64, rope_theta=4e4, num_tokens=1, lr=1e-3)
    ev = LongContextEvalConfig(
        lengths=[40], depths=[0.5], trials=1, position_loss_len=64, num_buckets=4
    )
    cfg = LongContextEval(extend=ExtendConfig(stages=[stage], weights={"prose": 1.0}, eval=ev))
    node = graph.add(longctx, cfg, "test", **inputs)
    executor = Executor(str(tmp_path), audit=True)
    result = executor.run(graph)[node]

    assert executor.unhashed_reads(graph) == {}
    report = json.loads((Path(result.uri) / "longctx.json").read_text())
    assert report["original_len"] == 32 and report["documents_split"] == "validation"
    assert set(report["position_loss"]) == {"before", "after", "after+yarn"}
    assert result.metrics["num_long_docs"] == 2  # the 20-token document is too short
    curve = report["position_loss"]["after"]
    pairs = zip(curve["bucket_start"], curve["loss"], strict=True)
    beyond = [loss for start, loss in pairs if start >= 32]
    assert result.metrics["loss_beyond_original_after"] == pytest.approx(np.mean(beyond))
    # The untrained "after" model and its YaRN view share weights but not RoPE: curves differ.
    assert report["position_loss"]["after+yarn"]["loss"] != curve["loss"]
    assert (Path(result.uri) / "position_loss.png").exists()
    assert [row["model"] for row in result.artifacts[0]["rows"]] == list(report["passkey"])
