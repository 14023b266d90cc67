"""The pipeline config: one typed config per step, YAML presets, dotted overrides.

``load_config("configs/quickstart.yaml", ["pretrain.train.optimizer.lr=3e-4"])`` reads the YAML,
applies each override, and validates everything before any compute. A bad value raises
``ConfigError`` naming the field path, the value given and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from llmflow.tasks.command_config import AblationConfig, CriticalBatchConfig, PreflightOptions
from llmflow.tasks.curation.config import CurateConfig
from llmflow.tasks.dataprep.config import TokenizeConfig, ValidationConfig
from llmflow.tasks.decontam.config import DecontamSettings
from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.extend.config import ExtendConfig
from llmflow.tasks.framework.errors import BadInputError, ConfigError
from llmflow.tasks.framework.hashing import ADDED_EXECUTION, UNVERSIONED
from llmflow.tasks.framework.resources import data_dir
from llmflow.tasks.ingest.ingest import IngestConfig
from llmflow.tasks.ingest.sample import SampleConfig
from llmflow.tasks.posttrain.config import (
    AverageConfig,
    DPOStepConfig,
    GRPOStepConfig,
    SFTStepConfig,
)
from llmflow.tasks.posttrain.merge import MergeStepConfig
from llmflow.tasks.pretrain.curriculum import PretrainConfig
from llmflow.tasks.safety.config import SafetyConfig
from llmflow.tasks.tokenizer.config import TokenizerConfig

CONFIGS = data_dir("configs")
DEFAULT_CONFIG = CONFIGS / "quickstart.yaml"
PHASES = (
    "sample",
    "ingest",
    "curate",
    "decontaminate",
    "tokenizer",
    "tokenize",
    "mixture",
    "pretrain",
    "extend",
    "evaluate",
    "sft",
    "dpo",
    "grpo",
    "merge",
    "leaderboard",
)
"""The recipe's phases in run order: ``--until`` stops after one."""


class RayEngineConfig(BaseModel):
    """Where a stage's shards run under ``runner.kind: ray`` (execution-only, never in a hash)."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field(
        "local",
        description=(
            "'local' starts a Ray cluster on this machine (127.0.0.1, all its cores) for the run; "
            "'auto' joins the cluster this machine belongs to; 'HOST:PORT' or 'ray://HOST:PORT' "
            "joins that one. A Ray already initialised in this process is used as it is."
        ),
    )
    max_in_flight: int | None = Field(
        None, ge=1, description="Ray tasks submitted at once (None: twice the cluster's CPUs)."
    )
    cpus_per_shard: float = Field(1.0, gt=0, description="CPUs each shard's Ray task reserves.")
    shards_per_task: int | None = Field(
        None,
        ge=1,
        description="Shards one Ray task runs, one after another, each committed as it ends "
        "(None: about eight tasks per CPU, at most 32 shards each).",
    )


PROCESSES_FROM_MB = 1.0
"""Where spawned processes start to beat a thread pool on a mapped stage (runner.processes_from_mb)."""


class RunnerConfig(BaseModel):
    """Where data-parallel work runs (`backend.make_backend`): a mapped stage's shards, and the
    units steps map themselves (ingest's and tokenize's files, the mixture's pack units, the
    partitioned dedup). Execution-only, never in a hash. Prefect orchestrates the steps; each
    mapped stage is one Prefect task."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["threads", "processes", "ray"] = Field(
        "threads",
        description="threads: a mapped stage's shards on a thread pool (on spawned processes "
        "from processes_from_mb of input), a step's own units in this process; processes: both "
        "on spawned processes (where the GIL binds: Python-heavy steps over large inputs); ray: "
        "both as Ray tasks (needs the ray extra).",
    )
    max_workers: int | None = Field(
        None, ge=1, description="Threads or processes (None: Python's default for the pool)."
    )
    processes_from_mb: float | None = Field(
        PROCESSES_FROM_MB,
        ge=0,
        description="Under threads, a mapped stage whose input holds at least this many MB runs "
        "its shards on spawned processes instead (Python-heavy filters hold the GIL; measured "
        "faster from about this size: benchmarks/README.md, 'Threads or processes'); None: "
        "threads at every size.",
        json_schema_extra=ADDED_EXECUTION,
    )
    fan_out: Literal["stage"] = Field(
        "stage",
        description="Always 'stage': each mapped stage is one Prefect task (kept so that recipes "
        "and model cards naming it still load; one task per shard, 'shard', was removed).",
    )
    ray: RayEngineConfig = Field(default_factory=RayEngineConfig)

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("fan_out", "stage") != "stage":
            raise ValueError(
                f"runner.fan_out={data['fan_out']!r} was removed: every mapped stage is one "
                "Prefect task whose shards run on runner.kind (threads, processes or ray); "
                "delete the field or set it to 'stage'"
            )
        if isinstance(data, dict) and data.get("kind") == "dask":
            raise ValueError(
                "runner.kind='dask' was removed: use threads, processes or ray (a stage's "
                "shards run there, inside its one Prefect task)"
            )
        return data


