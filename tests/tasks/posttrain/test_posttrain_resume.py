"""Post-training resumes exactly: SIGKILL the real SFT / DPO step after its first checkpoint,
run it again in the same folder, and the final weights equal those of an uninterrupted run.

The step writes TRL/transformers checkpoints (``save_steps``) into ``trainer/`` of its output
folder, which the store makes the fixed ``.partial`` folder of the output, so a retried step finds
them; the re-run passes the newest complete one to ``Trainer.train(resume_from_checkpoint=...)``.
The uninterrupted reference run takes no checkpoints at all (``checkpoint_interval=None``), so
equal weights also show that the interval, left out of the hash, changes no result.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmflow.tasks.posttrain.config import DPOStepConfig, GRPOStepConfig, SFTStepConfig
from llmflow.tasks.posttrain.driver import CHECKPOINT_MARKER, last_checkpoint

# Enough steps that a checkpoint every 2 lands long before the end (each step is ~10-50 ms on a
# shared CPU); the kill comes as soon as the first complete one appears.
STEPS = dict(
    max_length=64,
    per_device_batch_size=4,
    num_heldout=4,
    logging_steps=1,
    num_quickstart_examples=256,
)
SFT = dict(STEPS, max_steps=40, learning_rate=1e-3)
DPO = dict(STEPS, max_steps=40, learning_rate=1e-4, lr_scheduler_type="cosine")
POLL_S = 0.02
BOUND_S = 240.0

GRPO = dict(
    max_steps=16,
    per_device_batch_size=4,
    num_generations=4,
    num_heldout=4,
    max_completion_length=8,
    num_quickstart_examples=64,
    logging_steps=1,
    learning_rate=1e-4,
    # an untrained model earns 0 from the built-in rewards, so no gradient; this one varies
    rewards=[{"name": "test_posttrain_resume:distinct_characters"}],
)

_CHILD = """
import json, sys
from pathlib import Path
from llmflow.tasks.posttrain.config import {config}
from llmflow.tasks.posttrain.{module} import {module}
cfg = {config}(**json.loads(sys.argv[1]))
{module}(cfg, Path(sys.argv[2]), Path(sys.argv[3]))
"""


def _kill_after_first_checkpoint(module: str, config: str, cfg: dict, model: Path, out: Path):
    """Run the step in a child process; SIGKILL it once a complete checkpoint exists.

    Returns:
        The step number of the checkpoint the child left behind.
    """
    code = _CHILD.format(module=module, config=config)
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    child = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(cfg), str(model), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    deadline = time.monotonic() + BOUND_S
    try:
        while time.monotonic() < deadline and child.poll() is None:
            if last_checkpoint(out / "trainer", clean=False) is not None:
                child.send_signal(signal.SIGKILL)
                break
            time.sleep(POLL_S)
    finally:
        if child.poll() is None and time.monotonic() >= deadline:
            child.kill()
        output = child.communicate()[0].decode(errors="replace")
    assert child.returncode == -signal.SIGKILL, (
        f"the {module} step ended with {child.returncode} before any checkpoint appeared in "
        f"{out / 'trainer'}; its output ends:\n{output[-3000:]}"
    )
    found = last_checkpoint(out / "trainer", clean=False)
    assert found is not None
    step = int(found.name.rsplit("-", 1)[1])
    assert 0 < step < cfg["max_steps"], f"killed at step {step} of {cfg['max_steps']}"
    assert not (out / "hf").exists(), "a killed step left a model that looks finished"
    return step


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "hf" / "model.safetensors"))


def _assert_same_weights(resumed: Path, reference: Path) -> None:
    a, b = _weights(resumed), _weights(reference)
    assert a.keys() == b.keys()
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert differing == [], f"resumed weights differ from the uninterrupted run's in {differing}"


def _resume_then_compare(step_fn, config_cls, cfg, model, tmp_path, module, caplog):
    killed = tmp_path / "killed"
    killed.mkdir()
    at = _kill_after_first_checkpoint(module, config_cls.__name__, cfg, model, killed)
    with caplog.at_level(logging.INFO, logger="llmflow.posttrain"):
        resumed_metrics = step_fn(config_cls(**cfg), model, killed)
    assert f"resuming from checkpoint-{at}" in caplog.text
    reference = tmp_path / "reference"
    reference.mkdir()
    reference_metrics = step_fn(
        config_cls(**{**cfg, "checkpoint_interval": None}), model, reference
    )
    _assert_same_weights(killed, reference)
    assert resumed_metrics["num_steps"] == reference_metrics["num_steps"] == cfg["max_steps"]
    # the loss sum carried in the checkpoint: the whole run's mean, as without the kill
    assert resumed_metrics["train_loss"] == pytest.approx(reference_metrics["train_loss"], rel=1e-9)
    for key, value in reference_metrics.items():
        if key != "train_loss":
            assert resumed_metrics[key] == value, key
    assert not (killed / "trainer").exists(), "checkpoints are dropped once the model is out"
    return resumed_metrics


@pytest.mark.slow
def test_sft_killed_after_a_checkpoint_resumes_to_the_same_weights(
    tmp_path, tiny_model_output, caplog
):
    from llmflow.tasks.posttrain.sft import sft

    cfg = dict(SFT, checkpoint_interval=2)
    metrics = _resume_then_compare(
        sft, SFTStepConfig, cfg, tiny_model_output, tmp_path, "sft", caplog
    )
    assert metrics["heldout_loss_after"] < metrics["heldout_loss_before"]


@pytest.mark.slow
def test_dpo_killed_after_a_checkpoint_resumes_to_the_same_weights(
    tmp_path, tiny_model_output, caplog
):
    from llmflow.tasks.posttrain.dpo import dpo

    cfg = dict(DPO, checkpoint_interval=2)
    metrics = _resume_then_compare(
        dpo, DPOStepConfig, cfg, tiny_model_output, tmp_path, "dpo", caplog
    )
    assert metrics["heldout_rewards_margins_before"] == 0.0  # policy == reference before
    assert metrics["heldout_rewards_margins_after"] != 0.0


def distinct_characters(completion: str, answer: str, answer_format: str = "equation") -> float:
    """A GRPO reward that differs between the sampled completions of an untrained model."""
    return len(set(completion)) / 10


@pytest.mark.slow
def test_grpo_killed_after_a_checkpoint_resumes_to_the_same_weights(
    tmp_path, tiny_model_output, caplog
):
    """GRPO too: sampling is seeded by the RNG states the checkpoint restores, and each optimizer
    step generates its own completions, so nothing buffered is lost with the process."""
    from llmflow.tasks.posttrain.grpo import grpo

    cfg = dict(GRPO, checkpoint_interval=2)
    metrics = _resume_then_compare(
        grpo, GRPOStepConfig, cfg, tiny_model_output, tmp_path, "grpo", caplog
    )
    assert metrics["heldout_kl_to_reference_after"] != 0.0  # it did train


def test_an_unfinished_checkpoint_is_never_resumed_from(tmp_path):
    """A folder without the marker (a kill mid-save) is skipped and removed; the newest marked
    one wins, by step number rather than by name."""
    trainer = tmp_path / "trainer"
    for step, marked in ((2, True), (10, True), (12, False)):
        folder = trainer / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"")
        if marked:
            (folder / CHECKPOINT_MARKER).write_text(json.dumps({"step": step, "loss_sum": 1.0}))
    assert last_checkpoint(trainer, clean=False) == trainer / "checkpoint-10"
    assert (trainer / "checkpoint-12").exists()
    assert last_checkpoint(trainer) == trainer / "checkpoint-10"
    assert not (trainer / "checkpoint-12").exists()
    assert last_checkpoint(tmp_path / "absent") is None


def test_the_checkpoint_interval_leaves_the_address_alone():
    """The interval is a cadence (resume is exact), so it is out of the hash, as are the other
    execution-only fields; its default checkpoints every 100 steps."""
    from llmflow.tasks.framework.hashing import versioned_fields
    from llmflow.tasks.posttrain.common import TRAIN_EXECUTION, common_training_args

    for config_cls in (SFTStepConfig, DPOStepConfig):
        plain = versioned_fields(config_cls())
        assert versioned_fields(config_cls(checkpoint_interval=7)) == plain
        assert versioned_fields(config_cls(checkpoint_interval=None)) == plain
        assert "checkpoint_interval" not in plain
    assert "checkpoint_interval" in TRAIN_EXECUTION
    args = common_training_args(SFTStepConfig(), Path("out"))
    assert (args["save_strategy"], args["save_steps"]) == ("steps", 100)
    args = common_training_args(SFTStepConfig(checkpoint_interval=None), Path("out"))
    assert args["save_strategy"] == "no"
    with pytest.raises(ValueError, match="checkpoint_interval"):
        SFTStepConfig(checkpoint_interval=0)


class _Interrupted(Exception):
    """Stands for a kill: raised once the checkpoint of a given step is complete."""


def _interrupting_trainer(method_cls, at: list[int]):
    """``method_cls.trainer`` that stops the run at the start of the step after ``at[0]``'s
    checkpoint (then ``at[1]``'s on the next run, ...), as a kill right after a save would."""
    from transformers import TrainerCallback

    build = method_cls.trainer

    class Interrupt(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if at and state.global_step == at[0]:
                at.pop(0)
                raise _Interrupted(state.global_step)

    def trainer(self, cfg, model_dir, out, data):
        built = build(self, cfg, model_dir, out, data)
        built.add_callback(Interrupt())
        return built

    return trainer


@pytest.mark.slow
def test_sft_train_loss_survives_two_interruptions(
    tmp_path, tiny_model_output, caplog, monkeypatch
):
    """Stopped at steps 15 and 25 of 30, the run reports the uninterrupted run's mean loss: each
    segment's loss sum adds to the one carried in the checkpoint it resumed from (logged every 2
    steps, so a checkpoint at an odd step also carries loss not yet logged)."""
    from llmflow.tasks.posttrain.sft import SFTMethod, sft

    cfg = dict(STEPS, max_steps=30, learning_rate=1e-3, logging_steps=2, checkpoint_interval=5)
    straight = tmp_path / "straight"
    straight.mkdir()
    reference = sft(SFTStepConfig(**{**cfg, "checkpoint_interval": None}), tiny_model_output,
                    straight)  # fmt: skip
    at = [15, 25]
    monkeypatch.setattr(SFTMethod, "trainer", _interrupting_trainer(SFTMethod, at))
    killed = tmp_path / "killed"
    killed.mkdir()
    for step in (15, 25):
        with pytest.raises(_Interrupted):
            sft(SFTStepConfig(**cfg), tiny_model_output, killed)
        assert last_checkpoint(killed / "trainer") == killed / "trainer" / f"checkpoint-{step}"
    with caplog.at_level(logging.INFO, logger="llmflow.posttrain"):
        resumed = sft(SFTStepConfig(**cfg), tiny_model_output, killed)
    assert "resuming from checkpoint-25" in caplog.text and at == []
    _assert_same_weights(killed, straight)
    assert resumed["num_steps"] == reference["num_steps"] == 30
    assert resumed["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-6)
    # the logged rows: those the checkpoint restored, then the last run's, each step once
    rows = [json.loads(line) for line in (killed / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(2, 31, 2))
