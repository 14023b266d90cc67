"""Launchers: what starts the trainer's ranks. ``launch.py`` runs and watches whichever it is.

A :class:`Launcher` says how many ranks it starts (``workers``), checks what it needs before any
compute (``check``: a Ray head answers), gives the command to run (``command``) and filters what
that command prints (``printer``). Everything else, the contract with the trainer, is the same for
every launcher (docs/ARCHITECTURE.md, "The launcher–trainer contract"): files in the run folder,
exit code 75, SIGTERM forwarding, ``LLMFLOW_LAUNCHER_PID``. A new launcher (Slurm's ``srun``, say)
is one class here and its name in :data:`LAUNCHERS` (and ``LaunchSettings.launcher``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmflow.tasks.framework.hashing import UNVERSIONED
from llmflow.tasks.framework.ray_cluster import check_reachable
from llmflow.tasks.pretrain.notices import TRAIN_MODULE
from llmflow.tasks.pretrain.ray_launch import RayLines, RaySettings, build_ray_command


class Launcher(Protocol):
    """Starts the trainer's ranks; ``launch_training`` runs its command and watches it."""

    name: ClassVar[str]

    @property
    def workers(self) -> int:
        """Data-parallel ranks it starts (the world size the run's steps and address count)."""
        ...

    def check(self) -> None:
        """Fail in seconds, naming what is missing, before the config is written or compute."""
        ...

    def command(self, train_args: list[str]) -> list[str]:
        """The argv that starts every rank of ``python -m llmflow.tasks.pretrain.train``."""
        ...

    def printer(self, on_line: Callable[[str], Any]) -> Callable[[str], Any]:
        """What of the command's output reaches ``on_line`` (all of it, unless noisy)."""
        ...


@dataclass(frozen=True)
class LocalProcess:
    """One process on this machine: ``python -m llmflow.tasks.pretrain.train``."""

    name: ClassVar[str] = "local process"

    @property
    def workers(self) -> int:
        return 1

    def check(self) -> None:
        pass

    def command(self, train_args: list[str]) -> list[str]:
        return [sys.executable, "-m", TRAIN_MODULE, *train_args]

    def printer(self, on_line: Callable[[str], Any]) -> Callable[[str], Any]:
        return on_line


@dataclass(frozen=True)
class Torchrun(LocalProcess):
    """``processes`` ranks on this machine under ``torchrun --standalone`` (gloo on CPU)."""

    name: ClassVar[str] = "torchrun"
    processes: int = 2

    @property
    def workers(self) -> int:
        return self.processes

    def command(self, train_args: list[str]) -> list[str]:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc_per_node", str(self.processes)]
        return launcher + ["-m", TRAIN_MODULE, *train_args]


@dataclass(frozen=True)
class Accelerate(LocalProcess):
    """``accelerate launch`` with a YAML (``deployments/accelerate/*.yaml``).

    ``--num_processes`` is always passed, so the ranks that start are the ones the run's step
    count and address count, whatever the YAML says (accelerate's documented override).
    """

    name: ClassVar[str] = "accelerate"
    config: Path
    processes: int = 1

    @property
    def workers(self) -> int:
        return self.processes

    def command(self, train_args: list[str]) -> list[str]:
        launcher = [sys.executable, "-m", "accelerate.commands.launch"]
        launcher += ["--config_file", str(self.config), "--num_processes", str(self.processes)]
        return launcher + ["-m", TRAIN_MODULE, *train_args]


@dataclass(frozen=True)
class RayTrain:
    """Ray Train workers: a driver process (``ray_launch``) that runs the ranks on a cluster."""

    name: ClassVar[str] = "ray"
    settings: RaySettings

    @property
    def workers(self) -> int:
        return self.settings.workers

    def check(self) -> None:
        check_reachable(self.settings.address)

    def command(self, train_args: list[str]) -> list[str]:
        return build_ray_command(train_args, self.settings)

    def printer(self, on_line: Callable[[str], Any]) -> Callable[[str], Any]:
        return RayLines(on_line)


def local_launcher(num_processes: int = 1, accelerate_config: Path | None = None) -> Launcher:
    """This machine's launcher: accelerate with a config, else torchrun for several processes."""
    if accelerate_config is not None:
        return Accelerate(Path(accelerate_config), processes=num_processes)
    return Torchrun(num_processes) if num_processes > 1 else LocalProcess()


