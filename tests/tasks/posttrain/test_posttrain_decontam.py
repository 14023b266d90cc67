"""Post-training data checked against the eval sets: the report, the records dropped in remove
mode (listed in the step's rejects with the item), the quickstart data clean by construction."""

from __future__ import annotations

import json

import pytest

from llmflow.tasks.decontam.config import DecontamConfig
from llmflow.tasks.decontam.posttrain import (
    EXAMPLES_FILE,
    REPORT_FILE,
    PostTrainDecontConfig,
    decontaminate_posttrain,
    excluded_records,
)
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import RawFiles
from llmflow.tasks.posttrain.formats import write_jsonl
from tests.needs import shared_path


def chat(user: str, assistant: str) -> dict:
    return {
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    }


@pytest.fixture
def checked(tmp_path):
    """An SFT file with one GSM8K and one PIQA item among clean records, checked (remove mode)."""
    eval_dir = shared_path("eval")
    gsm = [json.loads(x) for x in (eval_dir / "gsm8k_test.jsonl").read_text().splitlines()]
    piqa = [json.loads(x) for x in (eval_dir / "piqa_valid.jsonl").read_text().splitlines()]
    label = int((eval_dir / "piqa_valid_labels.lst").read_text().split()[7])
    records = [
        chat("Tell me about the weather today.", "It is sunny with a light breeze."),
        chat(gsm[5]["question"], gsm[5]["answer"]),
        {"text": "not a chat"},  # rejected by the SFT loader as it always was
        chat(piqa[7]["goal"], (piqa[7]["sol1"], piqa[7]["sol2"])[label]),
    ]
    data = tmp_path / "sft.jsonl"
    write_jsonl(data, records)
    files = [str(eval_dir / f) for f in
             ("gsm8k_test.jsonl", "piqa_valid.jsonl", "piqa_valid_labels.lst")]  # fmt: skip
    decont = DecontamConfig(tasks=["gsm8k_local", "piqa_local"], mode="remove")
    cfg = PostTrainDecontConfig(kind="sft", data=str(data), decontam=decont)
    out = tmp_path / "check"
    out.mkdir()
    decontaminate_posttrain(cfg, out, RawFiles([str(data)]), RawFiles(files))
    return data, out


def test_the_check_finds_the_eval_items_in_post_training_records(checked):
    _, out = checked
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["records"] == 4 and report["records_contaminated"] == 2
    assert report["tasks"]["gsm8k_local"]["contaminated_items"] == 1
    assert report["tasks"]["piqa_local"]["contaminated_items"] == 1
    assert report["tasks"]["gsm8k_local"]["share"] == pytest.approx(1 / 1319, abs=1e-6)
    examples = json.loads((out / EXAMPLES_FILE).read_text())["records"]
    assert examples == {"1": [["gsm8k_local", 5]], "3": [["piqa_local", 7]]}
    assert excluded_records(out) == {
        1: "contaminated: gsm8k_local#5",
        3: "contaminated: piqa_local#7",
    }


def test_sft_drops_the_contaminated_records_into_its_rejects(checked, tiny_model_output, tmp_path):
    from llmflow.tasks.posttrain.config import SFTStepConfig
    from llmflow.tasks.posttrain.sft import sft

    data, check = checked
    out = tmp_path / "sft"
    out.mkdir()
    cfg = SFTStepConfig(max_steps=1, num_heldout=0, max_length=64)
    # the one clean chat is too little to train on after the drops; what matters is the rejects
    try:
        sft(cfg, tiny_model_output, out, RawFiles([str(data)]), data_check=check)
    except BadInputError:
        pass
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert {(r["index"], r["reason"]) for r in rejects} >= {
        (1, "contaminated"),
        (3, "contaminated"),
    }
    assert [r["detail"] for r in rejects if r["index"] == 1] == ["contaminated: gsm8k_local#5"]


def test_flag_mode_keeps_every_record(checked):
    _, out = checked
    found = json.loads((out / EXAMPLES_FILE).read_text())
    (out / EXAMPLES_FILE).write_text(json.dumps({**found, "mode": "flag"}))
    assert excluded_records(out) == {}


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_the_generated_quickstart_data_is_checked_as_the_step_makes_it(tmp_path, kind):
    decont = DecontamConfig(tasks=["gsm8k_local"])
    cfg = PostTrainDecontConfig(
        kind=kind, num_quickstart_examples=30, num_heldout=4, decontam=decont
    )
    eval_dir = shared_path("eval")
    decontaminate_posttrain(cfg, tmp_path, None, RawFiles([str(eval_dir / "gsm8k_test.jsonl")]))
    report = json.loads((tmp_path / REPORT_FILE).read_text())
    assert report["records"] == 30 and report["records_contaminated"] == 0
    assert report["tasks"]["gsm8k_local"]["items"] == 1319


def test_the_card_gives_post_training_shares_beside_the_pretraining_ones(checked):
    from llmflow.tasks.evaluation.card import evaluation_section

    _, out = checked
    report = json.loads((out / REPORT_FILE).read_text())
    results = {
        "metrics": {"gsm8k_local": {"exact_match": 0.25}},
        "contamination": {"gsm8k_local": {"label": "0.0% (0/1319 items)"}},
    }
    section = evaluation_section(results, [report])
    row = next(line for line in section.splitlines() if line.startswith("| gsm8k_local"))
    assert "0.0% (0/1319 items)" in row and "0.1% (1/1319 items), removed" in row
    assert "in sft data" in section
