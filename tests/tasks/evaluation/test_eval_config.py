import pytest
from pydantic import ValidationError

from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.framework.hashing import versioned_fields


@pytest.mark.parametrize(
    ("field", "value"),
    [("tasks", []), ("tasks", ["a b"]), ("tasks", ["x", "x"]), ("limit", 0), ("num_fewshot", -1),
     ("batch_size", 0), ("dtype", "float8"), ("num_items", 0)],
)  # fmt: skip
def test_bad_value_names_field_and_value(field, value):
    with pytest.raises(ValidationError, match=field):
        EvalConfig(**{field: value})


def test_unknown_field_rejected():
    with pytest.raises(ValidationError, match="taks"):
        EvalConfig(taks=["cf_arith"])


def test_execution_fields_not_versioned():
    a = EvalConfig(batch_size="auto", device=None, log_samples=False, max_batch_size=64)
    b = EvalConfig(batch_size=8, device="cpu", log_samples=True, max_batch_size=8)
    assert versioned_fields(a) == versioned_fields(b)
    assert versioned_fields(a) != versioned_fields(EvalConfig(limit=3))


def test_data_root_is_hashed():
    """Another folder of real eval sets may hold other data: its scores are another output."""
    assert versioned_fields(EvalConfig(data_root="/a")) != versioned_fields(
        EvalConfig(data_root="/b")
    )
