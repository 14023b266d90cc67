"""Post-training: SFT and DPO through TRL, on chat and preference data in common formats.

The steps ``sft`` (``sft.py``) and ``dpo`` (``dpo.py``) take a model output whose ``hf/`` holds
the model, write the trained model into their own ``hf/``, and return headline metrics.
"""

from __future__ import annotations

import importlib
from typing import Any

# NOTE: names resolve lazily, so importing the configs or the format loaders does not pay for
# importing torch, transformers and trl (tens of seconds on a loaded CI machine).
_EXPORTS = {
    "DPOStepConfig": "llmflow.tasks.posttrain.config",
    "SFTStepConfig": "llmflow.tasks.posttrain.config",
    "dpo": "llmflow.tasks.posttrain.dpo",
    "preference_accuracy": "llmflow.tasks.posttrain.dpo",
    "load_preference_pairs": "llmflow.tasks.posttrain.formats",
    "load_sft_examples": "llmflow.tasks.posttrain.formats",
    "make_quickstart_preferences": "llmflow.tasks.posttrain.quickstart",
    "make_quickstart_sft": "llmflow.tasks.posttrain.quickstart",
    "sft": "llmflow.tasks.posttrain.sft",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
