"""The card step links the model's files and replaces the ones it writes: a committed model
output (here one whose ``hf/`` carries its own README.md, as mergekit's output and most Hub
models do) never changes, and ``llmflow verify`` still finds it ok."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel

from llmflow.tasks.evaluation.card import CardConfig, model_card
from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.lineage import file_digest
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.framework.verify import verify_root

MODEL_README = "# merged\n\nThe model's own card, as mergekit writes it.\n"


class FolderFixture(BaseModel):
    readme: str = MODEL_README
    config_yaml: str = "name: theirs\n"


@step("fixture-model")
def fixture_model(cfg: FolderFixture, out: Path) -> Metrics:
    """A model output whose hf/ holds a README.md and an llmflow_config.yaml of its own."""
    (out / "hf").mkdir()
    (out / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out / "hf" / "model.safetensors").write_bytes(b"weights")
    (out / "hf" / "README.md").write_text(cfg.readme)
    (out / "hf" / "llmflow_config.yaml").write_text(cfg.config_yaml)
    return {}


@step("fixture-evaluation")
def fixture_evaluation(cfg: FolderFixture, out: Path) -> Metrics:
    (out / "results.json").write_text(json.dumps({"metrics": {"cf_arith": {"acc": 0.5}}}))
    return {}


def test_the_card_replaces_the_models_readme_and_leaves_the_model_output_unchanged(tmp_path):
    graph = Graph()
    model = graph.add(fixture_model, FolderFixture(), "merged")
    evaluation = graph.add(fixture_evaluation, FolderFixture(), "merged")
    cfg = CardConfig(model_name="merged", config_yaml="name: ours\n")
    card = graph.add(model_card, cfg, "merged", model=model, evaluation=evaluation)
    root = tmp_path / "runs"
    outcome = Executor(str(root)).run(graph)
    source, written = Path(outcome[model].uri) / "hf", Path(outcome[card].uri) / "hf"

    # the model output's files are the bytes it committed
    assert (source / "README.md").read_text() == MODEL_README
    assert (source / "llmflow_config.yaml").read_text() == "name: theirs\n"
    # the card's folder holds the card and our config, in files of its own
    assert (written / "README.md").read_text().startswith("---\n")
    assert "# merged" in (written / "README.md").read_text()
    assert (written / "llmflow_config.yaml").read_text() == "name: ours\n"
    for name in ("README.md", "llmflow_config.yaml"):
        assert os.stat(written / name).st_ino != os.stat(source / name).st_ino, name
    # files the card did not write are still links: no bytes copied
    for name in ("model.safetensors", "config.json"):
        assert os.stat(written / name).st_ino == os.stat(source / name).st_ino, name
    # the recorded checksums hold for every output, the model's included
    checks = verify_root(str(root))
    assert {c.status for c in checks} == {"ok"}, [c.problems for c in checks]
    assert len(checks) == 3
    recorded = json.loads((source.parent / "lineage.json").read_text())["files"]
    assert recorded["hf/README.md"]["sha256"] == file_digest(source / "README.md")


def test_a_second_card_run_in_the_same_working_folder_replaces_its_links(tmp_path):
    """A retried step finds its earlier files in its working folder: linking again replaces
    them (a README.md linked by the failed try is not written into either)."""
    model = tmp_path / "model"
    (model / "hf").mkdir(parents=True)
    (model / "hf" / "README.md").write_text(MODEL_README)
    (model / "hf" / "config.json").write_text("{}")
    evaluation = tmp_path / "evaluation"
    evaluation.mkdir()
    out = tmp_path / "card"
    (out / "hf").mkdir(parents=True)
    os.link(model / "hf" / "README.md", out / "hf" / "README.md")  # what the failed try left
    os.link(model / "hf" / "config.json", out / "hf" / "config.json")
    model_card(CardConfig(model_name="m"), model=model, evaluation=evaluation, out=out)
    assert (model / "hf" / "README.md").read_text() == MODEL_README
    assert "# m" in (out / "hf" / "README.md").read_text()
    assert (
        os.stat(out / "hf" / "config.json").st_ino == os.stat(model / "hf" / "config.json").st_ino
    )


def test_an_external_model_folder_with_a_readme_keeps_it_after_its_card(tiny_model, tmp_path):
    """A local model folder with the README.md most Hub models carry, through the real
    ``external-model`` step: its committed copy still verifies after the card."""
    import shutil

    from llmflow.tasks.evaluation.external import external_model, pin_model
    from llmflow.tasks.framework.graph import Raw

    folder = tmp_path / "theirs"
    shutil.copytree(tiny_model, folder)
    (folder / "README.md").write_text(MODEL_README)
    source, files = pin_model(str(folder))
    graph = Graph()
    model = graph.add(external_model, source, "theirs", files=Raw(files))
    evaluation = graph.add(fixture_evaluation, FolderFixture(), "theirs")
    card = graph.add(model_card, CardConfig(model_name="theirs"), "theirs", model=model,
                     evaluation=evaluation)  # fmt: skip
    root = tmp_path / "runs"
    outcome = Executor(str(root)).run(graph)
    assert (Path(outcome[model].uri) / "hf" / "README.md").read_text() == MODEL_README
    assert "theirs" in (Path(outcome[card].uri) / "hf" / "README.md").read_text()
    assert (folder / "README.md").read_text() == MODEL_README  # the user's own file too
    checks = verify_root(str(root))
    assert [c.status for c in checks] == ["ok"] * 3, [c.problems for c in checks]
