"""Bad input fails before training starts, naming the field and value."""

from __future__ import annotations

import pytest
from conftest import TINY_MODEL, make_packed, run_trainer, tiny_config
from pydantic import ValidationError

from llmflow.tasks.framework.errors import BadInputError, ConfigError
from llmflow.tasks.pretrain.config import TrainConfig, versioned_fields
from llmflow.tasks.pretrain.validate import validate_run


def _model(**changes):
    return {"preset": "debug", "overrides": {**TINY_MODEL, **changes}}


def test_heads_that_do_not_divide_name_the_fields():
    with pytest.raises(ValidationError, match="hidden_size=32 must be divisible by num_heads=3"):
        tiny_config(model=_model(num_heads=3))
    with pytest.raises(ValidationError, match="num_heads=4 must be divisible by num_kv_heads=3"):
        tiny_config(model=_model(num_kv_heads=3))


def test_unknown_fields_are_rejected():
    with pytest.raises(ValidationError, match="num_layer"):
        tiny_config(model=_model(num_layer=3))
    with pytest.raises(ValidationError, match="learning_rate"):
        tiny_config(optimizer={"learning_rate": 1e-3})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"max_steps": None}, "exactly one of max_steps and num_tokens"),
        ({"num_tokens": 1000}, "exactly one of max_steps and num_tokens"),
        ({"schedule": {"milestones": [0.9, 0.5]}}, r"schedule.milestones .* \[0.9, 0.5\]"),
        ({"batch": {"micro_batch_size": 4, "warmup_start_micro_batch": 8}},
         "warmup_start_micro_batch=8 exceeds batch.micro_batch_size=4"),
        ({"optimizer": {"betas": (0.9, 1.5)}}, r"optimizer.betas .* \(0.9, 1.5\)"),
        ({"schedule": {"warmup_steps": 50, "total_steps": 10}}, "warmup_steps=50 exceeds"),
        ({"optimizer": {"lr": -1.0}}, "lr"),
    ],
)  # fmt: skip
def test_bad_values_name_the_field(changes, match):
    with pytest.raises(ValidationError, match=match):
        tiny_config(**changes)


def test_vocab_mismatch_with_data(tmp_path, train_data):
    cfg = tiny_config(model=_model(vocab_size=256))
    with pytest.raises(
        BadInputError, match="vocab_size=256 differs from data_dir meta.json vocab_size=128"
    ):
        validate_run(cfg, train_data, None, None, world_size=1)


def test_sequence_longer_than_the_model(train_data):
    cfg = tiny_config(model=_model(max_seq_len=16))
    with pytest.raises(BadInputError, match="seq_len=32 exceeds model.max_seq_len=16"):
        validate_run(cfg, train_data, None, None, world_size=1)


def test_val_dir_checked_too(tmp_path, train_data):
    other = make_packed(tmp_path / "v", num_docs=20, vocab=64)
    with pytest.raises(BadInputError, match="val_dir meta.json vocab_size=64"):
        validate_run(tiny_config(), train_data, other, None, world_size=1)


def test_muon_is_accepted_under_fsdp(train_data):
    cfg = tiny_config(optimizer={"name": "muon"})
    validate_run(cfg, train_data, None, None, world_size=1)
    validate_run(cfg, train_data, None, None, world_size=2)


def test_trainer_process_refuses_mismatched_data(tmp_path, train_data):
    proc = run_trainer(tiny_config(model=_model(vocab_size=256)), train_data, tmp_path / "o",
                       check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "vocab_size=256 differs" in proc.stderr
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_execution_only_fields_are_not_versioned():
    a = versioned_fields(tiny_config(log_interval=1, eval_interval=5))
    b = versioned_fields(tiny_config(log_interval=7, eval_interval=9, progress_bar=True))
    assert a == b and "log_interval" not in a and "tracker" not in a
    assert versioned_fields(tiny_config(seed=1)) != a


def test_overrides_are_typed_and_dump_only_what_is_set():
    cfg = tiny_config(model=_model(num_layers=3))
    assert cfg.model.overrides.num_layers == 3 and cfg.model.overrides.qk_norm is None
    assert cfg.model_dump()["model"]["overrides"] == {**TINY_MODEL, "num_layers": 3}
    assert cfg.model_config_obj().num_layers == 3
    assert cfg.model_config_obj().rope_theta == 10000.0  # unset: the preset's value
    with pytest.raises(ValidationError, match="num_layers"):
        tiny_config(model=_model(num_layers="three"))


def test_replaced_merges_sections_and_dotted_paths_and_validates_once():
    cfg = tiny_config()
    new = cfg.replaced(
        max_steps=None,
        num_tokens=4096,
        schedule={"name": "wsd"},
        **{"optimizer.lr": 1e-4, "model.overrides.max_seq_len": 128},
    )
    assert (new.max_steps, new.num_tokens, new.optimizer.lr) == (None, 4096, 1e-4)
    assert new.schedule.name == "wsd" and new.schedule.warmup_steps == 2  # the rest is kept
    assert new.model_config_obj().max_seq_len == 128
    assert new.model.overrides.hidden_size == TINY_MODEL["hidden_size"]
    assert cfg.max_steps == 12 and cfg.optimizer.lr == 3e-3  # the original is untouched
    with pytest.raises(ConfigError, match="exactly one of max_steps and num_tokens"):
        cfg.replaced(num_tokens=4096)  # max_steps still set
    with pytest.raises(ConfigError, match="num_layer"):
        cfg.replaced(**{"model.overrides.num_layer": 3})


def test_config_round_trips_through_json(tmp_path):
    cfg = tiny_config(schedule={"name": "wsd", "decay_fraction": 0.3})
    cfg.save(tmp_path / "c.json")
    assert TrainConfig.load(tmp_path / "c.json") == cfg