class HardwareConfig(BaseModel):
    """The machines a recipe is sized for: what ``llmflow plan`` and preflight plan against.

    Execution-only (never in a hash): the same recipe trains the same model on other hardware.
    """

    model_config = ConfigDict(extra="forbid")

    nodes: int = Field(1, ge=1, description="Machines in the training job.")
    gpus_per_node: int = Field(1, ge=1, description="GPUs per machine (data-parallel ranks).")
    gpu_mem_gb: float = Field(80.0, gt=0, description="Memory of one GPU, GB.")
    peak_tflops: float = Field(989.0, gt=0, description="Dense bf16 peak of one GPU (H100: 989).")
    mfu: float = Field(0.4, gt=0, le=1, description="Model FLOPs utilization expected.")

    @property
    def gpus(self) -> int:
        """Data-parallel GPUs in all."""
        return self.nodes * self.gpus_per_node


class PipelineConfig(BaseModel):
    """Everything one end-to-end run needs; each field below is one step's config."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        "quickstart", pattern=r"^[A-Za-z0-9_.-]+$", description="Label in output names."
    )
    root: str = Field(
        "./runs",
        description="Artifact root: a folder or s3://bucket/prefix.",
        json_schema_extra=UNVERSIONED,
    )
    data: list[str] = Field(
        default_factory=list,
        description="Raw data files, folders or globs (local or s3://). Empty: the generated sample.",
    )
    init: str | None = Field(
        None,
        description="Start from an existing model: hf://models/OWNER/NAME[@REVISION] or a "
        "folder (pinned when the recipe is built). Its tokenizer replaces the trained one and "
        "its architecture pretrain.train.model; pretrain.stages: [] post-trains it directly.",
    )
    until: str | None = Field(
        None,
        description=f"Stop after this phase of the recipe; one of {', '.join(PHASES)}.",
        json_schema_extra=UNVERSIONED,
    )
    runner: RunnerConfig = Field(default_factory=RunnerConfig, json_schema_extra=UNVERSIONED)
    hardware: HardwareConfig = Field(default_factory=HardwareConfig, json_schema_extra=UNVERSIONED)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    curate: CurateConfig = Field(default_factory=CurateConfig)
    decontaminate: DecontamSettings = Field(default_factory=DecontamSettings)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    pretrain: PretrainConfig
    extend: ExtendConfig
    evaluate: EvalConfig = Field(default_factory=EvalConfig)
    sft: SFTStepConfig = Field(default_factory=SFTStepConfig)
    dpo: DPOStepConfig = Field(default_factory=DPOStepConfig)
    grpo: GRPOStepConfig = Field(default_factory=GRPOStepConfig)
    merge: MergeStepConfig = Field(default_factory=MergeStepConfig)
    average: AverageConfig = Field(default_factory=AverageConfig)
    safety: SafetyConfig = Field(default_factory=SafetyConfig)
    preflight: PreflightOptions = Field(
        default_factory=PreflightOptions, json_schema_extra=ADDED_EXECUTION
    )
    critical_batch: CriticalBatchConfig = Field(
        default_factory=CriticalBatchConfig, json_schema_extra=ADDED_EXECUTION
    )
    ablation: AblationConfig = Field(
        default_factory=AblationConfig, json_schema_extra=ADDED_EXECUTION
    )

    @field_validator("until")
    @classmethod
    def _known_step(cls, value: str | None) -> str | None:
        if value is not None and value not in PHASES:
            raise ValueError(f"not a phase of the recipe; allowed: {', '.join(PHASES)}")
        return value

    @field_validator("init")
    @classmethod
    def _model_uri(cls, value: str | None) -> str | None:
        if value is not None:
            from llmflow.tasks.ingest.models import check_uri

            try:
                check_uri(value, "init")
            except BadInputError as err:
                raise ValueError(str(err)) from None
        return value

    @model_validator(mode="after")
    def _stages_or_init(self) -> PipelineConfig:
        if not self.pretrain.stages and self.init is None:
            raise ValueError(
                "pretrain.stages is empty: give at least one stage, or init (a model to "
                "post-train directly)"
            )
        if not self.pretrain.stages and self.average.enabled:
            raise ValueError("average.enabled needs pretrain.stages (it averages the last one's)")
        return self

    @model_validator(mode="after")
    def _layouts_supported(self) -> PipelineConfig:
        """Every training stage's parallel layout, as the trainer will check it: a layout it
        refuses fails here, before any step (``support.check_layout``). With ``init`` the
        architecture is the model's own, checked when the recipe is built."""
        from llmflow.tasks.pretrain.parallel.support import check_recipe_layouts

        check_recipe_layouts(self.pretrain, self.extend, with_model=self.init is None)
        return self


