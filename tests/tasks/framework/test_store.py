"""The store: content addressing, skip-when-complete, atomic commit, lineage, crash safety."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.framework.hashing import step_hash
from llmflow.tasks.framework.lineage import format_tree
from llmflow.tasks.framework.step import step
from llmflow.tasks.framework.store import COMMIT_MARKER, Store

REPO = Path(__file__).resolve().parents[3]


class ToyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: int = 1
    workers: int = Field(1, json_schema_extra={"versioned": False})


@dataclass
class Ctx:
    """What the toy functions below see: config, output directory, inputs."""

    config: BaseModel
    out_dir: Path
    inputs: dict[str, Path]


def run_step(store, name, label, version, config, fn, inputs=None):
    """Declare ``fn`` as the step ``name`` on the fly and run it through the store."""

    @step(name, version=int(version))
    def declared(cfg: ToyConfig, out: Path, up: Path | None = None) -> dict:
        return fn(Ctx(cfg, out, {"up": up}))

    return declared.run(store, config, label, inputs)


def write_value(ctx):
    (ctx.out_dir / "value.txt").write_text(str(ctx.config.value))
    return {"value": ctx.config.value}


def test_output_is_addressed_by_versioned_config_only():
    base = step_hash("s", "1", ToyConfig(), {})
    assert step_hash("s", "1", ToyConfig(workers=8), {}) == base
    assert step_hash("s", "1", ToyConfig(value=2), {}) != base
    assert step_hash("s", "2", ToyConfig(), {}) != base
    assert step_hash("s", "1", ToyConfig(), {"x": "abc"}) != base


def test_run_writes_lineage_and_skips_when_complete(tmp_path):
    store = Store(tmp_path)
    calls = []

    def fn(ctx):
        calls.append(1)
        return write_value(ctx)

    first = run_step(store, "toy", "t", "1", ToyConfig(value=3), fn)
    assert not first.cached and calls == [1]
    out = Path(first.uri)
    assert (out / COMMIT_MARKER).exists() and (out / "value.txt").read_text() == "3"
    record = json.loads((out / "lineage.json").read_text())
    for key in (
        "step",
        "config",
        "inputs",
        "code",
        "packages",
        "host",
        "run",
        "started_at",
        "ended_at",
        "metrics",
        "hash",
    ):
        assert key in record, key
    assert record["code"]["git_sha"] is None or len(record["code"]["git_sha"]) == 40
    assert record["metrics"] == {"value": 3}
    second = run_step(store, "toy", "t", "1", ToyConfig(value=3, workers=4), fn)
    assert second.cached and second.uri == first.uri and calls == [1]


def test_downstream_hash_follows_upstream(tmp_path):
    store = Store(tmp_path)
    up1 = run_step(store, "up", "t", "1", ToyConfig(value=1), write_value)
    up2 = run_step(store, "up", "t", "1", ToyConfig(value=2), write_value)

    def down(ctx):
        (ctx.out_dir / "copy.txt").write_text((ctx.inputs["up"] / "value.txt").read_text())

    d1 = run_step(store, "down", "t", "1", ToyConfig(), down, inputs={"up": up1.uri})
    d2 = run_step(store, "down", "t", "1", ToyConfig(), down, inputs={"up": up2.uri})
    assert d1.uri != d2.uri
    assert (Path(d2.uri) / "copy.txt").read_text() == "2"
    tree = format_tree(d2.uri, store.read_lineage)
    assert up2.uri in tree and "down" in tree and up1.uri not in tree


def test_failed_step_leaves_nothing_complete_and_retry_sees_partial_state(tmp_path):
    store = Store(tmp_path)
    attempts = []

    def flaky(ctx):
        attempts.append(sorted(p.name for p in ctx.out_dir.iterdir()))
        (ctx.out_dir / "checkpoint").write_text("step 5")
        if len(attempts) == 1:
            raise OSError("worker killed")
        return {}

    with pytest.raises(OSError):
        run_step(store, "train", "t", "1", ToyConfig(), flaky)
    assert not list((tmp_path / "train").glob("t-*"))  # no output dir at all, complete or not
    result = run_step(store, "train", "t", "1", ToyConfig(), flaky)
    assert attempts[1] == ["checkpoint"]  # the retry resumes from the first attempt's state
    assert store.is_complete(result.uri)


def test_incomplete_output_is_never_taken_as_complete(tmp_path):
    store = Store(tmp_path)
    done = run_step(store, "toy", "t", "1", ToyConfig(), write_value)
    (Path(done.uri) / COMMIT_MARKER).unlink()  # e.g. a copy that died before its marker
    again = run_step(store, "toy", "t", "1", ToyConfig(), write_value)
    assert not again.cached and store.is_complete(again.uri)


KILL_SCRIPT = """
import sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from pydantic import BaseModel
from llmflow.tasks.framework.step import step
from llmflow.tasks.framework.store import Store

