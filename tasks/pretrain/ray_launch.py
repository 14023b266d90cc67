"""Run the trainer on a Ray cluster: Ray Train's ``TorchTrainer`` with N workers, each running
the same ``llmflow.tasks.pretrain.train`` entry that torchrun runs.

The pretrain step starts this module as its process (``launcher: ray``), exactly as it starts
torchrun: the driver's output, worker lines included (Ray forwards them), streams into the step's
log; checkpoints land in the run folder and are announced through ``checkpoints.jsonl``; the
deadline kills the driver, whose job's workers Ray then stops. Ray Train sets up the process group
(gloo on CPU, NCCL on GPU) and the torchrun environment variables, so the trainer joins it as it
joins torchrun's. A worker that dies fails the attempt; Ray restarts the worker group up to
``max_failures`` times, and each start resumes from the run folder's latest checkpoint, as a
retried step does.

Preemption: Ray Train runs the training function in a thread of its worker actor, where no signal
handler can be installed. The launcher's torch backend first installs a `SigtermRelay` on every
worker's main thread (``preemption.install_sigterm_relay``, through Ray's ``execute`` on the
actor), so a SIGTERM to a rank checkpoints and ends it with code 75, as under torchrun; the
driver then fails and the launcher reads the preempted event.

Workers must see the run folder: one machine, or a volume shared by the nodes (see
docs/CLUSTER.md).

    python -m llmflow.tasks.pretrain.ray_launch --address auto --workers 2 -- <trainer args>
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.framework.ray_cluster import check_reachable, forwarded_env, init_ray
from llmflow.tasks.pretrain.notices import LAUNCHER_HOST_ENV, LAUNCHER_PID_ENV

ANSI = re.compile(r"\x1b\[[0-9;]*m")


class RaySettings(BaseModel):
    """Where and how wide the trainer runs on Ray (execution-only: never in a hash)."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field(
        "local",
        description=(
            "'local' starts a Ray cluster on this machine for the run; 'auto' joins the cluster "
            "this machine belongs to; 'HOST:PORT' (the head's GCS) or 'ray://HOST:PORT' (Ray "
            "Client) joins that one."
        ),
    )
    workers: int = Field(2, ge=1, description="Training workers (data-parallel ranks).")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs each worker reserves.")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs each worker reserves.")
    max_failures: int = Field(
        1, ge=0, description="Worker-group restarts (each resumes from the latest checkpoint)."
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process-group backend; auto: NCCL with GPUs, else gloo."
    )

    def arguments(self) -> list[str]:
        """This module's command-line flags for these settings (one per field)."""
        return [f"--{_flag(name)}={getattr(self, name)}" for name in RaySettings.model_fields]

    @classmethod
    def from_arguments(cls, argv: list[str]) -> RaySettings:
        """The settings ``arguments()`` gave; a flag left out keeps the field's default."""
        parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        for name, field in cls.model_fields.items():
            parser.add_argument(f"--{_flag(name)}", dest=name, help=field.description)
        given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
        return cls(**given)  # NOTE: pydantic turns the flags' strings into the fields' types


def _flag(name: str) -> str:
    return name.replace("_", "-")


def build_ray_command(train_args: list[str], settings: RaySettings) -> list[str]:
    """The argv of a driver that runs the trainer on Ray."""
    return [sys.executable, "-m", __name__, *settings.arguments(), "--", *train_args]


class RayLines:
    """The driver's output for people: worker lines once, without Ray's colour codes and its
    controller's state-API chatter (no dashboard runs)."""

    NOISE = ("PlacementGroupCleaner", "State API may be temporarily unavailable")

    def __init__(self, on_line: Callable[[str], Any]):
        self.on_line = on_line
        self.last: str | None = None

    def __call__(self, line: str) -> None:
        line = ANSI.sub("", line)
        if line == self.last or any(noise in line for noise in self.NOISE):
            return
        self.last = line
        self.on_line(line)


def worker_env(environ: dict[str, str]) -> dict[str, str]:
    """The variables every worker gets: the run's own settings (``LLMFLOW_*``), as torchrun's
    children inherit them, except the launcher's PID and host. A worker may run on another node,
    where that PID names no process (the rank SIGKILLed itself at start) or an unrelated one."""
    return forwarded_env(environ, exclude=(LAUNCHER_PID_ENV, LAUNCHER_HOST_ENV))


def _train_worker(config: dict) -> None:
    """One Ray Train worker: the trainer's own entry, in the process group Ray set up.

    The rank runs inside its Ray actor, so its life is the actor's: Ray stops the actor when the
    driver's job ends or the worker group is torn down. It never watches the launcher's PID, which
    a worker on a local cluster would inherit through the raylet the driver started.
    """
    from llmflow.tasks.pretrain.train import main

    os.environ.pop(LAUNCHER_PID_ENV, None)
    os.environ.pop(LAUNCHER_HOST_ENV, None)
    main(config["argv"])


def preemptible_torch_config(backend: str | None) -> Any:
    """Ray Train's ``TorchConfig`` whose backend, before it sets up the process group, installs
    the `SigtermRelay` on each worker's main thread (the actor runs ``execute`` there)."""
    from dataclasses import dataclass

    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend

    from llmflow.tasks.pretrain.preemption import install_sigterm_relay

    class PreemptibleTorchBackend(_TorchBackend):
        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            worker_group.execute(install_sigterm_relay)
            super().on_start(worker_group, backend_config)

    @dataclass
    class PreemptibleTorchConfig(TorchConfig):
        @property
        def backend_cls(self) -> type:
            return PreemptibleTorchBackend

    return PreemptibleTorchConfig(backend=backend)


def run_on_ray(settings: RaySettings, train_args: list[str]) -> None:
    """Connect (or start a local cluster), run the workers, raise if the run failed."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    check_reachable(settings.address)
    env = worker_env(dict(os.environ))
    options: dict[str, Any] = {"log_to_driver": True, "runtime_env": {"env_vars": env}}
    cpus = int(settings.workers * settings.cpus_per_worker) + 1
    init_ray(settings.address, num_cpus=cpus, **options)  # local: on 127.0.0.1 only
    use_gpu = settings.gpus_per_worker > 0
    resources = {"CPU": settings.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = settings.gpus_per_worker
    trainer = TorchTrainer(
        _train_worker,
        train_loop_config={"argv": train_args},
        scaling_config=ScalingConfig(
            num_workers=settings.workers, use_gpu=use_gpu, resources_per_worker=resources
        ),
        torch_config=preemptible_torch_config(
            None if settings.backend == "auto" else settings.backend
        ),
        run_config=RunConfig(
            name="llmflow-pretrain",
            storage_path=tempfile.mkdtemp(prefix="llmflow-ray-"),
            failure_config=FailureConfig(max_failures=settings.max_failures),
        ),
    )
    trainer.fit()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    run_on_ray(RaySettings.from_arguments(argv[:split]), argv[split + 1 :])


if __name__ == "__main__":
    main()
