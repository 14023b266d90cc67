"""Peak memory of the fused loss (`model/loss.py:linear_cross_entropy`), measured as peak RSS in
a fresh process under preflight's ``MEASURE_ENV`` (freed blocks go back to the system, so the
peak follows the live tensors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from llmflow.tasks.preflight.memory import MEASURE_ENV

_SCRIPT = """
import json, resource
from pathlib import Path
import torch
from llmflow.model.loss import linear_cross_entropy

def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()

def peak():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

torch.set_num_threads(1)
tokens, hidden, vocab, rows = {tokens}, {hidden}, {vocab}, {rows}
gen = torch.Generator().manual_seed(0)
h = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
w = (torch.randn(vocab, hidden, generator=gen) * 0.02).requires_grad_()
y = torch.randint(0, vocab, (tokens,), generator=gen)
linear_cross_entropy(h, w, y, chunk_rows=rows)[0].backward()  # kernels and pages warmed up
h.grad = w.grad = None
Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the RSS now
before = rss()
loss, _ = linear_cross_entropy(h, w, y, chunk_rows=rows)
print(json.dumps({{"added": peak() - before}}))
"""


def test_fused_loss_holds_two_logit_blocks_at_most():
    """The forward (which makes the gradients) holds one chunk's logits and its softmax, plus
    the (N, C) and (V, C) gradients: at 2,048 x 64 x 8,192 in chunks of 256 rows (8 MiB blocks),
    measured 18.4 MiB added; before, the last chunk's softmax outlived its chunk and three
    blocks were alive at once (26.3 MiB)."""
    tokens, hidden, vocab, rows = 2048, 64, 8192, 256
    block = rows * vocab * 4
    grads = (tokens + vocab) * hidden * 4
    script = _SCRIPT.format(tokens=tokens, hidden=hidden, vocab=vocab, rows=rows)
    env = {**os.environ, **MEASURE_ENV, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    added = json.loads(out.stdout.strip().splitlines()[-1])["added"]
    assert added <= grads + 2.5 * block, (added / 2**20, (grads + 2 * block) / 2**20)