class C(BaseModel):
    n: int = 3

@step("slow")
def slow(cfg: C, out: Path) -> dict:
    for i in range(cfg.n):
        (out / f"part-{{i}}").write_text(str(i))
        print("wrote", i, flush=True)
        time.sleep(float(sys.argv[2]))
    return {{"parts": cfg.n}}

print(slow.run(Store(sys.argv[1]), C(), "t").uri, flush=True)
"""


def test_killed_step_between_writes_then_rerun_matches_uninterrupted(tmp_path):
    script = tmp_path / "step.py"
    script.write_text(KILL_SCRIPT.format(repo=str(REPO)))
    root = tmp_path / "root"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root), "5"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().startswith("wrote 0")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = Store(root)
    assert not any(store.is_complete(str(p)) for p in (root / "slow").glob("t-*"))
    out = subprocess.run(
        [sys.executable, str(script), str(root), "0"], capture_output=True, text=True, check=True
    )
    uri = out.stdout.strip().splitlines()[-1]
    clean = tmp_path / "clean"
    out2 = subprocess.run(
        [sys.executable, str(script), str(clean), "0"], capture_output=True, text=True, check=True
    )
    uri2 = out2.stdout.strip().splitlines()[-1]
    assert Path(uri).name == Path(uri2).name
    files = sorted(p.name for p in Path(uri).iterdir())
    assert files == sorted(p.name for p in Path(uri2).iterdir())
    for name in ("part-0", "part-1", "part-2"):
        assert (Path(uri) / name).read_text() == (Path(uri2) / name).read_text()


def test_concurrent_runs_of_one_step_do_not_corrupt(tmp_path):
    script = tmp_path / "step.py"
    script.write_text(KILL_SCRIPT.format(repo=str(REPO)))
    root = tmp_path / "root"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(root), "0.3"], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    uris = [p.communicate()[0].strip().splitlines()[-1] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert uris[0] == uris[1]
    assert Store(root).is_complete(uris[0])
    assert sorted(p.name for p in Path(uris[0]).iterdir()) == [
        "_COMMITTED",
        "lineage.json",
        "part-0",
        "part-1",
        "part-2",
    ]


def test_address_of_inverts_uri_and_listdir_reads_one_folder(tmp_path):
    store = Store(tmp_path)
    uri = store.uri("curate-filter", "quickstart-shard-00001", "0123456789abcdef")
    assert Store.address_of(uri) == ("curate-filter", "quickstart-shard-00001", "0123456789abcdef")
    assert Store.address_of(uri + "/") == Store.address_of(uri)
    (Path(uri) / "shards").mkdir(parents=True)
    for name in ("b.parquet", "a.parquet"):
        (Path(uri) / "shards" / name).write_text("x")
    assert store.listdir(uri, "shards") == ["a.parquet", "b.parquet"]
    assert store.listdir(uri, "missing") == []
