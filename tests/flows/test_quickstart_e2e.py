"""The whole quickstart DAG through the CLI, shrunk: every step runs, lineage reaches the raw
files, the exported models load in transformers, and a second run is all cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "sample.num_code_files=12",
    "sample.num_math_docs=120",
    "sample.num_exact_duplicates=10",
    "sample.num_near_duplicates=10",
    "sample.num_junk=6",
    "tokenizer.vocab_size=1024",
    "pretrain.stages.0.mixture.num_tokens=24000",
    "pretrain.stages.1.mixture.num_tokens=12000",
    "pretrain.stages.2.mixture.num_tokens=12000",
    "pretrain.train.checkpoint.interval=4",
    "pretrain.train.schedule.warmup_steps=2",
    "extend.stages.0.num_tokens=8000",
    "extend.stages.1.num_tokens=8000",
    "extend.eval.lengths=[256,512]",
    "extend.eval.depths=[0.5]",
    "extend.eval.trials=1",
    "extend.eval.position_loss_len=512",
    "evaluate.tasks=[heldout_ppl,cf_arith,gen_arith]",
    "evaluate.num_items=8",
    "evaluate.num_ppl_docs=3",
    "sft.max_steps=4",
    "sft.num_quickstart_examples=64",
    "sft.num_heldout=8",
    "dpo.max_steps=4",
    "dpo.num_quickstart_examples=64",
    "dpo.num_heldout=8",
]


def run_cli(root: Path) -> str:
    args = [sys.executable, "-m", "llmflow.flows.cli", "run", "--root", str(root)]
    for override in SMALL:
        args += ["--set", override]
    out = subprocess.run(
        args,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_quickstart_end_to_end(tmp_path):
    root = tmp_path / "runs"
    summary = run_cli(root)
    # the card once wrote through its link into the merge output's README.md
    assert_verifies_with_no_shared_written_file(root)
    for step in (
        "sample",
        "ingest",
        "curate",
        "tokenizer",
        "tokenize",
        "mixture",
        "pretrain",
        "longctx",
        "export",
        "evaluate",
        "sft",
        "dpo",
        "leaderboard",
    ):
        assert f"\n{step}" in summary, step
    dpo = next(p for p in (root / "dpo").iterdir() if not p.name.startswith("."))
    lineage = subprocess.run(
        [sys.executable, "-m", "llmflow.flows.cli", "lineage", str(dpo)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for step in (
        "dpo",
        "sft",
        "export",
        "pretrain",
        "mixture",
        "tokenize",
        "curate",
        "ingest",
        "sample",
    ):
        assert f"{step} " in lineage, step
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(dpo / "hf")
    tokenizer = AutoTokenizer.from_pretrained(dpo / "hf")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    longctx = json.loads(next((root / "longctx").glob("*/lineage.json")).read_text())["metrics"]
    assert longctx["num_long_docs"] > 0
    again = run_cli(root)
    assert "0 ran" in again, again[-2000:]


CARD_FILES = ("hf/README.md", "hf/llmflow_config.yaml")  # what the card step writes


def assert_verifies_with_no_shared_written_file(root: Path) -> None:
    """``llmflow verify`` finds every output ok; files two outputs share (hard links) are files
    no step wrote after linking: the cards' own files share no inode, and a shared file's bytes
    are what both outputs recorded."""
    from llmflow.tasks.framework.store import Store
    from llmflow.tasks.framework.verify import committed_outputs

    merged = [p for p in (root / "merge").iterdir() if not p.name.startswith(".")]
    assert merged and all((p / "hf" / "README.md").is_file() for p in merged)  # mergekit's

    verified = subprocess.run(
        [sys.executable, "-m", "llmflow.flows.cli", "verify", str(root)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stdout[-4000:]
    assert "CORRUPT" not in verified.stdout and ", 0 corrupt, 0 unchecked" in verified.stdout

    holders: dict[int, list[tuple[str, str, str]]] = defaultdict(list)
    outputs = list(committed_outputs(Store(str(root))))
    cards = [uri for uri in outputs if "/card/" in uri]
    assert len(cards) >= 2
    for uri in outputs:
        manifest = json.loads((Path(uri) / "lineage.json").read_text())["files"]
        for rel, entry in manifest.items():
            holders[os.stat(Path(uri) / rel).st_ino].append((uri, rel, entry["sha256"]))
    shared = {ino: found for ino, found in holders.items() if len({u for u, _, _ in found}) > 1}
    assert shared  # the cards' links to the models' weights
    for found in shared.values():
        assert len({sha for _, _, sha in found}) == 1, found
        written = [(u, rel) for u, rel, _ in found if u in cards and rel in CARD_FILES]
        assert not written, found
