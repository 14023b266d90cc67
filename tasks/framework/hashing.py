"""Content hashes for configs and files: what makes an output's address."""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from typing import Any

from pydantic import BaseModel

HASH_CHARS = 16
PROTOCOL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


UNVERSIONED = {"versioned": False}
"""``Field(..., json_schema_extra=UNVERSIONED)``: an execution-only field (worker counts, log
intervals) that no hash covers; a step that reads one declares it in ``@step(execution=...)``,
which the read audit checks (``audit.unhashed_reads``)."""


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal values hash equally."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def is_versioned(field_info: Any) -> bool:
    extra = field_info.json_schema_extra
    return not (isinstance(extra, dict) and extra.get("versioned") is False)


OMIT_DEFAULT = {"omit_default": True}
"""``json_schema_extra`` of a field added after outputs were made: at its default it is left out
of the hash, so those outputs keep their addresses; any other value enters it."""


ADDED_EXECUTION = {"versioned": False, "omit_default": True}
"""An execution-only field added after recipes were dumped into outputs (a model card embeds its
recipe's YAML): no hash covers it, and `recipe_dump` leaves it out at its default, so those
outputs keep their addresses."""


ADDED = {"omit_default": True, "added": True}
"""A field that defines outputs (it is hashed), added after recipes were dumped into outputs: at
its default it is left out of the hash and of `recipe_dump`, so those outputs keep their
addresses; any other value enters both."""


def recipe_dump(model: BaseModel) -> dict[str, Any]:
    """``model.model_dump(mode="json")`` without the ``ADDED_EXECUTION`` and ``ADDED`` fields at
    their default, at any depth."""
    return model.model_dump(mode="json", exclude=_added_at_default(model) or None)


def _added_at_default(model: BaseModel) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        extra = info.json_schema_extra
        added = extra == ADDED_EXECUTION or isinstance(extra, dict) and extra.get("added")
        if added and value == info.get_default(call_default_factory=True):
            out[name] = True
        elif isinstance(value, BaseModel) and (inner := _added_at_default(value)):
            out[name] = inner
    return out


def _omitted_default(field_info: Any, value: Any) -> bool:
    extra = field_info.json_schema_extra
    return (
        isinstance(extra, dict)
        and extra.get("omit_default") is True
        and (value == field_info.default)
    )


def versioned_fields(value: Any) -> Any:
    """The parts of a config that define an output's content.

    Fields declared with ``json_schema_extra={"versioned": False}`` (worker counts, log
    intervals) are dropped, recursively, so changing them never changes a hash. A model may add
    values derived from such fields that do change the content (``versioned_extras()``: the world
    size that execution-only launch fields add up to, say).
    """
    if isinstance(value, BaseModel):
        out = {}
        for name, info in type(value).model_fields.items():
            if is_versioned(info) and not _omitted_default(info, getattr(value, name)):
                out[name] = versioned_fields(getattr(value, name))
        extras = getattr(value, "versioned_extras", None)
        if callable(extras):
            out.update(versioned_fields(extras()))
        return out
    if isinstance(value, dict):
        return {str(k): versioned_fields(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [versioned_fields(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {k: versioned_fields(getattr(value, k)) for k in value.__dataclass_fields__}
    return value


def digest(obj: Any) -> str:
    """Short sha256 of the canonical JSON of ``obj``."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:HASH_CHARS]


def step_hash(step: str, version: str, config: Any, input_hashes: dict[str, Any]) -> str:
    """The address of a step's output: its versioned config, its inputs' hashes, its code version."""
    return digest(
        {
            "step": step,
            "version": version,
            "config": versioned_fields(config),
            "inputs": input_hashes,
        }
    )


def relative_names(uris: list[str] | tuple[str, ...]) -> list[str]:
    """Each raw file's path relative to the files' common folder (one file: its name).

    What a raw input's hash holds beside each file's bytes: a step may read meaning from a name
    (ToxiGen's label and target group are in its file names), so a renamed file must make
    another address; the folder the files lie in is where, not what, and stays out.
    """
    parts = [posixpath.normpath(PROTOCOL.sub("", str(uri))).lstrip("/").split("/") for uri in uris]
    common = min((len(p) - 1 for p in parts), default=0)
    for depth in range(common):
        if len({p[depth] for p in parts}) > 1:
            common = depth
            break
    return ["/".join(p[common:]) for p in parts]
