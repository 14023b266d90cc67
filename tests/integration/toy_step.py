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

from pydantic import BaseModel

from llmflow.tasks.framework.store import Store, run_step


class ToyConfig(BaseModel):
    value: int = 7


def write_checkpoint(out_dir: Path, name: str) -> None:
    ckpt = out_dir / "checkpoints" / name
    ckpt.mkdir(parents=True)
    (ckpt / "weights.bin").write_bytes(b"w" * 1000)
    (ckpt / "COMPLETE").write_text("ok")  # written last, as the trainer does


def crash(ctx, ready_file: Path) -> None:
    write_checkpoint(ctx.out_dir, "step-000001")
    ctx.sync()
    write_checkpoint(ctx.out_dir, "step-000002")
    shutil.rmtree(ctx.out_dir / "checkpoints" / "step-000001")  # pruned, as the trainer does
    ctx.sync()
    ready_file.write_text("synced")
    time.sleep(600)  # killed here


def resume(ctx, found_file: Path) -> dict:
    found = sorted(
        p.relative_to(ctx.out_dir).as_posix() for p in ctx.out_dir.rglob("*") if p.is_file()
    )
    found_file.write_text(json.dumps(found))
    (ctx.out_dir / "final.txt").write_text("done")
    return {"resumed_files": len(found)}


def main(root: str, mode: str, path: str) -> None:
    fn = crash if mode == "crash" else resume
    result = run_step(
        Store(root), "toy", "resume", "1", ToyConfig(), lambda ctx: fn(ctx, Path(path))
    )
    print(result.uri)


if __name__ == "__main__":
    main(*sys.argv[1:4])
