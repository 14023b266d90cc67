"""The planner's terms outside the train step's forward/backward, by hand: float32 gradients,
the optimizer step, validation and checkpoint saves. Each is what the trainer allocates
(tasks/pretrain/train.py, callbacks.py, checkpointer.py); leaving one out fails here.
The peak RSS of the whole step is checked in test_planner_parallel_memory.py (slow)."""

from __future__ import annotations

import pytest

from llmflow.model.config import preset
from llmflow.tasks.pretrain.planner import GB, memory_per_gpu

CFG = preset("debug", num_layers=4)
C, V, INTER = CFG.hidden_size, CFG.vocab_size, CFG.intermediate_size
PER_BLOCK = (CFG.num_parameters(non_embedding=True) - C) / CFG.num_layers


def _memory(**changes):
    kwargs = dict(seq_len=256, micro_batch_size=2, num_gpus=2, param_dtype_bytes=2,
                  optimizer="adamw", fsdp=True, activation_checkpointing="none", packed=True)  # fmt: skip
    return memory_per_gpu(CFG, **{**kwargs, **changes})


def test_pure_tp_keeps_float32_gradients_and_parameters_in_bf16():
    """No FSDP (tp=2 alone): the parameters and their gradients are float32 (autocast), 4 bytes
    each, not the 2 of the compute dtype; m and v are the only optimizer states."""
    m = _memory(tp=2)
    params = CFG.num_parameters() / 2  # norms counted as split, as the planner does
    assert m.weights_gb == pytest.approx(params * 4 / GB)
    assert m.gradients_gb == pytest.approx(params * 4 / GB)
    assert m.optimizer_gb == pytest.approx(params * 2 * 4 / GB)


def test_optimizer_step_holds_gradients_and_a_float32_temporary_per_parameter():
    params = CFG.num_parameters() / 2
    cuda, cpu = _memory(tp=2), _memory(tp=2, device_type="cpu")
    assert cuda.optimizer_step_gb == pytest.approx(params * 4 * 2 / GB)  # foreach: all at once
    largest = max(V * C, 2 * INTER * C) / 2
    assert cpu.optimizer_step_gb == pytest.approx((params + 2 * largest) * 4 / GB)
    assert _memory(tp=2, optimizer="sgd").optimizer_step_gb == pytest.approx(params * 4 / GB)


def test_validation_is_one_block_forward_and_counts_in_the_total():
    """Validation runs the step's loss path without gradients: one block's tensors at a time,
    below the step's activations; the total takes it when it is the largest term."""
    m = _memory(cp=2)
    assert 0 < m.validation_gb < m.activations_gb
    assert m.total_gb == pytest.approx(
        m.weights_gb + m.optimizer_gb
        + max(m.peak_live_gb, m.optimizer_step_gb, m.validation_gb, m.checkpoint_gb)
    )  # fmt: skip


def test_a_tp_checkpoint_gathers_nothing():
    """TP checkpoints write and read each rank's canonical row runs in place
    (tests/tasks/pretrain/test_checkpoint_format.py measures 0 bytes gathered)."""
    assert _memory(tp=2).checkpoint_gb == 0.0
    assert _memory().checkpoint_gb == 0.0  # no TP, no PP: nothing gathered on the GPU


def test_pp_final_save_gathers_the_whole_stage_on_the_gpu():
    """The final save under PP: the stage's full state on every rank's GPU (cpu_offload off),
    float32, whole over FSDP's shards; it counts in the total when it is the largest term."""
    m = _memory(pp=2, num_gpus=8, dp_shard=4, micro_batches=2, seq_len=16, micro_batch_size=1)
    stage = 2 * PER_BLOCK + V * C + C  # 2 of 4 blocks + embedding (or output) + norm
    assert m.checkpoint_gb == pytest.approx(stage * 4 / GB)
    assert m.peak_gb == m.checkpoint_gb
    assert m.total_gb == pytest.approx(m.weights_gb + m.optimizer_gb + m.checkpoint_gb)
