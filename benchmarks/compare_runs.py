"""Did two runs train the same model? Bitwise weights, logged losses and tokenizer, step by step.

    python benchmarks/compare_runs.py RUNS_A RUNS_B

For each pretraining stage, export, SFT and DPO output with the same label in both roots, it
compares every tensor of the safetensors files (wherever the output keeps them) with
``torch.equal``, and the ``loss``/``val_loss`` rows of each stage's ``metrics.jsonl``. Prints one
JSON line; exits 1 if anything differs. Used to check that a refactor changed no numerics.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from llmflow.tasks.framework.store import Store


def outputs(root: Path, step: str) -> dict[str, Path]:
    """Committed outputs of one step by label (the folder name less its hash)."""
    folder = root / step
    found = folder.iterdir() if folder.is_dir() else []
    store = Store(root)
    return {Store.address_of(str(p))[1]: p for p in found if store.is_complete(str(p))}


def weights(output: Path) -> Path:
    """The model weights of an output: the trainer's final/, or the HF folder, whatever its name."""
    candidates = sorted(output.glob("final/model.safetensors")) or sorted(
        output.glob("**/model.safetensors")
    )
    return candidates[0]


def same_tensors(a: Path, b: Path) -> bool:
    left, right = load_file(a), load_file(b)
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def losses(output: Path) -> list:
    path = output / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [(r.get("step"), r.get("loss"), r.get("val_loss")) for r in rows]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compare(a: Path, b: Path) -> dict[str, bool]:
    """Check name -> identical, for every model output both roots hold."""
    checks = {}
    for step in ("pretrain", "export", "sft", "dpo"):
        left, right = outputs(a, step), outputs(b, step)
        for label in sorted(set(left) & set(right)):
            checks[f"{step}/{label} weights"] = same_tensors(
                weights(left[label]), weights(right[label])
            )
            if step == "pretrain":
                checks[f"{step}/{label} losses"] = losses(left[label]) == losses(right[label])
    tokenizers = [next(iter(outputs(r, "tokenizer").values()), None) for r in (a, b)]
    if all(tokenizers):
        checks["tokenizer.json"] = sha256(tokenizers[0] / "tokenizer.json") == sha256(
            tokenizers[1] / "tokenizer.json"
        )
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    args = parser.parse_args()
    checks = compare(args.a, args.b)
    differ = sorted(k for k, same in checks.items() if not same)
    print(
        json.dumps(
            {"compared": len(checks), "identical": len(checks) - len(differ), "differ": differ}
        )
    )
    return 1 if differ or not checks else 0


if __name__ == "__main__":
    sys.exit(main())
