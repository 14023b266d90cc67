"""``init:``: a recipe starts from an existing model (a tiny random LlamaForCausalLM in a mirror).

Its tokenizer (Llama 3's layout, which the fast byte-level encoder does not cover) tokenizes the
corpus with transformers' ids; the imported model's first training loss is transformers' loss on
the same batch; continued pretraining lowers it; a run killed with SIGKILL resumes to the same
losses; the export is transformers' LlamaForCausalLM again; changed weights change the address;
bad input fails before anything is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from llmflow.flows.recipe import recipe
from llmflow.tasks.config import load_config
from llmflow.tasks.dataprep.config import TokenizeConfig
from llmflow.tasks.dataprep.tokenize import tokenize_corpus
from llmflow.tasks.framework.errors import BadInputError, ConfigError
from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.ingest.hub import MIRROR_ENV
from llmflow.tasks.ingest.import_model import (
    ImportModelConfig,
    ImportTokenizerConfig,
    import_model,
    import_tokenizer,
)
from tests.flows.test_recipe import TINY
from tests.flows.tiny_llama import save_tiny_llama
from tests.tasks.tokenizer.corpus_helpers import write_corpus

REPO = "test/tiny-llama"
INIT = f"init=hf://models/{REPO}"
CONFIG = "configs/continue-pretrain.yaml"
# The quickstart's tiny sample (tests/flows/test_recipe.py), one short annealing stage.
SMALL = [o for o in TINY if not o.startswith(("pretrain.stages", "extend.stages", "tokenizer."))]
SMALL += [
    "pretrain.stages.0.mixture.num_tokens=12288",  # 12 steps of 4 x 256 tokens
    "pretrain.train.optimizer.lr=0.003",
    "pretrain.train.schedule.warmup_steps=2",
    "pretrain.train.log_interval=1",
]
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(12, 30))  # 42",
    "Ünïcödé, 漢字 and emoji 🦊: Llama 3 splits digits 1234567 in threes.",
    "   leading spaces, trailing tabs\t\t\nand \r\n line ends",
    "<|end_of_text|> in a document is text, not a special token.",
]


def _config(root: Path, *extra: str):
    return load_config(CONFIG, [f"root={root}", INIT, *SMALL, *extra])


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    folder = tmp_path / "mirror"
    save_tiny_llama(folder / REPO)
    monkeypatch.setenv(MIRROR_ENV, str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


def _run(graph, root: Path, step: str):
    """Run the closure of the first node of ``step``; its output folder."""
    node = graph.find(step=step)[0]
    return Path(Executor(str(root)).run(graph.closure([node]))[node].uri)


# ----------------------------------------------------------------------------- the tokenizer
def test_the_imported_tokenizer_gives_transformers_ids(mirror, tmp_path):
    from transformers import AutoTokenizer

    model_out, tok_out, tokenized = (tmp_path / n for n in ("model", "tok", "tokenized"))
    for folder in (model_out, tok_out, tokenized):
        folder.mkdir()
    import_model(ImportModelConfig(model=f"hf://models/{REPO}"), out=model_out)
    meta = import_tokenizer(ImportTokenizerConfig(), model=model_out, out=tok_out)
    assert meta == {"vocab_size": 384, "tokenizer_vocab_size": 384, "eos_id": 1, "pad_id": 1,
                    "bos_id": 0}  # fmt: skip
    docs = [{"id": f"d{i}", "text": t, "domain": "web", "source": "s"} for i, t in enumerate(TEXTS)]
    write_corpus(docs, tmp_path / "corpus", num_files=1)
    cfg = TokenizeConfig(validation_fraction=0.0)
    tokenize_corpus(cfg, corpus=tmp_path / "corpus", tokenizer=tok_out, out=tokenized)

    hf = AutoTokenizer.from_pretrained(mirror / REPO)
    info = json.loads((tokenized / "meta.json").read_text())
    assert (info["vocab_size"], info["eos_id"], info["bos_id"]) == (384, 1, 0)
    folder = tokenized / info["train"]["web"]["dir"]
    tokens = np.fromfile(folder / "tokens.bin", dtype=info["dtype"])
    offsets = np.load(folder / "offsets.npy")
    got = [tokens[offsets[k] : offsets[k + 1]].tolist() for k in range(len(TEXTS))]
    # Documents are packed as tokens + eos: no bos from the post-processor; special-token text
    # in a document is text (transformers: split_special_tokens).
    want = [hf(t, add_special_tokens=False, split_special_tokens=True)["input_ids"] for t in TEXTS]
    assert got == want
    assert hf("hi")["input_ids"][0] == 0  # the post-processor would have added bos


# ----------------------------------------------------------------------------- the graph
def test_init_replaces_the_tokenizer_and_the_architecture(mirror, tmp_path, caplog):
    caplog.set_level("INFO", logger="llmflow.init")
    config = _config(tmp_path / "runs")
    graph = recipe(config)
    steps = [n.step.name for n in graph.nodes]
    assert "import-model" in steps and "import-tokenizer" in steps
    assert "tokenizer" not in steps and "longctx" not in steps  # imported; no extension
    imported = graph.find(step="import-model")[0]
    pinned = imported.config.model
    assert pinned.startswith(f"hf://models/{REPO}@local-")
    assert {Path(f).name for f in imported.inputs["files"].files} >= {
        "config.json", "model.safetensors", "tokenizer.json"
    }  # fmt: skip
    (stage,) = graph.find(step="pretrain")
    assert stage.inputs["init"] is imported
    model = stage.config.train.model_config_obj()
    assert (model.hf_model_type, model.num_layers, model.hidden_size, model.vocab_size) == (
        "llama", 2, 64, 384
    )  # fmt: skip
    assert "pretrain.train.model (preset 'debug') is replaced" in caplog.text
    assert graph.find(step="tokenize")[0].inputs["tokenizer"].step.name == "import-tokenizer"
    assert not (tmp_path / "runs").exists()  # building the recipe writes nothing


def test_a_changed_weight_file_changes_the_address_and_breaks_the_old_pin(mirror, tmp_path):
    root = tmp_path / "runs"
    first = recipe(_config(root))
    before = _run(first, root, "import-model")
    save_tiny_llama(mirror / REPO, seed=1)  # new weights, same names and sizes
    second = recipe(_config(root))
    after = _run(second, root, "import-model")
    assert before.parent == after.parent and before.name != after.name
    old_pin = first.find(step="import-model")[0].config.model
    assert second.find(step="import-model")[0].config.model != old_pin
    with pytest.raises(BadInputError, match="now fingerprints as .* not the pinned"):
        recipe(load_config(CONFIG, [f"root={root}", f"init={old_pin}", *SMALL]))


def test_without_stages_the_init_model_is_the_base_as_it_is(mirror, tmp_path):
    """No stage trains: nothing is imported or exported; the pinned folder, copied as it is
    (``external-model``), is the base (tests/flows/test_init_as_is.py: models we cannot import)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    root = tmp_path / "runs"
    graph = recipe(_config(root, "pretrain.stages=[]"))
    steps = {n.step.name for n in graph.nodes}
    assert not steps & {"pretrain", "import-model", "export"}
    exported = _run(graph, root, "external-model") / "hf"
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    original = LlamaForCausalLM.from_pretrained(mirror / REPO).eval()
    assert type(model) is LlamaForCausalLM
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, original(ids).logits, atol=1e-5)
    assert (exported / "tokenizer.json").read_text() == (
        mirror / REPO / "tokenizer.json"
    ).read_text()


