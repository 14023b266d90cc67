"""The parallel layout is resolved and checked before any compute, each failure naming its field."""

from __future__ import annotations

import time

import pytest

from llmflow.model.config import preset
from llmflow.tasks.framework.errors import ConfigError
from llmflow.tasks.framework.hashing import versioned_fields
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.curriculum import PretrainConfig
from llmflow.tasks.pretrain.parallel.config import ParallelConfig


def test_dp_shard_minus_one_takes_the_rest_and_dp_is_replicate_times_shard():
    layout = ParallelConfig(dp_replicate=2, tp=2, pp=2).resolve(16)
    assert (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp) == (
        2,
        2,
        2,
        1,
        2,
    )
    assert layout.dp == 4 and layout.world_size == 16
    assert layout.shape == (2, 2, 2, 1, 2)  # TP innermost, PP outermost


@pytest.mark.parametrize(
    ("parallel", "world", "needle"),
    [
        ({"tp": 3}, 4, "does not divide the world size 4"),
        ({"tp": 2, "dp_shard": 3}, 4, "differs from the world size 4"),
        ({"dp_shard": 0}, 4, "dp_shard=0"),
    ],
)
def test_a_product_that_is_not_the_world_size_names_the_degrees(parallel, world, needle):
    with pytest.raises(ConfigError, match="pretrain.train.parallel") as err:
        ParallelConfig(**parallel).resolve(world)
    assert needle in str(err.value)


def test_model_sequence_and_batch_checks_name_the_field_in_under_a_second():
    model = preset("debug", num_heads=4, num_kv_heads=2, num_layers=2)
    cases = [
        (dict(tp=4), dict(model=model), "tp=4 does not divide the model's num_kv_heads=2"),
        (dict(tp=8), dict(model=model), "tp=8 does not divide the model's num_heads=4"),
        (dict(pp=4), dict(model=model), "pp=4 exceeds the model's num_layers=2"),
        (
            dict(cp=2),
            dict(seq_len=66),
            "cp=2: seq_len=66 must be divisible by 2 x cp = 4",
        ),
        (dict(pp=2), dict(micro_batches=1), "batch.grad_accum_steps=1"),
    ]
    for parallel, checks, needle in cases:
        started = time.perf_counter()
        config = ParallelConfig(**parallel)
        with pytest.raises(ConfigError) as err:
            config.resolve(config.tp * config.cp * config.pp, **checks)
        assert needle in str(err.value), str(err.value)
        assert time.perf_counter() - started < 1.0
    ok = ParallelConfig(tp=2, cp=2, dp_replicate=2).resolve(8, model, 64, 2)
    assert ok.dp == 2
    untied = preset("debug", num_layers=2, tie_embeddings=False)
    ok = ParallelConfig(tp=2, pp=2).resolve(8, model=untied, seq_len=64, micro_batches=2)
    assert ok.dp == 2


def test_the_mesh_enters_the_hash_only_off_its_default():
    plain = TrainConfig(max_steps=1)
    assert "parallel" not in versioned_fields(plain)
    tp2 = plain.replaced(**{"parallel.tp": 2})
    assert versioned_fields(tp2)["parallel"]["tp"] == 2
    assert versioned_fields(plain.replaced(**{"parallel.cp": 2})) != versioned_fields(tp2)


def test_pretrain_parallel_is_shorthand_for_pretrain_train_parallel():
    cfg = PretrainConfig.model_validate(
        {"parallel": {"tp": 2, "cp": 2}, "train": {"max_steps": 1}, "stages": []}
    )
    assert (cfg.train.parallel.tp, cfg.train.parallel.cp) == (2, 2)
    with pytest.raises(ValueError, match="not both"):
        PretrainConfig.model_validate(
            {"parallel": {"tp": 2}, "train": {"max_steps": 1, "parallel": {"tp": 2}}, "stages": []}
        )
