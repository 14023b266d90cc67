"""The pipeline config: one typed config per step, YAML presets, dotted overrides.

``load_config("configs/quickstart.yaml", ["pretrain.train.optimizer.lr=3e-4"])`` reads the YAML,
applies each override, and validates everything before any compute. A bad value raises
``ConfigError`` naming the field path, the value given and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmflow.tasks.curation.config import CurateConfig
from llmflow.tasks.dataprep.config import TokenizeConfig, ValidationConfig
from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.extend.config import ExtendConfig
from llmflow.tasks.framework.errors import ConfigError
from llmflow.tasks.framework.resources import data_dir
from llmflow.tasks.ingest.ingest import IngestConfig
from llmflow.tasks.ingest.sample import SampleConfig
from llmflow.tasks.posttrain.config import DPOStepConfig, SFTStepConfig
from llmflow.tasks.pretrain.curriculum import PretrainConfig
from llmflow.tasks.tokenizer.config import TokenizerConfig

CONFIGS = data_dir("configs")
DEFAULT_CONFIG = CONFIGS / "quickstart.yaml"
PHASES = (
    "sample",
    "ingest",
    "curate",
    "tokenizer",
    "tokenize",
    "mixture",
    "pretrain",
    "extend",
    "evaluate",
    "sft",
    "dpo",
    "leaderboard",
)
"""The recipe's phases in run order: ``--until`` stops after one."""


class RunnerConfig(BaseModel):
    """How fanned-out tasks (curation shards) run: execution-only, never in a hash."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["threads", "processes", "dask", "ray"] = Field(
        "threads", description="Prefect task runner for fan-out; dask/ray need the extras."
    )
    max_workers: int | None = Field(None, ge=1, description="Workers (None: Prefect's default).")


class PipelineConfig(BaseModel):
    """Everything one end-to-end run needs; each field below is one step's config."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        "quickstart", pattern=r"^[A-Za-z0-9_.-]+$", description="Label in output names."
    )
    root: str = Field(
        "./runs",
        description="Artifact root: a folder or s3://bucket/prefix.",
        json_schema_extra={"versioned": False},
    )
    data: list[str] = Field(
        default_factory=list,
        description="Raw data files, folders or globs (local or s3://). Empty: the generated sample.",
    )
    until: str | None = Field(
        None,
        description=f"Stop after this phase of the recipe; one of {', '.join(PHASES)}.",
        json_schema_extra={"versioned": False},
    )
    runner: RunnerConfig = Field(
        default_factory=RunnerConfig, json_schema_extra={"versioned": False}
    )
    sample: SampleConfig = Field(default_factory=SampleConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    curate: CurateConfig = Field(default_factory=CurateConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    pretrain: PretrainConfig
    extend: ExtendConfig
    evaluate: EvalConfig = Field(default_factory=EvalConfig)
    sft: SFTStepConfig = Field(default_factory=SFTStepConfig)
    dpo: DPOStepConfig = Field(default_factory=DPOStepConfig)

    @field_validator("until")
    @classmethod
    def _known_step(cls, value: str | None) -> str | None:
        if value is not None and value not in PHASES:
            raise ValueError(f"not a phase of the recipe; allowed: {', '.join(PHASES)}")
        return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=3"`` -> (["a", "b"], 3); the value is parsed as YAML (numbers, lists, bools)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like field.path=value")
    path, raw = text.split("=", 1)
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"override {text!r} has an empty field path")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return keys, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted path in a nested dict (creating levels as needed)."""
    for text in overrides:
        keys, value = parse_override(text)
        node: Any = data
        for key in keys[:-1]:
            node = _child(node, key, text)
        if isinstance(node, list):
            node[_index(node, keys[-1], text)] = value
        else:
            node[keys[-1]] = value
    return data


def _index(node: list, key: str, text: str) -> int:
    if not key.isdigit() or int(key) >= len(node):
        raise ConfigError(f"override {text!r}: {key!r} is not an index of a list of {len(node)}")
    return int(key)


def _child(node: Any, key: str, text: str) -> Any:
    """One level down a dotted path: a dict key (created if missing) or a list index."""
    if isinstance(node, list):
        return node[_index(node, key, text)]
    child = node.get(key)
    if child is None:
        child = node[key] = {}
    if not isinstance(child, (dict, list)):
        raise ConfigError(f"override {text!r}: {key!r} is a value, not a section")
    return child


def format_validation_error(err: ValidationError) -> str:
    """One line per problem: field path, the bad value, what is allowed."""
    lines = []
    for problem in err.errors():
        path = ".".join(str(p) for p in problem["loc"]) or "(top level)"
        value = problem.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        if problem["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown field (value {shown}); check the spelling")
        else:
            lines.append(f"{path}: {shown} is invalid: {problem['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


def validate(cls: type[BaseModel], data: dict[str, Any]) -> BaseModel:
    """Validate ``data`` as ``cls``, turning pydantic's error into a ConfigError."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    except (ValueError, TypeError) as err:
        raise ConfigError(f"invalid config: {err}") from None


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> PipelineConfig:
    """Read a YAML preset, apply dotted overrides, validate."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of step configs")
    return validate(PipelineConfig, apply_overrides(data, overrides or []))


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as YAML."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
