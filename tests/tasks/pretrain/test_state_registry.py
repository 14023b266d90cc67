"""Checkpoint state as a registry: a component that declares a ``state_key`` is saved, resumed
(sync and async saves) and resharded between world sizes with no other change to the trainer.

``counter_trainer.py`` is the trainer plus two step counters: one of rank 0 (``trainer_state.json``)
and one of each rank (``rank-NNNNN.pt``). A run killed after step 6 (last checkpoint: step 4)
resumes; its counters must read 12 at step 12, as the uninterrupted run's do. Without the
registry they would restart at 0 and read 8.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import losses_by_step, run_trainer, tiny_config

from llmflow.tasks.pretrain import checkpoint as ckpt
from llmflow.tasks.pretrain.state_registry import Info, StateRegistry

SCRIPT = Path(__file__).resolve().parent / "counter_trainer.py"


def run_counted(cfg, data_dir, out_dir, processes: int, crash_after: int | None = None):
    """``counter_trainer.py`` as the trainer is run (one process, or torchrun); its process."""
    faults = {"crash_after_step": crash_after} if crash_after is not None else None
    return run_trainer(cfg, data_dir, out_dir, num_processes=processes, check=False,
                       faults=faults, script=SCRIPT)  # fmt: skip


def counters(out_dir: Path, processes: int) -> dict[str, list[int]]:
    read = {
        key: [json.loads((out_dir / f"{key}-{r}.json").read_text()) for r in range(processes)]
        for key in ("step_counter", "rank_counter")
    }
    assert all(row["step"] == 12 for rows in read.values() for row in rows), read
    return {key: [row["counted"] for row in rows] for key, rows in read.items()}


def interrupted(cfg, data_dir, out_dir, before: int, after: int):
    """Killed after step 6 at ``before`` processes, resumed to the end at ``after``."""
    proc = run_counted(cfg, data_dir, out_dir, before, crash_after=6)
    assert proc.returncode != 0 and not (out_dir / "final").exists(), proc.stdout[-2000:]
    assert (out_dir / "checkpoints" / "step-000004").exists()
    proc = run_counted(cfg, data_dir, out_dir, after)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    return proc


@pytest.mark.parametrize(
    "async_save", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "async"]
)
def test_a_registered_component_resumes_as_the_uninterrupted_run(tmp_path, train_data,
                                                                  async_save):  # fmt: skip
    cfg = tiny_config(checkpoint={"interval": 4, "keep_last": 2, "async_save": async_save})
    full = tmp_path / "full"
    assert run_counted(cfg, train_data, full, 1).returncode == 0
    assert counters(full, 1) == {"step_counter": [12], "rank_counter": [12]}
    saved = json.loads((full / "checkpoints" / "step-000008" / "trainer_state.json").read_text())
    assert saved["step_counter"] == {"counted": 8} and "rank_counter" not in saved

    resumed = tmp_path / "resumed"
    interrupted(cfg, train_data, resumed, 1, 1)
    assert counters(resumed, 1) == counters(full, 1)


@pytest.mark.slow
def test_a_checkpoint_of_the_layout_before_the_registry_resumes_exactly(tmp_path, train_data):
    """Checkpoints written before the registry kept the components' state under "components"
    of trainer_state.json (the rank files are unchanged): such a checkpoint resumes bit-equal."""
    cfg = tiny_config()
    full, old = tmp_path / "full", tmp_path / "old"
    assert run_counted(cfg, train_data, full, 1).returncode == 0
    proc = run_counted(cfg, train_data, old, 1, crash_after=6)
    assert proc.returncode != 0
    folder = old / "checkpoints" / "step-000004"
    state = json.loads((folder / "trainer_state.json").read_text())
    own = ("train", "guard", "optimizer", "world_size")
    legacy = {k: state[k] for k in own} | {
        "components": {k: state[k] for k in state if k not in own}
    }
    assert set(legacy["components"]) == {"throughput_detector", "step_counter"}
    (folder / "trainer_state.json").write_text(json.dumps(legacy, indent=1))
    ckpt.write_checksums(folder)
    proc = run_counted(cfg, train_data, old, 1)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stdout[-3000:]
    assert counters(old, 1) == counters(full, 1)
    assert losses_by_step(old) == losses_by_step(full)


@pytest.mark.slow
def test_a_registered_component_reshards_between_world_sizes(tmp_path, train_data):
    cfg2 = tiny_config(batch={"micro_batch_size": 2})
    cfg1 = tiny_config(batch={"micro_batch_size": 4})  # the same global batch at one process

    # two ranks to one: rank 0's JSON state and rank 0's own state carry over
    down = tmp_path / "down"
    interrupted(cfg2, train_data, down, 2, 1)
    assert counters(down, 1) == {"step_counter": [12], "rank_counter": [12]}

    # one rank to two: the JSON state carries over; no rank has its own, so each starts over
    up = tmp_path / "up"
    proc = interrupted(cfg1, train_data, up, 1, 2)
    assert "data loader restarts" in proc.stdout
    assert counters(up, 2) == {"step_counter": [12, 12], "rank_counter": [8, 8]}


def test_registry_refuses_a_name_twice_and_loads_the_older_layout():
    class Box:
        def __init__(self):
            self.value = None

        def state_dict(self):
            return self.value

        def load_state_dict(self, state):
            self.value = state

    registry, box, kept = StateRegistry(), Box(), Box()
    registry.register("box", box)
    registry.register("kept", kept, per_rank=True)
    registry.register("name", Info(lambda: "adamw"))
    with pytest.raises(ValueError, match="'box' is registered twice"):
        registry.register("box", Box(), per_rank=True)
    kept.value = "mine"
    # a checkpoint written before the registry kept components under "components"
    loaded = registry.load({"components": {"box": 3}, "name": "muon"}, None)
    assert loaded == ["box", "name"] and box.value == 3 and kept.value == "mine"
    assert registry.main_state() == {"box": 3, "name": "adamw"}
    assert registry.load({"box": 4}, {"kept": "theirs"}, ["kept"]) == ["kept"]
    assert box.value == 3 and kept.value == "theirs"
