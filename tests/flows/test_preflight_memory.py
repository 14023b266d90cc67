"""The plan's memory per rank against the peak measured by preflight's own method (peak RSS of
2 gloo ranks less that of a tiny model's launch), at several rehearsal shapes (slow)."""

from __future__ import annotations

import pytest

from llmflow.tasks.config import CONFIGS, load_config
from llmflow.tasks.preflight.rehearsal import (
    MEMORY_TOLERANCE,
    RehearsalLauncher,
    peak_memory_gb,
    random_packed,
    runtime_baseline_gb,
    steps_train_config,
)
from llmflow.tasks.preflight.shape import rehearsal_plan_gb

# 135M's layout (GQA, SwiGLU, tied embeddings) at 4 layers of width 512 and an 8k vocabulary:
# long sequences make activations dominate, short ones weights, gradients and optimizer states.
MODEL = (
    "pretrain.train.model.overrides={vocab_size: 8192, hidden_size: 512, num_layers: 4, "
    "num_heads: 8, num_kv_heads: 4, intermediate_size: 1536}"
)
RANKS = 2


def recipe(checkpointing: str = "none"):
    return load_config(
        str(CONFIGS / "smollm3-135m.yaml"),
        [MODEL, f"pretrain.train.activation_checkpointing={checkpointing}"],
    )


@pytest.fixture(scope="module")
def runtime_gb(tmp_path_factory) -> float:
    """The runtime's share of a rank's peak RSS (Python, torch, gloo), measured once."""
    work = tmp_path_factory.mktemp("baseline")
    return runtime_baseline_gb(recipe(), work, RehearsalLauncher(RANKS, 600, lambda _: None), 64, 1)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("seq_len", "micro", "checkpointing"),
    [(64, 1, "none"), (256, 2, "none"), (512, 1, "full"), (512, 2, "none")],
)
def test_plan_is_within_tolerance_of_the_measured_peak(
    seq_len, micro, checkpointing, runtime_gb, tmp_path
):
    config = recipe(checkpointing)
    vocab = config.pretrain.train.model_config_obj().vocab_size
    data = random_packed(tmp_path / "data", vocab=vocab, seq_len=seq_len, rows=8 * micro * RANKS,
                         seed=0)  # fmt: skip
    train = steps_train_config(config, seq_len, micro, 2)  # step 2 has optimizer states
    RehearsalLauncher(RANKS, 600, lambda _: None)(train, data, tmp_path / "run")
    measured = peak_memory_gb(tmp_path / "run") - runtime_gb
    plan = rehearsal_plan_gb(config, seq_len, micro, RANKS)
    error = (plan - measured) / measured
    print(f"seq {seq_len} x micro {micro}, checkpointing {checkpointing}: plan {plan:.3f} GB, "
          f"measured {measured:.3f} GB per rank, error {error:+.1%}")  # fmt: skip
    assert abs(error) <= MEMORY_TOLERANCE
