"""The checkpoint notices a trainer run leaves, for the tests and benchmarks that read them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmflow.tasks.pretrain.notices import NOTICES


def read_notices(out_dir: Path) -> list[dict[str, Any]]:
    """The checkpoint notices of a run folder (``checkpoints.jsonl``), oldest first."""
    path = Path(out_dir) / NOTICES
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
