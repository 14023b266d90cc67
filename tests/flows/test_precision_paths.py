"""``pretrain.train.precision`` reaches every training path built from the recipe: the pretrain
and context-extension stages, the sweeps' trials, preflight's rehearsal and its memory estimate,
and ``llmflow plan``."""

from __future__ import annotations

import pytest

from llmflow.flows.recipe import recipe
from llmflow.tasks.config import CONFIGS, load_config
from llmflow.tasks.framework.hashing import digest, versioned_fields
from llmflow.tasks.preflight.rehearsal import steps_train_config
from llmflow.tasks.preflight.shape import rehearsal_plan_gb
from llmflow.tasks.pretrain.planner import extension_memory, memory_per_gpu, recipe_plan
from llmflow.tasks.scaling.trial import segment_runs, trial_train_config


def _quickstart(precision: str | None):
    return load_config(None, [] if precision is None else [f"pretrain.train.precision={precision}"])


def _trainer_nodes(graph):
    return graph.find(step="pretrain", phase="pretrain") + graph.find(
        step="pretrain", phase="extend"
    )


def test_every_pretrain_and_extension_stage_trains_at_the_recipes_precision():
    nodes = {p: _trainer_nodes(recipe(_quickstart(p))) for p in (None, "auto", "fp32", "bf16")}
    assert [n.name for n in nodes["bf16"]] == [
        "quickstart-stage1", "quickstart-stage2", "quickstart-stage3",
        "quickstart-ctx512", "quickstart-ctx1024",
    ]  # fmt: skip
    for precision in ("auto", "fp32", "bf16"):
        assert [n.config.train.precision for n in nodes[precision]] == [precision] * 5
    hashes = {p: [digest(versioned_fields(n.config)) for n in ns] for p, ns in nodes.items()}
    # auto is left out of the hash at its default: the outputs made before the field keep
    # their addresses; fp32 and bf16 each give every stage a new one.
    assert hashes["auto"] == hashes[None]
    for a, b in (("fp32", "auto"), ("bf16", "auto"), ("bf16", "fp32")):
        assert all(x != y for x, y in zip(hashes[a], hashes[b], strict=True)), (a, b)


def test_a_sweeps_trial_segments_train_at_the_recipes_precision():
    config = _quickstart("bf16")
    train = trial_train_config(config, {"pretrain.train.optimizer.lr": 1e-3}, max_steps=40)
    runs = segment_runs(config, train, segments=2)
    assert [r.train.precision for r in runs] == ["bf16", "bf16"]
    assert [r.train.optimizer.lr for r in runs] == [1e-3, 1e-3]
    fp32 = segment_runs(config, train.replaced(precision="fp32"), segments=2)
    assert digest(versioned_fields(runs[0])) != digest(versioned_fields(fp32[0]))


def test_preflights_rehearsal_trains_at_the_recipes_precision():
    train = steps_train_config(_quickstart("bf16"), seq_len=64, micro=1, steps=4)
    assert train.precision == "bf16"


def _recipe_135m(precision: str):
    return load_config(
        str(CONFIGS / "smollm3-135m.yaml"), [f"pretrain.train.precision={precision}"]
    )


def _by_hand_gb(config, bytes_per_value: int, seq: int, micro: int, ranks: int) -> float:
    train = config.pretrain.train
    return memory_per_gpu(
        train.model_config_obj(), seq_len=seq, micro_batch_size=micro, num_gpus=ranks,
        param_dtype_bytes=bytes_per_value, optimizer=train.optimizer.name, fsdp=ranks > 1,
        activation_checkpointing=train.activation_checkpointing,
        every_k=train.activation_checkpointing_every_k, device_type="cpu",
    ).total_gb  # fmt: skip


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="auto is bf16 on a GPU (tests/gpu/)"
)
def test_preflights_memory_estimate_follows_the_precision_on_cpu():
    """On a CPU, auto and fp32 plan 4 bytes per value, bf16 plans 2 (and a float32 master)."""
    plans = {p: rehearsal_plan_gb(_recipe_135m(p), 256, 2, 2) for p in ("auto", "fp32", "bf16")}
    assert plans["auto"] == plans["fp32"] == _by_hand_gb(_recipe_135m("fp32"), 4, 256, 2, 2)
    assert plans["bf16"] == _by_hand_gb(_recipe_135m("bf16"), 2, 256, 2, 2)
    assert plans["bf16"] < plans["fp32"]


def test_plan_counts_bytes_by_precision_auto_is_bf16_on_the_recipes_gpus():
    plans = {p: recipe_plan(_recipe_135m(p).pretrain, _recipe_135m(p).hardware)
             for p in ("auto", "fp32", "bf16")}  # fmt: skip
    config = _recipe_135m("fp32")
    model = config.pretrain.train.model_config_obj()
    params = model.num_parameters()
    assert plans["auto"].memory == plans["bf16"].memory
    fp32, bf16 = plans["fp32"].memory, plans["bf16"].memory
    gpus = config.hardware.gpus
    shards = gpus if gpus > 1 else 1
    # float32 parameters (the master weights), gradients and m, v in any precision; bf16 only
    # in FSDP2's gathered units (or autocast's copies) and the activations
    assert fp32.optimizer_gb == bf16.optimizer_gb == pytest.approx(params * 2 * 4 / shards / 1e9)
    master = params * 4 / shards / 1e9
    assert bf16.weights_gb - master == pytest.approx((fp32.weights_gb - master) / 2)
    # the fused loss's buffers and the blocks' 1/rms and logsumexp are float32 in any precision
    loss = _loss_gb(model, config) + _float32_statistics_gb(model, config)
    assert fp32.activations_gb - loss == pytest.approx(2 * (bf16.activations_gb - loss))
    lines = {p: extension_memory(_recipe_135m(p).pretrain, _recipe_135m(p).extend,
                                 _recipe_135m(p).hardware) for p in ("auto", "fp32", "bf16")}  # fmt: skip
    assert lines["auto"] == lines["bf16"] != lines["fp32"]


def _loss_gb(model, config) -> float:
    from llmflow.tasks.pretrain.planner import loss_buffer_bytes

    seq = max(s.mixture.seq_len for s in config.pretrain.stages)
    return loss_buffer_bytes(model, config.pretrain.train.batch.micro_batch_size * seq) / 1e9


def _float32_statistics_gb(model, config) -> float:
    from llmflow.tasks.pretrain.planner import activation_bytes_per_token

    train = config.pretrain.train
    seq = max(s.mixture.seq_len for s in config.pretrain.stages)
    per_token = activation_bytes_per_token(  # 0 bytes per value: what stays float32
        model, 0, train.activation_checkpointing, train.activation_checkpointing_every_k
    )
    micro = train.batch.micro_batch_size
    return per_token * micro * seq / 1e9  # packed rows on CUDA: no mask, nothing more
