"""The launcher–trainer contract (docs/ARCHITECTURE.md) held by every launcher: a plain process,
torchrun's 2 ranks, accelerate, and Ray Train on a real 127.0.0.1 cluster. Each run is preempted
(SIGTERM after step 2, by fault injection), then re-run: the same files, exit code or event, and
notices whichever launcher started the ranks, and the resumed weights equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import run_trainer, tiny_config
from test_launcher_tie import small_ray_head  # noqa: F401 (a 127.0.0.1 head with num_cpus=2)

from llmflow.tasks.framework.resources import preset_path
from llmflow.tasks.pretrain.faults import ENV
from llmflow.tasks.pretrain.launch import (
    TrainingPreempted,
    launch_training,
    train_arguments,
)
from llmflow.tasks.pretrain.launchers import (
    Accelerate,
    Launcher,
    LaunchSettings,
    LocalProcess,
    RayTrain,
    Torchrun,
)
from llmflow.tasks.pretrain.notices import (
    CONFIG_FILE,
    PREEMPTED_EVENT,
    PREEMPTED_EXIT_CODE,
    RANKS,
    SUMMARY,
    TRAIN_MODULE,
)
from llmflow.tasks.pretrain.ray_launch import RaySettings
from tests.tasks.pretrain.notices import read_notices

ROOT = Path(__file__).resolve().parents[3]
ACCELERATE_CPU = ROOT / "deployments" / "accelerate" / "cpu.yaml"


def _ray(request, monkeypatch) -> Launcher:
    from test_ray_launch import RAY_ENV

    address, env = request.getfixturevalue("small_ray_head")
    for key in (*RAY_ENV, "RAY_AUTH_TOKEN"):  # the driver joins the head with its token
        monkeypatch.setenv(key, env[key])
    return RayTrain(RaySettings(address=address, workers=1, max_failures=0))


LAUNCHERS = [
    pytest.param(lambda *_: LocalProcess(), id="local"),
    pytest.param(lambda *_: Torchrun(2), id="torchrun"),
    pytest.param(
        lambda *_: Accelerate(ACCELERATE_CPU, processes=1), id="accelerate", marks=pytest.mark.slow
    ),
    pytest.param(
        _ray,
        id="ray",
        # Ray Train runs the trainer off its actor's main thread: SIGTERM reaches it through the
        # relay the launcher installs on the actor's main thread (ray_launch.py)
        marks=[pytest.mark.slow, pytest.mark.integration],
    ),
]


@pytest.mark.parametrize("make", LAUNCHERS)
def test_every_launcher_keeps_the_trainer_contract(
    make, request, tmp_path, train_data, monkeypatch
):
    launcher: Launcher = make(request, monkeypatch)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = tiny_config(max_steps=4, eval_interval=100, checkpoint={"interval": 2})
    run = tmp_path / "run"
    lines: list[str] = []
    notices: list[dict] = []

    # Preempted: SIGTERM after step 2 reaches every rank (as Slurm and Kubernetes send it).
    monkeypatch.setenv(ENV, json.dumps({"sigterm_after_step": 2}))
    with pytest.raises(TrainingPreempted, match=r"preempted \(SIGTERM\) at step 3") as caught:
        launch_training(
            cfg, train_data, run, launcher=launcher, on_line=lines.append,
            on_checkpoint=notices.append,
        )  # fmt: skip
    # Files: the config the launcher wrote is the trainer's; the notices announce each complete
    # checkpoint, then the preemption; no summary, so nothing looks complete.
    assert json.loads((run / CONFIG_FILE).read_text()) == cfg.model_dump(mode="json")
    args = train_arguments(run / CONFIG_FILE, train_data, run)
    assert lines[0] == "launching: " + " ".join(launcher.command(args))
    # the trainer's module, or Ray's driver, whose workers run that module's main
    entry = "llmflow.tasks.pretrain.ray_launch" if isinstance(launcher, RayTrain) else TRAIN_MODULE
    assert entry in lines[0]
    if isinstance(launcher, RayTrain):  # the rank's handler took it, on the actor's main thread
        assert any("SIGTERM received: saving a checkpoint" in line for line in lines), lines[-30:]
    assert [(n["step"], n["final"]) for n in notices] == [(2, False), (3, False)]
    events = [n for n in read_notices(run) if n.get("event") == PREEMPTED_EVENT]
    assert [(e["step"], Path(e["path"]).name) for e in events] == [(3, "step-000003")]
    assert not (run / SUMMARY).exists()
    # Exit code: 75 where the rank's own code reaches the launcher (a plain process); a launcher
    # in between (torchrun, Ray's driver) replaces it, and the event says it instead.
    if isinstance(launcher, LocalProcess) and type(launcher) is LocalProcess:
        assert caught.value.returncode == PREEMPTED_EXIT_CODE
    else:
        assert caught.value.returncode not in (0, None)
    ranks = [json.loads(p.read_text()) for p in sorted((run / RANKS).glob("rank-*.json"))]
    assert [(r["rank"], r["world_size"]) for r in ranks] == [
        (rank, launcher.workers) for rank in range(launcher.workers)
    ]

    # Re-run without the fault: it resumes at step 3 and ends with the summary it returns.
    monkeypatch.delenv(ENV)
    summary = launch_training(
        cfg, train_data, run, launcher=launcher, on_line=lines.append,
        on_checkpoint=notices.append,
    )  # fmt: skip
    assert any("resumed from" in x and "at step 3" in x for x in lines), lines[-30:]
    assert summary == json.loads((run / SUMMARY).read_text())
    assert (summary["steps"], summary["world_size"]) == (4, launcher.workers)
    last = notices[-1]
    assert (last["path"], last["step"], last["final"]) == (str(run / "final"), 4, True)

    # The launcher changes nothing the trainer computes: an uninterrupted plain trainer run on
    # the same world size gives the same weights, bit for bit.
    reference = tmp_path / "reference"
    run_trainer(cfg, train_data, reference, num_processes=launcher.workers)
    from safetensors.torch import load_file

    expected = load_file(reference / "final" / "model.safetensors")
    got = load_file(run / "final" / "model.safetensors")
    assert expected.keys() == got.keys()
    assert all(bool((got[k] == v).all()) for k, v in expected.items())


def test_launch_settings_name_their_launcher():
    """Each setting of ``pretrain.launcher``/``num_processes``/``accelerate_config`` builds one
    launcher, whose workers are the world size the hash and the step count use."""
    cases = {
        (): (LocalProcess(), 1),
        (("num_processes", 3),): (Torchrun(3), 3),
        (("accelerate_config", "deployments/accelerate/cpu.yaml"),): (
            Accelerate(preset_path("deployments/accelerate/cpu.yaml"), processes=1),
            1,
        ),
        (("launcher", "ray"), ("num_processes", 3)): (RayTrain(RaySettings()), 2),
    }
    for fields, (launcher, world_size) in cases.items():
        settings = LaunchSettings(**dict(fields))
        assert settings.build_launcher() == launcher, fields
        assert settings.world_size == launcher.workers == world_size, fields


def test_a_new_launcher_is_one_class(tmp_path, train_data, monkeypatch):
    """A launcher written outside this package (here: the plain process under ``env``, as an
    ``srun`` would wrap it) runs through ``launch_training`` unchanged, with its own printer."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    class Wrapped(LocalProcess):
        name = "env"

        def command(self, train_args: list[str]) -> list[str]:
            return ["env", "LLMFLOW_WRAPPED=1", *super().command(train_args)]

        def printer(self, on_line):
            return lambda line: on_line(f"[env] {line}")

    lines: list[str] = []
    cfg = tiny_config(max_steps=2, eval_interval=100)
    summary = launch_training(
        cfg, train_data, tmp_path / "run", launcher=Wrapped(), on_line=lines.append
    )
    assert lines[0].startswith(f"[env] launching: env LLMFLOW_WRAPPED=1 {sys.executable} -m ")
    assert all(line.startswith("[env] ") for line in lines)
    assert summary["steps"] == 2 and summary["world_size"] == 1
    assert os.environ.get("LLMFLOW_WRAPPED") is None


def test_rays_driver_reads_the_settings_it_was_given_and_their_defaults_only_once():
    """The driver's flags come from RaySettings' fields: none given gives RaySettings()'s
    defaults (before, argparse repeated each default), and any settings round-trip."""
    assert RaySettings.from_arguments([]) == RaySettings()
    odd = RaySettings(
        address="10.0.0.1:6379", workers=3, cpus_per_worker=2.5, gpus_per_worker=1.0,
        max_failures=0, backend="gloo",
    )  # fmt: skip
    assert RaySettings.from_arguments(odd.arguments()) == odd
    assert RaySettings.from_arguments(["--workers=5"]) == RaySettings(workers=5)
    with pytest.raises(ValueError, match="backend"):
        RaySettings.from_arguments(["--backend=mpi"])
