"""SIGTERM reaches a trainer that runs off the main thread (as in a Ray Train worker actor)
through the relay the main thread installed; without a listener it goes where it went before."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from llmflow.tasks.pretrain.preemption import Preemption, SigtermRelay, install_sigterm_relay


@pytest.fixture
def sigterm_restored():
    """Whatever the test installs, this process's SIGTERM handler is the original afterwards."""
    original = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, original)


def _in_thread(fn) -> None:
    worker = threading.Thread(target=fn)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive()


def _until(condition, timeout_s: float = 5.0) -> bool:
    """Poll on the main thread (where Python runs signal handlers)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_trainer_off_the_main_thread_gets_sigterm_through_the_relay(sigterm_restored):
    before: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: before.append(signum))  # Ray's, say
    relay = install_sigterm_relay()
    assert install_sigterm_relay() is relay  # once per process
    assert signal.getsignal(signal.SIGTERM) is relay

    trainer = SimpleNamespace(runtime=SimpleNamespace(is_main=True))
    preemption = Preemption(grace_s=60.0)
    preemption._watchdog = lambda: None  # NOTE: the real one would end pytest after the grace
    seen: list[bool] = []

    def train() -> None:  # the training thread: listen, be signalled, stop listening
        preemption.on_train_start(trainer)
        os.kill(os.getpid(), signal.SIGTERM)
        seen.append(preemption.wait_for_signal(timeout_s=10.0))
        preemption.on_train_end(trainer)

    _in_thread(train)
    assert seen == [True] and before == []  # the trainer's handler took it
    assert relay.listener is None
    os.kill(os.getpid(), signal.SIGTERM)  # no trainer: the previous handler's again
    assert _until(lambda: before == [signal.SIGTERM])


def test_without_a_relay_a_trainer_off_the_main_thread_says_sigterm_will_not_checkpoint(
    sigterm_restored, capsys
):
    handler = signal.getsignal(signal.SIGTERM)
    assert not isinstance(handler, SigtermRelay)
    preemption = Preemption(grace_s=60.0)
    _in_thread(
        lambda: preemption.on_train_start(SimpleNamespace(runtime=SimpleNamespace(is_main=True)))
    )
    assert "SIGTERM will end the process without a checkpoint" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is handler and preemption.relay is None
