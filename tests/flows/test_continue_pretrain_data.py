"""``configs/continue-pretrain.yaml`` on a user's own documents.

A mixture that names no domain trains on the data's own domains, in proportion to their tokens
(said in one log line); a mixture that names a domain the ``--data`` files lack fails when the
recipe is built, before any step runs; a bad input met inside the flow prints the one
``llmflow: error:`` line, no traceback; and the documented command, on documents with no
``domain`` field against a mirror holding a tiny Llama, ends with an exported model and its card.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmflow.flows.cli import main
from llmflow.flows.recipe import recipe
from llmflow.tasks.config import load_config
from llmflow.tasks.dataprep.config import StageMixture
from llmflow.tasks.dataprep.mixture import plan_mixture
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.ingest.hub import MIRROR_ENV
from tests.flows.tiny_llama import save_tiny_llama

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "continue-pretrain.yaml"
INIT_REPO = "HuggingFaceTB/SmolLM2-135M"  # the recipe's own init, served by the mirror


def _prose(min_chars: int = 400) -> list[str]:
    """Real English prose (the Python reference's topics, as the quickstart sample takes)."""
    from pydoc_data.topics import topics

    texts = (topics[name].strip() for name in sorted(topics))
    return [text for text in texts if len(text) >= min_chars]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A mirror whose ``HuggingFaceTB/SmolLM2-135M`` is a tiny random LlamaForCausalLM."""
    folder = tmp_path / "mirror"
    save_tiny_llama(folder / INIT_REPO)
    monkeypatch.setenv(MIRROR_ENV, str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


# ----------------------------------------------------------------------------- the weights


def test_a_mixture_naming_no_domain_takes_each_domain_in_proportion_to_its_tokens(caplog):
    cfg = StageMixture(weights={}, num_tokens=8000, seq_len=64)
    with caplog.at_level(logging.INFO, logger="llmflow"):
        targets, notes = plan_mixture(cfg, {"web": 3000, "notes": 1000, "empty": 0})
    assert targets == {"web": 6000, "notes": 2000}  # 8000 x 3/4 and 8000 x 1/4
    assert notes == []
    lines = [r.getMessage() for r in caplog.records if "in proportion" in r.getMessage()]
    assert len(lines) == 1 and "notes 25.0%" in lines[0] and "web 75.0%" in lines[0]


def test_continue_pretrain_names_no_domain(mirror, tmp_path):
    config = load_config(CONFIG, [f"root={tmp_path / 'runs'}"])
    assert [s.mixture.weights for s in config.pretrain.stages] == [{}]
    assert config.extend.stages == []  # so extend.weights (the quickstart's) weigh nothing


# ----------------------------------------------------------------------------- before compute


def test_a_mixture_naming_domains_the_data_files_lack_fails_when_the_recipe_is_built(tmp_path):
    docs = [{"text": t} for t in _prose()[:5]]  # no `domain` field: ingest's default_domain
    plain = _write_jsonl(tmp_path / "plain.jsonl", docs)
    root = tmp_path / "runs"
    config = load_config(None, [f"root={root}"]).model_copy(update={"data": [str(plain)]})
    with pytest.raises(BadInputError) as err:
        recipe(config)
    message = str(err.value)
    assert "pretrain.stages.stage1" in message and "['code', 'math', 'prose']" in message
    assert "['web']" in message and str(plain) in message
    assert not root.exists()  # nothing ran, nothing was written
    # Phases the mixtures don't reach don't need the domains: curation alone runs.
    recipe(config.model_copy(update={"until": "curate"}))


def test_domains_come_from_records_file_names_and_the_default(tmp_path):
    texts = _prose()
    folder = tmp_path / "data"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", [{"text": texts[0], "domain": "prose"}, {"text": texts[1]}])
    _write_jsonl(folder / "maths-1.jsonl", [{"text": texts[2]}])
    (folder / "notes.txt").write_text(texts[3])
    ok = [
        "pretrain.stages=[{name: one, mixture: {weights: {prose: 1, math: 1, web: 1}, "
        "num_tokens: 1000, seq_len: 64}}]",
        "extend.stages=[]",
        "ingest.domain_map={maths: math}",
    ]
    config = load_config(None, [f"root={tmp_path / 'runs'}", *ok])
    recipe(config.model_copy(update={"data": [str(folder)]}))  # every named domain is there
    lacking = config.model_copy(update={"data": [str(folder / "a.jsonl")]})
    with pytest.raises(BadInputError, match=r"pretrain.stages.one weighs domain\(s\) \['math'\]"):
        recipe(lacking)


def test_preflight_names_a_weighed_domain_the_data_files_lack(tmp_path):
    from llmflow.tasks.preflight import Report
    from llmflow.tasks.preflight.checks import check_sources

    plain = _write_jsonl(tmp_path / "plain.jsonl", [{"text": t} for t in _prose()[:3]])
    config = load_config(None, [f"root={tmp_path}"]).model_copy(update={"data": [str(plain)]})
    report = Report("quickstart")
    check_sources(report, config, docs=1)
    rows = {c.check: c for c in report.checks}
    assert rows["data: local files"].go
    assert (
        not rows["data: domains"].go and "['code', 'math', 'prose']" in rows["data: domains"].detail
    )
    named = config.model_copy(update={"data": [str(plain)], "until": "curate"})
    report = Report("quickstart")
    check_sources(report, named, docs=1)
    assert report.go and "not checked" in report.checks[-1].detail


# ----------------------------------------------------------------------------- no traceback


def test_a_bad_input_inside_the_flow_prints_one_error_line_and_no_traceback(
    prefect_harness, tmp_path, capfd
):
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"body": "no text field"}] * 3)
    argv = ["run", "--root", str(tmp_path / "runs"), "--until", "ingest", "--data", str(bad)]
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("llmflow: error:")]
    assert errors == [f"llmflow: error: no usable documents in 1 source(s); see the reasons in "
                      f"{tmp_path / 'runs'}/ingest/" + errors[0].split("/ingest/", 1)[1]]  # fmt: skip


# ----------------------------------------------------------------------------- the command


@pytest.mark.slow
def test_continue_pretrain_on_documents_without_a_domain_exports_a_model_and_its_card(
    mirror, tmp_path
):
    data = _write_jsonl(tmp_path / "my_docs.jsonl", [{"text": t} for t in _prose()])
    root = tmp_path / "runs"
    env = {**os.environ, MIRROR_ENV: str(mirror), "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "llmflow.flows.cli", "run", str(CONFIG), "--data", str(data),
         "--root", str(root)],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=1200,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    said = [line for line in out.stderr.splitlines() if "in proportion to their tokens" in line]
    assert len(said) == 1 and "web 100.0%" in said[0], said
    (mixture_dir,) = (root / "mixture").glob("continue-pretrain-anneal-*")
    report = json.loads((mixture_dir / "meta.json").read_text())["mixture"]
    assert list(report) == ["web"] and report["web"]["share"] == 1.0
    (export_dir,) = (root / "export").glob("continue-pretrain-base-*")
    hf = export_dir / "hf"
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 64
    assert (export_dir / "_COMMITTED").exists()
    (card_dir,) = (root / "card").glob("continue-pretrain-base-*")
    assert (card_dir / "_COMMITTED").exists()
    assert INIT_REPO in (card_dir / "hf" / "README.md").read_text()
    print(f"llmflow run configs/continue-pretrain.yaml --data: {seconds:.0f} s")
