"""Which config fields a step reads, against which fields its hash covers.

``recording(config)`` returns a copy of a pydantic config that notes every field read (attribute
access, ``model_dump``), nested models and lists included. ``unhashed_reads`` compares those reads
with the fields that enter the step's hash; a read outside the hash is a stale-cache bug unless the
step declares that field execution-only (``@step(..., execution=(...))``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from llmflow.tasks.framework.hashing import is_versioned

_RECORDING: dict[type, type] = {}


def _path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _recording_class(cls: type[BaseModel]) -> type[BaseModel]:
    if cls not in _RECORDING:
        _RECORDING[cls] = type(cls.__name__, (cls,), _recording_namespace(cls))
    return _RECORDING[cls]


def _recording_namespace(cls: type[BaseModel]) -> dict[str, Any]:
    """The methods of ``cls``'s recording subclass: field reads and dumps are noted."""

    def __getattribute__(self, name: str) -> Any:  # noqa: N807
        if name in type(self).model_fields:
            object.__getattribute__(self, "__pydantic_private__")["_reads"].add(
                _path(object.__getattribute__(self, "__pydantic_private__")["_prefix"], name)
            )
        return object.__getattribute__(self, name)

    def model_dump(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        _read_everything(self)
        return cls.model_dump(self, *args, **kwargs)

    def model_dump_json(self, *args: Any, **kwargs: Any) -> str:
        _read_everything(self)
        return cls.model_dump_json(self, *args, **kwargs)

    return {
        "__getattribute__": __getattribute__,
        "model_dump": model_dump,
        "model_dump_json": model_dump_json,
        "__module__": cls.__module__,
    }


def _read_everything(model: BaseModel) -> None:
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                _read_everything(item)


def _wrap(value: Any, prefix: str, reads: set[str]) -> Any:
    if isinstance(value, BaseModel):
        return recording(value, reads, prefix)
    if isinstance(value, list):
        return [_wrap(v, prefix, reads) for v in value]
    return value


def recording(config: BaseModel, reads: set[str] | None = None, prefix: str = "") -> BaseModel:
    """A copy of ``config`` that adds the dotted path of every field read to ``reads``."""
    reads = set() if reads is None else reads
    values = {
        name: _wrap(getattr(config, name), _path(prefix, name), reads)
        for name in type(config).model_fields
    }
    copy = _recording_class(type(config)).model_construct(**values)
    private = copy.__pydantic_private__ if copy.__pydantic_private__ is not None else {}
    private.update({"_reads": reads, "_prefix": prefix})
    object.__setattr__(copy, "__pydantic_private__", private)
    return copy


def unhashed_paths(config_type: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted paths of the fields the hash leaves out (``versioned: False``), and all below them."""
    found: set[str] = set()
    for name, info in config_type.model_fields.items():
        path = _path(prefix, name)
        if not is_versioned(info):
            found.add(path)
            found |= {f"{path}.{p}" for p in _all_paths(info.annotation)}
            continue
        for sub in _models_in(info.annotation):
            found |= unhashed_paths(sub, path)
    return found


def _all_paths(annotation: Any) -> set[str]:
    paths: set[str] = set()
    for sub in _models_in(annotation):
        for name, info in sub.model_fields.items():
            paths.add(name)
            paths |= {f"{name}.{p}" for p in _all_paths(info.annotation)}
    return paths


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """Pydantic models inside an annotation (``X``, ``list[X]``, ``X | None``)."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def unhashed_reads(
    config_type: type[BaseModel], reads: set[str], execution: tuple[str, ...]
) -> list[str]:
    """Reads the hash does not cover, less the step's declared execution-only fields."""
    unhashed = unhashed_paths(config_type)
    allowed = tuple(execution)
    return sorted(
        r
        for r in reads
        if r in unhashed and not any(r == a or r.startswith(f"{a}.") for a in allowed)
    )
