"""Every row of a packed dataset, for the tests and benchmarks that compare packed outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmflow.tasks.dataprep.pack import read_meta


def read_all_rows(data_dir: Path) -> np.ndarray:
    """Every row of a packed dataset in stored order, shape (N, T+1)."""
    meta = read_meta(data_dir)
    blocks = [
        np.fromfile(Path(data_dir) / s["file"], dtype=meta["dtype"]).reshape(
            -1, meta["seq_len"] + 1
        )
        for s in meta["shards"]
    ]
    return np.concatenate(blocks)