def required_extras(config: PipelineConfig) -> set[str]:
    """The optional extras (``pip install 'llmflow[...]'``) a recipe's run needs, from its config:
    the merge step (mergekit), Ray (launcher or runner), and the trackers."""
    needed = set()
    if config.merge.enabled:
        needed.add("merge")
    if config.pretrain.launcher == "ray" or config.runner.kind == "ray":
        needed.add("ray")
    if config.pretrain.train.tracker.others:
        needed.add("trackers")
    return needed


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


def _whole_config_error(err: ValidationError) -> ConfigError | None:
    """The ``ConfigError`` a validator of the whole config raised, if that is the only problem:
    its message already names the fields from the top (``pretrain.train.parallel.pp=2 ...``),
    so it is the one line to show."""
    problems = err.errors()
    if len(problems) != 1 or problems[0]["loc"]:
        return None
    found = problems[0].get("ctx", {}).get("error")
    return found if isinstance(found, ConfigError) else None


def validate(cls: type[BaseModel], data: dict[str, Any]) -> BaseModel:
    """Validate ``data`` as ``cls``, turning pydantic's error into a ConfigError."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        whole = _whole_config_error(err)
        raise (whole or ConfigError(format_validation_error(err))) from None
    except (ValueError, TypeError) as err:
        raise ConfigError(f"invalid config: {err}") from None


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> PipelineConfig:
    """Read a YAML preset, apply dotted overrides, validate."""
    data = read_recipe(Path(path) if path else DEFAULT_CONFIG)
    return validate(PipelineConfig, apply_overrides(data, overrides or []))


def read_recipe(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML recipe as a dict; with ``base: NAME`` (a preset in configs/ or a path, relative to
    this file first) it is the base recipe deep-merged with what this file changes."""
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in chain:
        raise ConfigError(f"{path}: base recipes form a cycle: {' -> '.join(map(str, chain))}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of step configs")
    base = data.pop("base", None)
    if base is None:
        return data
    return deep_merge(read_recipe(_base_path(path, base), (*chain, path.resolve())), data)


def _base_path(path: Path, base: Any) -> Path:
    """``base: smollm3-1.7b`` is configs/smollm3-1.7b.yaml; a path is taken beside ``path``."""
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base={base!r} must name a recipe in configs/ or a YAML path")
    for candidate in (path.parent / base, Path(base), CONFIGS / base, CONFIGS / f"{base}.yaml"):
        if candidate.is_file():
            return candidate
    known = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.yaml")))
    raise ConfigError(f"{path}: base={base!r} is neither a file nor a recipe in configs/ ({known})")


def deep_merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` over ``base``: mappings merge key by key; lists and values replace."""
    merged = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as YAML."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
