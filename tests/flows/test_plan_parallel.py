"""``llmflow plan``: each stage's parallel layout, ``--parallel`` fixing degrees."""

from pathlib import Path

from llmflow.flows.cli import main

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "smollm3-3b.yaml")


def _stage_lines(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("parallel layout per stage"))
    stages: dict[str, list[str]] = {}
    for line in lines[start + 1 :]:
        if not line.startswith(" "):
            stages[line.split(" ctx ")[0].strip()] = [line]
        else:
            stages[list(stages)[-1]].append(line)
    return stages


def test_plan_prints_every_stage_layout_and_the_recipe_fits(capsys):
    assert main(["plan", CONFIG]) == 0
    out = capsys.readouterr().out
    stages = _stage_lines(out)
    assert list(stages) == ["stage1", "stage2", "stage3", "extension 1", "extension 2"]
    for layout, memory, traffic in stages.values():
        assert "tp=" in layout and "cp=" in layout and "dp_shard=" in layout
        assert memory.strip().startswith("memory per GPU") and memory.endswith("fits")
        assert "NOT" not in memory
        assert "bubble" in traffic and "TP" in traffic and "CP" in traffic
    assert "(set)" in stages["extension 1"][0] and "cp=4" in stages["extension 1"][0]
    assert "tp=1 cp=8" in stages["extension 2"][0] and "= 288 sequences" in stages["extension 2"][0]
    assert "does NOT fit" not in out


def test_parallel_override_is_applied_to_every_stage(capsys):
    assert main(["plan", CONFIG, "--parallel", "tp=2,cp=2,pp=1"]) == 0
    stages = _stage_lines(capsys.readouterr().out)
    for layout, *_ in stages.values():
        assert "tp=2 cp=2 pp=1 dp_shard=72" in layout and "(set)" in layout
    assert "= 576 sequences" in stages["stage1"][0]  # the global batch is kept


def test_bad_parallel_override_names_the_field(capsys):
    assert main(["plan", CONFIG, "--parallel", "tp=3"]) == 2
    assert "pretrain.train.parallel.tp=3 does not divide" in capsys.readouterr().err
    assert main(["plan", CONFIG, "--parallel", "cp=4,tq=1"]) == 2
    assert "pretrain.train.parallel.tq is not a field" in capsys.readouterr().err
    bad_recipe = ["--set", "pretrain.train.parallel.tp=5"]
    assert main(["plan", CONFIG, *bad_recipe]) == 2
    assert "pretrain.train.parallel" in capsys.readouterr().err
