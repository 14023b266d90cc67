"""Keep transformers offline and away from the user's cache in model tests."""

import os
import tempfile

# NOTE: huggingface_hub reads these at import time, so they are set before any test imports it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="llmflow-hf-home-"))
