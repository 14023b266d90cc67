"""Preflight under memory pressure: a rank that runs out of memory is a no-go row of the table.

The test steps run in a subprocess under an address-space limit (RLIMIT_AS) the test sets, at a
shape whose activations cannot fit it: a rank's allocation is refused, torchrun fails with
ChildFailedError, and preflight still ends in its table, the out-of-memory row naming the
measured peak against the plan and the settings that would fit.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap

import pytest

from llmflow.tasks.config import CONFIGS

pytestmark = pytest.mark.slow

LIMIT_BYTES = 4 * 10**9
"""Address space of every process of the run (the preflight, torchrun and each rank)."""
# A narrow model with a wide MLP: 64k tokens per rank make each (tokens, 8192) MLP buffer 2 GB,
# so the first block's gate and up projections alone pass the limit, within seconds.
MODEL = (
    "pretrain.train.model.overrides={vocab_size: 256, hidden_size: 16, num_layers: 2, "
    "num_heads: 2, num_kv_heads: 1, intermediate_size: 8192, max_seq_len: 2048, nope_interval: 0}"
)
SCRIPT = textwrap.dedent(
    """
    import json, sys
    from llmflow.flows.preflight import PreflightOptions, preflight

    options = PreflightOptions(processes=2, seq_len=1024, micro_batch_size=64, steps=2,
                               check_data=False, timeout_s=240)
    report = preflight(sys.argv[1], [sys.argv[2]], options)
    print(json.dumps(report.numbers.get("out_of_memory")))
    print(report.table())
    """
)


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


def test_a_rank_out_of_memory_is_a_no_go_row_with_what_to_change():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(CONFIGS / "smollm3-135m.yaml"), MODEL],
        preexec_fn=_limit_address_space,
        capture_output=True,
        text=True,
        timeout=420,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in proc.stdout
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].endswith("checks pass)") and ": NO-GO (" in lines[-1], proc.stdout
    row = next(line for line in lines if line.startswith("train 2 steps"))
    assert " NO-GO " in row and "out of memory at seq 1024 x micro 64 on 2 ranks" in row, row
    assert "measured peak" in row and "against a plan of" in row
    for setting in ("--micro-batch-size 1", "activation_checkpointing=full", "--seq-len"):
        assert setting in row, row
    found = json.loads(next(line for line in lines if line.startswith(("{", "null"))))
    # the peak reached before the rank died is measured, and the plan says it does not fit
    assert 0.5 < found["peak_gb"] < LIMIT_BYTES / 1e9 < found["plan_gb"], found
    assert not any(line.startswith("checkpoint, resume") for line in lines)
