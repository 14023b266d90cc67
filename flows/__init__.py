"""Prefect flows (they compose steps and compute nothing) and the ``llmflow`` CLI."""

import os

# NOTE: Prefect reads these at import; set them before anything imports prefect.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "llmflow")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "true")
# NOTE: on a busy 2-core machine the ephemeral API can take longer than the 20 s default to start.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

import logging

# The steps log through "llmflow.*"; Prefect forwards those records to the run's logs.
logging.getLogger("llmflow").setLevel(logging.INFO)
