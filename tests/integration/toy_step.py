"""A toy step on an S3 store, run as its own process by test_s3.py so it can be SIGKILLed.

``python toy_step.py ROOT crash READY_FILE``: writes two checkpoints (pruning the first), syncs
after each, touches READY_FILE, then hangs until killed. ``python toy_step.py ROOT resume OUT``:
the same step again; it finishes from whatever state it finds and writes what it found to OUT.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from pydantic import BaseModel, Field

from llmflow.tasks.framework.step import Metrics, checkpoint_saved, step
from llmflow.tasks.framework.store import Store


class ToyConfig(BaseModel):
    value: int = 7
    mode: str = Field("resume", json_schema_extra={"versioned": False})
    path: str = Field("", json_schema_extra={"versioned": False})


def write_checkpoint(out_dir: Path, name: str) -> None:
    ckpt = out_dir / "checkpoints" / name
    ckpt.mkdir(parents=True)
    (ckpt / "weights.bin").write_bytes(b"w" * 1000)
    (ckpt / "COMPLETE").write_text("ok")  # written last, as the trainer does


def crash(out: Path, ready_file: Path) -> None:
    write_checkpoint(out, "step-000001")
    checkpoint_saved()
    write_checkpoint(out, "step-000002")
    shutil.rmtree(out / "checkpoints" / "step-000001")  # pruned, as the trainer does
    checkpoint_saved()
    ready_file.write_text("synced")
    time.sleep(600)  # killed here


def resume(out: Path, found_file: Path) -> dict:
    found = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    found_file.write_text(json.dumps(found))
    (out / "final.txt").write_text("done")
    return {"resumed_files": len(found)}


@step("toy", execution=("mode", "path"))
def toy(cfg: ToyConfig, out: Path) -> Metrics:
    """Crash after two synced checkpoints, or finish from whatever state is there."""
    return (crash if cfg.mode == "crash" else resume)(out, Path(cfg.path))


def main(root: str, mode: str, path: str) -> None:
    result = toy.run(Store(root), ToyConfig(mode=mode, path=path), "resume")
    print(result.uri)


if __name__ == "__main__":
    main(*sys.argv[1:4])