# ----------------------------------------------------------------------------- bad input
def _variant(mirror: Path, name: str, change) -> str:
    folder = mirror / "test" / name
    shutil.copytree(mirror / REPO, folder)
    change(folder)
    return f"init=hf://models/test/{name}"


def _edit_config(**fields):
    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **fields}))

    return change


def _qwen2_moe(folder: Path) -> None:
    """A mixture of experts of a class we do not map (Qwen3-MoE and Mixtral import)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    for path in folder.iterdir():
        path.unlink() if path.name.startswith(("config", "model")) else None
    config = Qwen2MoeConfig(vocab_size=384, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)  # fmt: skip
    Qwen2MoeForCausalLM(config).save_pretrained(folder)


def _classifier(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    for path in folder.iterdir():
        path.unlink() if path.name.startswith(("config", "model")) else None
    config = LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_labels=2)  # fmt: skip
    LlamaForSequenceClassification(config).save_pretrained(folder)


def _smaller_model(folder: Path) -> None:
    from tests.flows.tiny_llama import build_llama

    (folder / "model.safetensors").unlink()
    build_llama(vocab_size=300).save_pretrained(folder)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda m: "init=hf://models/test/missing", r"no repo test/missing in the mirror"),
        (lambda m: f"{INIT}@{'a' * 40}", rf"revision '{'a' * 40}' is not in the mirror"),
        (lambda m: "init=/no/such/folder", r"init='/no/such/folder': no such folder"),
        (
            lambda m: _variant(m, "no-weights", lambda f: (f / "model.safetensors").unlink()),
            r"holds no weights",
        ),
        (lambda m: _variant(m, "classifier", _classifier), r"is not a causal language model"),
        (lambda m: _variant(m, "moe", _qwen2_moe), r"num_\w*experts=4: this mixture-of-experts"),
        (
            lambda m: _variant(
                m, "window", _edit_config(sliding_window=128, use_sliding_window=True)
            ),
            r"sliding",
        ),
        (
            lambda m: _variant(m, "small-vocab", _smaller_model),
            r"the tokenizer has 384 ids but the model's embedding has vocab_size=300 rows",
        ),
    ],
    ids=[
        "missing-repo",
        "missing-revision",
        "missing-folder",
        "no-weights",
        "classifier",
        "moe",
        "sliding-window",
        "vocab-mismatch",
    ],  # fmt: skip
)
def test_bad_init_fails_before_anything_is_written(mirror, tmp_path, make, message):
    import time

    root = tmp_path / "runs"
    override = make(mirror)
    start = time.perf_counter()
    with pytest.raises(BadInputError, match=message):
        recipe(load_config(CONFIG, [f"root={root}", *SMALL, override]))
    assert time.perf_counter() - start < 10
    assert not root.exists()


def test_empty_stages_need_init():
    with pytest.raises(ConfigError, match="pretrain.stages is empty"):
        load_config(None, ["pretrain.stages=[]"])
    with pytest.raises(ConfigError, match="not a Hub model URI"):
        load_config(None, ["init=hf://models/only-owner"])


# ----------------------------------------------------------------------------- training
def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def _transformers_loss(model_dir: Path, data_dir: Path, batch_size: int, seed: int) -> float:
    """transformers' token-mean loss on the trainer's first batch: each document of a packed
    row on its own (the trainer masks attention and restarts positions per document)."""
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    from llmflow.tasks.dataprep.loader import PackedLoader

    batch = PackedLoader(data_dir, batch_size, 0, 1, seed=seed).next_batch()
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for row in range(batch["input_ids"].shape[0]):
            starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist()
            for a, b in zip(starts, [*starts[1:], batch["input_ids"].shape[1]], strict=True):
                logits = model(batch["input_ids"][row, a:b][None]).logits[0]
                labels = batch["labels"][row, a:b]
                total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
                count += int((labels != -100).sum())
    return float(total / count)


@pytest.mark.slow
def test_continued_pretraining_starts_at_transformers_loss_lowers_it_and_resumes_exactly(
    mirror, tmp_path, monkeypatch, caplog
):
    caplog.set_level("INFO", logger="llmflow.pretrain")
    root = tmp_path / "runs"
    graph = recipe(_config(root))
    (stage,) = graph.find(step="pretrain")
    closure = graph.closure([stage])

    # A SIGKILL after step 7 (the step-6 checkpoint is complete): the step fails, nothing commits.
    monkeypatch.setenv("LLMFLOW_FAULTS", json.dumps({"sigkill_after_step": 7}))
    with pytest.raises(Exception):  # noqa: B017  (the launcher's error for a killed trainer)
        Executor(str(root)).run(closure)
    assert not list((root / "pretrain").glob("*/_COMMITTED"))
    monkeypatch.delenv("LLMFLOW_FAULTS")
    outcome = Executor(str(root)).run(closure)
    resumed = Path(outcome[stage].uri)
    assert "resumed from" in caplog.text and "at step 6" in caplog.text
    losses = _losses(resumed)

    # The same stage without the kill (its output moved aside): the same losses, bit for bit.
    shutil.move(resumed, tmp_path / "resumed")
    again = Path(Executor(str(root)).run(closure)[stage].uri)
    assert again == resumed
    assert _losses(again) == losses and sorted(losses) == list(range(1, 13))

    # Step 1 trains the imported weights: its loss is transformers' loss on the same batch.
    data = Path(outcome[stage.inputs["data"]].uri)
    train = stage.config.train
    reference = _transformers_loss(mirror / REPO, data, train.batch.micro_batch_size, train.seed)
    assert losses[1] == pytest.approx(reference, abs=1e-4)
    assert losses[1] > 5.5  # about ln(384): a random model
    assert losses[12] < losses[1] - 0.8  # continued pretraining lowers it
    summary = json.loads((again / "summary.json").read_text())
    print(f"init loss: transformers {reference:.4f}, step 1 {losses[1]:.4f}, step 12 "
          f"{losses[12]:.4f}, val {summary['val_loss']:.4f}")  # fmt: skip


def test_preflight_sizes_the_imported_model_and_names_a_bad_one(mirror, tmp_path):
    from llmflow.tasks.preflight import Report
    from llmflow.tasks.preflight.checks import check_config

    report = Report("continue-pretrain")
    config = check_config(report, CONFIG, [f"root={tmp_path}", INIT])
    assert report.checks[0].go and "2 layers x 64" in report.checks[0].detail
    assert config.init.startswith(f"hf://models/{REPO}@local-")
    bad = Report("continue-pretrain")
    assert check_config(bad, CONFIG, [f"root={tmp_path}", "init=hf://models/test/missing"]) is None
    assert not bad.checks[0].go and "no repo test/missing" in bad.checks[0].detail


def test_cli_run_names_a_missing_init_model_in_seconds_and_writes_nothing(tmp_path):
    import os
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "LLMFLOW_HUB_MIRROR": str(tmp_path / "mirror")}
    (tmp_path / "mirror").mkdir()
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "llmflow.flows.cli", "run", str(repo / "configs" / "continue-pretrain.yaml"),
         "--root", str(tmp_path / "runs")],
        cwd=repo, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "no repo HuggingFaceTB/SmolLM2-135M in the mirror" in out.stderr
    assert time.perf_counter() - started < 20  # before the recipe's imports (seconds, not ~50)
    assert not (tmp_path / "runs").exists()
