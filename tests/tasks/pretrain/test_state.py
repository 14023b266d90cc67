"""The typed run state: what checkpoints save and how a new stage starts from the last one."""

from __future__ import annotations

import json

from llmflow.tasks.pretrain.state import RECENT_LOSSES, TrainState


def test_state_round_trips_and_keeps_the_last_losses():
    state = TrainState(end_step=20)
    for i in range(RECENT_LOSSES + 2):
        state.advance(loss=float(i), num_tokens=100)
    assert (state.step, state.tokens_seen) == (12, 1200)
    assert state.recent_losses == [float(i) for i in range(2, 12)]
    restored = TrainState()
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert restored == state


def test_a_new_stage_counts_the_tokens_of_the_ones_before():
    state = TrainState(step=30, start_step=10, end_step=30, tokens_seen=500, tokens_before=200,
                       batches_drawn=40, train_time_s=3.0, recent_losses=[1.0], val_loss=2.0)  # fmt: skip
    state.start_stage()
    assert state == TrainState(step=30, start_step=30, end_step=0, tokens_before=700)
    assert state.total_tokens_seen == 700


def test_a_checkpoint_written_before_tokens_before_existed_still_loads():
    state = TrainState()
    state.load_state_dict({"step": 5, "tokens_seen": 64, "recent_losses": [2.0]})
    assert (state.step, state.tokens_seen, state.tokens_before) == (5, 64, 0)
