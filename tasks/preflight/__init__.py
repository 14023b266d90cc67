"""Preflight: the checklist to pass before launching a long run, on the machine it runs on.

For a recipe it (1) resolves and validates the config; (2) checks that every data source is
reachable and yields documents; (3) plans the run on the recipe's declared GPUs; (4) builds the
model at full shape on the meta device and checks its parameter count against the plan
(``checks.py``); (5) runs a few real optimizer steps at full width and depth through the trainer,
with the recipe's sharding (FSDP2 over ``processes`` ranks; a short sequence and micro-batch where
the machine is small, ``shape.py``), resumes the checkpoint of the middle step in a new process,
and checks that the loss continues bitwise; (6) measures tokens/s and peak memory (``memory.py``)
and compares the memory with the plan's prediction for those very settings; (7) writes the first
evaluation scores (held-out loss and perplexity of the trained model, and the loss at
initialisation against ln(vocab)) (``rehearsal.py``); (8) rehearses the parallel layouts
(TP, CP, PP) ``llmflow plan`` gives the recipe's stages, at a tiny width against data
parallelism alone (``layouts.py``). :func:`preflight` runs them in order
(``checklist.py``) into a go/no-go :class:`Report` (``report.py``); ``flows/preflight.py`` is its
Prefect flow and ``llmflow preflight`` its command.

Training data for step (5) are uniform random tokens of the model's vocabulary: the steps test
the machine, the shapes and the sharding, not the corpus (step (2) tests that).
"""

from llmflow.tasks.preflight.checklist import preflight
from llmflow.tasks.preflight.report import Check, PreflightOptions, Report

__all__ = ["Check", "PreflightOptions", "Report", "preflight"]