def keyword_launcher(
    num_processes: int = 1, accelerate_config: Path | None = None, ray: RaySettings | None = None
) -> Launcher:
    """The launcher ``launch_training``'s keyword form names (Ray's settings win)."""
    return RayTrain(ray) if ray is not None else local_launcher(num_processes, accelerate_config)


def _local(settings: LaunchSettings) -> Launcher:
    """``launcher: local``; an accelerate config launching more ranks than counted is refused."""
    from llmflow.tasks.framework.resources import preset_path

    if settings.accelerate_config is None:
        return local_launcher(settings.num_processes)
    launched = accelerate_processes(settings.accelerate_config)
    if settings.num_processes == 1 and launched is not None and launched > 1:
        # NOTE: left at 1 beside a YAML of several, the user meant the YAML's count; the run
        # would budget its steps and take its address for 1 rank (8x the tokens).
        raise ValueError(
            f"num_processes is 1 but accelerate_config {settings.accelerate_config} launches "
            f"{launched} processes (num_processes: {launched}); set "
            f"pretrain.num_processes={launched} (the world size sets the step count and the "
            "run's address), or use a one-process config such as "
            "deployments/accelerate/single_gpu.yaml"
        )
    return Accelerate(preset_path(settings.accelerate_config), processes=settings.num_processes)


LAUNCHERS: dict[str, Callable[[LaunchSettings], Launcher]] = {
    "local": _local,
    "ray": lambda settings: RayTrain(settings.ray),
}
"""``LaunchSettings.launcher`` -> its launcher, built from the settings (may refuse them)."""


class LaunchSettings(BaseModel):
    """How a trainer run is started: on this machine or on Ray.

    The fields are execution-only: a run on 2 local processes and one on 2 Ray workers give the
    same weights. What they add up to is not: ``micro_batch_size`` is per rank, so the world size
    sets the global batch and the step count of a token budget, and it enters the hash
    (``versioned_extras``; a single-rank run keeps the address it always had).
    """

    model_config = ConfigDict(extra="forbid")

    num_processes: int = Field(
        1, ge=1, description="Processes on this machine.", json_schema_extra=UNVERSIONED
    )
    accelerate_config: str | None = Field(
        None,
        description="accelerate YAML, e.g. deployments/accelerate/multi_gpu_fsdp2.yaml.",
        json_schema_extra=UNVERSIONED,
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="Deadline of each trainer run (the process group is killed).",
        json_schema_extra=UNVERSIONED,
    )
    launcher: Literal["local", "ray"] = Field(
        "local",
        description="local: this machine (torchrun/accelerate); ray: Ray Train workers.",
        json_schema_extra=UNVERSIONED,
    )
    ray: RaySettings = Field(default_factory=RaySettings, json_schema_extra=UNVERSIONED)

    @model_validator(mode="after")
    def _launcher_accepts(self) -> LaunchSettings:
        """Build the launcher once, so settings it refuses fail when the recipe is validated."""
        self.build_launcher()
        return self

    def build_launcher(self) -> Launcher:
        """The launcher these settings name."""
        return LAUNCHERS[self.launcher](self)

    @property
    def world_size(self) -> int:
        """Data-parallel ranks the run trains on, whatever launches them."""
        return self.build_launcher().workers

    def versioned_extras(self) -> dict[str, int]:
        """The world size, for the hash (left out at 1, so single-rank addresses are unchanged)."""
        return {"world_size": self.world_size} if self.world_size != 1 else {}

    def launch_settings(self) -> dict[str, Any]:
        """These settings alone, to start a run with the same launch (``StageRun(**...)``)."""
        return {name: getattr(self, name) for name in LaunchSettings.model_fields}


def accelerate_processes(path: str) -> int | None:
    """The processes an accelerate YAML launches on its own (its ``num_processes``; 1 for a
    ``distributed_type: NO`` without it), or None where it leaves the count to the command line.

    Raises:
        ValueError: no such file (here or shipped with llmflow), or not an accelerate YAML.
    """
    import yaml

    from llmflow.tasks.framework.resources import preset_path

    try:
        data = yaml.safe_load(preset_path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"accelerate_config {path!r} cannot be read: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"accelerate_config {path!r} is not a mapping of accelerate settings")
    count = data.get("num_processes", 1 if data.get("distributed_type") == "NO" else None)
    if count is not None and (not isinstance(count, int) or isinstance(count, bool)):
        raise ValueError(f"accelerate_config {path!r}: num_processes={count!r} is not a count")
    return count if count is None or count > 0 else None  # -1: "pass --num_processes"
