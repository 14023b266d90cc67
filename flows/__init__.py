"""Prefect flows (they build graphs of steps and run them) and the ``llmflow`` CLI.

Prefect reads its settings when it is first imported, and every module here imports it, so this
package's ``__init__`` (which Python runs before any of them) sets llmflow's defaults, once. A
user's own environment variables win.
"""

import logging
import os
import sys

PREFECT_DEFAULTS = {
    "PREFECT_LOGGING_EXTRA_LOGGERS": "llmflow",  # the steps log through "llmflow.*"
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
    # NOTE: on a busy 2-core machine the ephemeral API can take longer than the 20 s default.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # Steps called outside a flow (tests, notebooks) log locally without a warning per record.
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}
for key, value in PREFECT_DEFAULTS.items():
    os.environ.setdefault(key, value)
logging.getLogger("llmflow").setLevel(logging.INFO)
_extra = {name.strip() for name in os.environ["PREFECT_LOGGING_EXTRA_LOGGERS"].split(",")}
if "prefect" in sys.modules and os.environ.get("PREFECT__FLOW_RUN_ID") and "llmflow" in _extra:
    # NOTE: a worker's flow-run process (python -m prefect.engine) sets Prefect's logging up
    # before it imports this package, so "llmflow" got no API handler and the steps' logs (the
    # trainer's lines) never reached the UI; give it the handlers Prefect gives extra loggers.
    _llmflow = logging.getLogger("llmflow")
    for _handler in logging.getLogger("prefect.extra").handlers:
        if _handler not in _llmflow.handlers:
            _llmflow.addHandler(_handler)
