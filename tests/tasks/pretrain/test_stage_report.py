"""The stage report: plots from a real run's rows, and its Prefect artifact."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import make_packed, read_jsonl, run_trainer, tiny_config
from pydantic import BaseModel

from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.pretrain import stage_report
from llmflow.tasks.pretrain.alerts import record_alert

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A real run of 8 steps (held-out loss at 4 and 8) with one alert."""
    base = tmp_path_factory.mktemp("report")
    data = make_packed(base / "train", num_docs=300, seed=0)
    val = make_packed(base / "val", num_docs=60, seed=1)
    out = base / "run"
    cfg = tiny_config(max_steps=8, eval_interval=4, checkpoint={"interval": 4, "keep_last": 1})
    run_trainer(cfg, data, out, val_dir=val)
    record_alert(out, "spike", 7, "s1", "loss 9.1 is 12 sigma above", cause="layers.1")
    return out


def _image(png: bytes):
    from matplotlib.image import imread

    assert png.startswith(PNG)
    return imread(io.BytesIO(png), format="png")


def test_plots_from_real_rows_and_the_fields_other_components_add(run, tmp_path):
    # the trainer's own fields alone (the health metrics may be off): loss and throughput
    added = ("time_", "data_share", "grad_norm_by_layer", "update_ratio_by_layer")
    rows = [
        {k: v for k, v in row.items() if not k.startswith(added)}
        for row in read_jsonl(run / "metrics.jsonl")
    ]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plots = stage_report.stage_plots(bare)
    assert plots["layers"] is None and plots["evaluations"] is None
    for name in ("loss", "throughput"):
        height, width, _ = _image(plots[name]).shape
        assert width > 600 and height > 200

    # the same real rows with what the health metrics add: the time split, 20 layers' norms
    layers = ["embed", *(f"layers.{i}" for i in range(20)), "lm_head"]
    folder = tmp_path / "stage"
    shutil.copytree(run, folder)
    with open(folder / "metrics.jsonl", "w") as f:
        for row in rows:
            norms = {name: 0.1 * (i + 1) * row["grad_norm"] for i, name in enumerate(layers)}
            split = {"time_data_s": 0.01, "time_compute_s": 0.05, "time_optimizer_s": 0.01}
            f.write(json.dumps({**row, **split, "data_share": 0.14, "grad_norm_by_layer": norms}))
            f.write("\n")
    # the running evaluation's score files: the run's checkpoints and the reference's
    scores = [
        {"tokens_seen": t, "step": t // 128, "metrics": {"heldout_loss": 5 - t / 1000}}
        for t in (512, 1024)
    ] + [
        {"tokens_seen": t, "source": "reference", "metrics": {"heldout_loss": 5 - t / 900}}
        for t in (256, 768, 1280)
    ]
    (folder / stage_report.EVALUATIONS).write_text("".join(json.dumps(s) + "\n" for s in scores))

    written = stage_report.write_plots(folder, tmp_path / "png")
    assert [p.name for p in written] == [
        "loss.png",
        "throughput.png",
        "layers.png",
        "evaluations.png",
    ]
    # a second panel under tokens/s: where the step time goes
    assert _image(written[1].read_bytes()).shape[0] > _image(plots["throughput"]).shape[0]
    points = stage_report.evaluation_points(scores)
    assert [(p["tokens"], p["source"]) for p in points] == [
        (512, "run"),
        (1024, "run"),
        (256, "reference"),
        (768, "reference"),
        (1280, "reference"),
    ]
    assert (
        stage_report._by_layer(read_jsonl(folder / "metrics.jsonl"), "grad_norm_by_layer")[1]
        == layers
    )  # embed, blocks by index (10 after 9), lm_head


def test_markdown_holds_the_last_numbers_the_alerts_and_the_pngs(run):
    rows = read_jsonl(run / "metrics.jsonl")
    last = rows[-1]
    text = stage_report.stage_markdown(run, "s1")

    assert text.startswith("# Stage s1\n\nfinished, as of step 8")
    assert f"| 8 | {last['loss']:.4g} | {last['val_loss']:.4g} |" in text
    assert "| 7 | spike | layers.1 | loss 9.1 is 12 sigma above |" in text
    images = re.findall(r"!\[(\w+)\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", text)
    assert [name for name, _ in images] == ["loss", "throughput"]
    assert all(base64.b64decode(data).startswith(PNG) for _, data in images)
    assert "_no per-layer gradient norms logged" in text


class ReportSpec(BaseModel):
    source: str


@step("test-stage-report")
def reported_stage(cfg: ReportSpec, out: Path) -> Metrics:
    """What the pretrain step does around its trainer: the live report, then the final one."""
    shutil.copytree(cfg.source, out, dirs_exist_ok=True)
    label = out.name.rpartition("-")[0]
    follow = stage_report.LiveReport(out, label).follow(lambda _line: None)
    follow("step 8 loss 4.5")  # a metric line: published at once, then at most every 300 s
    follow("step 9 loss 4.4")
    stage_report.publish_stage_report(out, label)
    return {}


def test_the_artifact_is_published_live_and_with_the_output(run, tmp_path, prefect_harness):
    from prefect import flow
    from prefect.artifacts import Artifact
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from llmflow.tasks.framework.prefect_task import step_task

    task = step_task(reported_stage)

    @flow
    def stage_flow() -> None:
        task(ReportSpec(source=str(run)), root=str(tmp_path / "root"), name="quick_stage1")

    stage_flow()
    key = stage_report.artifact_key("quick_stage1")
    assert key == "stage-quick-stage1"
    artifact = Artifact.get(key)
    assert artifact is not None and artifact.type == "markdown"
    assert artifact.description == stage_report.describe("quick_stage1")
    assert (
        artifact.data.startswith("# Stage quick_stage1")
        and "data:image/png;base64," in artifact.data
    )
    with get_client(sync_client=True) as client:
        versions = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )
    assert len(versions) == 2  # once live, at the first metric line; once with the output


def test_the_running_evaluations_score_files_are_plotted_with_the_reference(tmp_path):
    """The evaluation flow's default results folder (<root>/running-evaluation) is where the
    stage's report finds its scores and the reference's."""
    from llmflow.tasks.pretrain.stage_report import evaluation_points, running_evaluation_rows

    stage = tmp_path / "pretrain" / ".partial" / "quickstart-stage1-0123abcd"
    stage.mkdir(parents=True)
    results = tmp_path / "running-evaluation"
    for label, at, loss in (
        (stage.name, 4, 3.9), (stage.name, 8, 3.5), ("reference-ref-stage1", 4, 3.0),
    ):  # fmt: skip
        (results / label).mkdir(parents=True, exist_ok=True)
        row = {"step": at, "tokens_seen": at * 1000, "metrics": {"heldout_loss": loss}}
        (results / label / f"step-{at:06d}-k.json").write_text(json.dumps(row))
    points = evaluation_points(running_evaluation_rows(stage))
    assert sorted((p["source"], p["tokens"], p["value"]) for p in points) == [
        ("reference", 4000, 3.0), ("run", 4000, 3.9), ("run", 8000, 3.5),
    ]  # fmt: skip
    assert stage_report.stage_plots(stage)["evaluations"] is not None
    assert running_evaluation_rows(tmp_path / "b" / "x" / "y" / "s") == []  # none 3 up
