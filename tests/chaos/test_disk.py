"""Local disk: writes that fail with EFBIG (a file size limit) or ENOSPC (a full file system)
mid-shard and mid-checkpoint.

The error names the file being written, how far it got and the limit; nothing that looks complete
is left; a re-run once the limit is lifted (or space freed) finishes with outputs bit-identical to
a fault-free run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel

from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.lineage import FILES_KEY, LINEAGE_FILE
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.framework.store import COMMIT_MARKER, NoSpaceError
from tests.chaos.conftest import file_digests, run_trainer, tiny_train_config
from tests.chaos.disk_faults import file_size_limit, fill, small_filesystem

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


class ShardSpec(BaseModel):
    shard_bytes: list[int] = [40_000, 80_000, 160_000]


@step("chaos-shards")
def shards(cfg: ShardSpec, out: Path) -> Metrics:
    """Seeded random shards of the given sizes, written one after the other (a shard writer)."""
    rng = np.random.default_rng(0)
    (out / "shards").mkdir(exist_ok=True)
    for k, size in enumerate(cfg.shard_bytes):
        rng.integers(0, 256, size, dtype=np.uint8).tofile(out / "shards" / f"part-{k:05d}.bin")
    (out / "meta.json").write_text(json.dumps({"num_shards": len(cfg.shard_bytes)}))
    return {"num_shards": len(cfg.shard_bytes)}


def _graph(spec: ShardSpec | None = None):
    graph = Graph()
    return graph, graph.add(shards, spec or ShardSpec(), "corpus")


def run_shards_in_child(root: Path, limit: int | None) -> subprocess.CompletedProcess:
    """Run the shard step through the store in a new process, under a file size limit."""
    code = (
        "import sys\n"
        "from tests.chaos.test_disk import _graph\n"
        "from llmflow.tasks.framework.executor import Executor\n"
        "Executor(sys.argv[1]).run(_graph()[0])\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(root)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=file_size_limit(limit) if limit else None,
    )


def _committed(root: Path) -> list[Path]:
    return sorted(Path(root).glob(f"*/*/{COMMIT_MARKER}"))


def _manifest(uri: str) -> dict:
    return json.loads((Path(uri) / LINEAGE_FILE).read_text())[FILES_KEY]


def test_efbig_mid_shard_names_the_file_commits_nothing_and_the_rerun_matches(tmp_path):
    graph, node = _graph()
    reference = Executor(str(tmp_path / "reference")).run(graph)[node]

    root = tmp_path / "limited"
    proc = run_shards_in_child(root, limit=100_000)  # shard 2 (160 kB) stops at 100 kB
    assert proc.returncode != 0
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("llmflow.tasks.framework.disk.NoSpaceError: no space to write step")
    assert "[Errno 27] File too large" in error
    assert "shards/part-00002.bin failed at 100,000 bytes; it needs 160,000 bytes" in error, error
    assert "the file size limit (RLIMIT_FSIZE) is 100,000 bytes per file" in error
    assert _committed(root) == [], "nothing may look complete"

    proc = run_shards_in_child(root, limit=None)  # the limit lifted: the same step again
    assert proc.returncode == 0, proc.stderr
    assert len(_committed(root)) == 1
    rerun = str(_committed(root)[0].parent)
    assert _manifest(rerun) == _manifest(reference.uri)
    assert file_digests(Path(rerun), "shards/*") == file_digests(Path(reference.uri), "shards/*")


def test_enospc_mid_shard_on_a_full_file_system_then_space_freed(tmp_path):
    graph, node = _graph()
    reference = Executor(str(tmp_path / "reference")).run(graph)[node]
    with small_filesystem(tmp_path / "disk") as disk:
        filler = fill(disk, leave_free=150_000)  # room for shards 0 and 1, not shard 2
        root = disk / "store"
        with pytest.raises(NoSpaceError) as caught:
            Executor(str(root)).run(graph)
        message = str(caught.value)
        assert "[Errno 28] No space left on device" in message
        assert "shards/part-00002.bin failed at" in message and "bytes free on" in message
        assert "it needs 160,000 bytes" in message
        assert _committed(root) == []
        filler.unlink()  # space freed
        rerun = Executor(str(root)).run(graph)[node]
        assert _manifest(rerun.uri) == _manifest(reference.uri)


def test_efbig_mid_checkpoint_names_it_leaves_no_checkpoint_and_the_rerun_matches(
    tmp_path, chaos_train_data, reference_run
):
    cfg, reference = tiny_train_config(), reference_run

    run = tmp_path / "limited"
    proc = run_trainer(cfg, chaos_train_data, run, preexec_fn=file_size_limit(100_000))
    assert proc.returncode != 0
    error = proc.stderr.strip().splitlines()[-1]
    assert "NoSpaceError: no space to write checkpoint" in error, proc.stderr[-3000:]
    assert f"{run}/checkpoints/step-000002" in error
    assert "/dcp/__0_0.distcp failed at 100,000 bytes" in error, error
    assert "it needs " in error and "RLIMIT_FSIZE) is 100,000 bytes" in error
    assert not list(run.glob("**/COMPLETE")) and not (run / "final").exists()

    assert run_trainer(cfg, chaos_train_data, run).returncode == 0  # the limit lifted
    weights = "final/model.safetensors"
    assert file_digests(run, weights) == file_digests(reference, weights)
