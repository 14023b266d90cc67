"""The decontaminate step on a small curated corpus: remove and flag, its reports, bad eval sets,
the lineage lookup the evaluate step uses, and its place in the recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from llmflow.tasks.curation.shards import ShardWriter
from llmflow.tasks.decontam.config import DecontamConfig, DecontamSettings, decontam_config
from llmflow.tasks.decontam.evalsets import EvalSetError, eval_items
from llmflow.tasks.decontam.lineage import mark_results, share_label, training_contamination
from llmflow.tasks.decontam.step import decontaminate, eval_set_files
from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import RawFiles

QUESTIONS = [
    (
        "A farmer has three fields of wheat and sells the harvest of each at the market in town.",
        "Each field gives forty bags, so three fields give one hundred and twenty bags in all.",
    ),
    (
        "Tom reads a book of two hundred pages over the week and reads the same number each day.",
        "He reads about twenty eight pages each day because the week has seven days in it.",
    ),
    ("Why?", "Because."),  # too short for 13-grams: counted, never indexed
]
CLEAN = "The river runs past the old mill where children play on summer evenings. " * 5


@pytest.fixture
def eval_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "eval"
    folder.mkdir()
    rows = [{"question": q, "answer": a} for q, a in QUESTIONS]
    (folder / "gsm8k_test.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A curated corpus: two domains; doc p1 copies item 0, c0 item 1 (edited), p0 is clean."""
    root = tmp_path / "curated"
    docs = {
        "prose": [("p0", CLEAN), ("p1", f"Intro.\n{QUESTIONS[0][0]} {QUESTIONS[0][1]}")],
        "code": [("c0", "# " + QUESTIONS[1][1].upper()), ("c1", "def f(x):\n    return x\n")],
    }
    for domain, rows in docs.items():
        (root / "shards" / domain).mkdir(parents=True)
        with ShardWriter(root / "shards" / domain / "part-00000.parquet") as writer:
            for doc_id, text in rows:
                writer.write({"id": doc_id, "text": text, "domain": domain, "source": "s"})
    (root / "curation_report.json").write_text("{}")
    return root


def run(cfg: DecontamConfig, corpus: Path, eval_dir: Path, out: Path) -> dict:
    out.mkdir()
    files = RawFiles(str(p) for p in sorted(eval_dir.iterdir()))
    return decontaminate(cfg, corpus=corpus, out=out, eval_files=files)


def ids(folder: Path) -> dict[str, list[str]]:
    return {
        p.relative_to(folder).as_posix(): pq.read_table(p).column("id").to_pylist()
        for p in sorted(folder.glob("shards/**/*.parquet"))
    }


def test_remove_mode_drops_contaminated_documents(corpus, eval_dir, tmp_path):
    cfg = DecontamConfig(tasks=["gsm8k_local", "cf_arith", "heldout_ppl"])
    metrics = run(cfg, corpus, eval_dir, tmp_path / "out")
    out = tmp_path / "out"
    assert ids(out) == {
        "shards/code/part-00000.parquet": ["c1"],
        "shards/prose/part-00000.parquet": ["p0"],
    }
    assert pq.read_schema(out / "shards/code/part-00000.parquet") == pq.read_schema(
        corpus / "shards/code/part-00000.parquet"
    )
    report = json.loads((out / "contamination.json").read_text())
    gsm8k = report["tasks"]["gsm8k_local"]
    assert (gsm8k["items"], gsm8k["indexed_items"], gsm8k["contaminated_items"]) == (3, 2, 2)
    assert gsm8k["share"] == pytest.approx(2 / 3)
    assert report["tasks"]["cf_arith"]["share"] is None  # no arithmetic item reaches 13 words
    assert "heldout_ppl" in report["skipped"]
    assert metrics["documents_removed"] == 2 and metrics["gsm8k_local/share"] == gsm8k["share"]
    matches = pq.read_table(out / "contamination.parquet").to_pylist()
    assert {(m["doc_id"], m["task"], m["item"], m["action"]) for m in matches} == {
        ("p1", "gsm8k_local", 0, "removed"),
        ("c0", "gsm8k_local", 1, "removed"),
    }
    assert all(len(m["ngram"].split()) == 13 for m in matches)
    assert (out / "curation_report.json").exists()


def test_flag_mode_keeps_the_corpus_byte_identical(corpus, eval_dir, tmp_path):
    cfg = DecontamConfig(tasks=["gsm8k_local"], mode="flag")
    metrics = run(cfg, corpus, eval_dir, tmp_path / "out")
    for path in corpus.glob("shards/**/*.parquet"):
        copy = tmp_path / "out" / path.relative_to(corpus)
        assert copy.read_bytes() == path.read_bytes()
    assert metrics["documents_contaminated"] == 2 and metrics["documents_removed"] == 0


def test_an_unreadable_eval_set_fails_naming_it(corpus, eval_dir, tmp_path):
    (eval_dir / "gsm8k_test.jsonl").write_text('{"question": "q", "answer": "a"}\nnot json\n')
    with pytest.raises(EvalSetError, match="gsm8k_local"):
        run(DecontamConfig(tasks=["gsm8k_local"]), corpus, eval_dir, tmp_path / "out")
    with pytest.raises(EvalSetError, match="piqa_local.*piqa_valid.jsonl"):
        eval_items(DecontamConfig(tasks=["piqa_local"]), [])


@pytest.mark.slow  # lm-eval indexes its ~15k task YAMLs to know a name is not one of them
def test_an_unknown_task_fails_naming_it():
    with pytest.raises(EvalSetError, match="no_such_task_xyz"):
        eval_items(DecontamConfig(tasks=["no_such_task_xyz"]), [])


def test_recipe_checks_the_eval_files_before_any_compute(tmp_path):
    cfg = DecontamConfig(tasks=["wikitext2_local"])
    with pytest.raises(BadInputError, match="wikitext2_local.*data_root is not set"):
        eval_set_files(cfg, None)
    with pytest.raises(BadInputError, match="wikitext2_test.txt does not exist"):
        eval_set_files(cfg, str(tmp_path))


def test_step_config_takes_only_what_decides_the_eval_sets():
    a = decontam_config(DecontamSettings(n=8), EvalConfig(tasks=["cf_arith"], dtype="bfloat16"))
    b = decontam_config(DecontamSettings(n=8), EvalConfig(tasks=["cf_arith"], limit=3))
    assert a == b and a.n == 8


def test_custom_lm_eval_task_by_path(tmp_path):
    data = tmp_path / "qa.jsonl"
    rows = [{"q": QUESTIONS[0][0], "a": QUESTIONS[0][1]}, {"q": "Hi?", "a": "Yes."}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "task.yaml").write_text(
        "task: my_qa\ndataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{test: {data}}}}}\n"
        "test_split: test\noutput_type: generate_until\n"
        "doc_to_text: 'Q: {{q}}'\ndoc_to_target: '{{a}}'\n"
        "metric_list: [{metric: exact_match}]\n"
    )
    cfg = DecontamConfig(tasks=["cf_arith"], custom_tasks=[str(tmp_path / "task.yaml")])
    items, _ = eval_items(cfg, [])
    # the template's own text ("Q: ") is not what a web page holding the item contains
    assert [(i.query, i.golds) for i in items["my_qa"]] == [
        (QUESTIONS[0][0], (QUESTIONS[0][1],)),
        ("Hi?", ("Yes.",)),
    ]


def write_output(root: Path, step: str, inputs: list[Path], files: dict | None = None) -> Path:
    out = root / step
    out.mkdir(parents=True)
    record = {"step": step, "inputs": [{"name": "x", "uri": str(p)} for p in inputs]}
    (out / "lineage.json").write_text(json.dumps(record))
    for name, content in (files or {}).items():
        (out / name).write_text(json.dumps(content))
    return out


def test_training_contamination_walks_the_model_lineage(tmp_path):
    report = {"n": 13, "tasks": {"gsm8k_local": {"share": 0.5, "contaminated_items": 1}}}
    decont = write_output(tmp_path, "decontaminate", [], {"contamination.json": report})
    tokenized = write_output(tmp_path, "tokenize", [decont])
    checkpoint = write_output(tmp_path, "pretrain", [tokenized])
    model = write_output(tmp_path, "export", [checkpoint, tokenized])
    found = training_contamination(model)
    assert found["tasks"] == report["tasks"] and found["uri"] == str(decont)
    assert training_contamination(write_output(tmp_path, "foreign", [])) is None


def test_share_label():
    counts = {"share": 0.025, "contaminated_items": 3, "items": 120}
    assert share_label(counts) == "2.5% (3/120 items)"
    assert share_label({"share": None}, 13) == "not measurable (no item reaches 13 words)"
    assert share_label(None) == "not checked"


@pytest.mark.slow  # imports the whole recipe (torch, transformers, lm-eval, TRL): ~20-60 s
def test_the_tokenizer_and_tokenize_read_the_decontaminated_corpus():
    from llmflow.flows.recipe import recipe
    from llmflow.tasks.config import load_config

    graph = recipe(load_config(None))
    (node,) = graph.find(step="decontaminate")
    assert node.inputs["corpus"] is graph.find(step="curate")[0]
    assert graph.find(step="tokenizer")[0].inputs["corpus"] is node
    assert graph.find(step="tokenize")[0].inputs["corpus"] is node
    assert [n.step.name for n in graph.until("decontaminate").nodes][-1] == "decontaminate"


def test_results_are_marked_with_the_training_corpus_contamination(tmp_path):
    report = {
        "n": 13,
        "tasks": {
            "gsm8k_local": {"share": 0.25, "contaminated_items": 1, "items": 4},
            "cf_arith": {"share": None, "contaminated_items": 0, "items": 4},
        },
        "skipped": {"heldout_ppl": "held out"},
    }
    decont = write_output(tmp_path, "decontaminate", [], {"contamination.json": report})
    model = write_output(tmp_path, "export", [write_output(tmp_path, "pretrain", [decont])])
    metrics = {t: {"acc": 0.5} for t in ("gsm8k_local", "cf_arith", "ppl_prose", "other")}
    marked = mark_results({"metrics": metrics}, model)
    labels = {task: mark["label"] for task, mark in marked["contamination"].items()}
    assert labels == {
        "gsm8k_local": "25.0% (1/4 items)",
        "cf_arith": "not measurable (no item reaches 13 words)",
        "ppl_prose": "held out (split after decontamination)",
        "other": "not checked",
    }
    assert marked["contamination"]["gsm8k_local"]["share"] == 0.25
    assert marked["contamination_source"] == str(decont)


def test_remove_mode_marks_removed_items_as_unseen(tmp_path):
    report = {
        "n": 8,
        "mode": "remove",
        "tasks": {"gsm8k_local": {"share": 0.25, "contaminated_items": 1, "items": 4}},
    }
    decont = write_output(tmp_path, "decontaminate", [], {"contamination.json": report})
    model = write_output(tmp_path, "export", [write_output(tmp_path, "pretrain", [decont])])
    marked = mark_results({"metrics": {"gsm8k_local": {"acc": 0.5}}}, model)
    mark = marked["contamination"]["gsm8k_local"]
    assert mark["share"] == 0.0 and mark["matched_share"] == 0.25
    assert mark["label"] == "0% (removed before training: 25.0% (1/4 items) matched)"
    assert marked["contamination_method"] == {"n": 8, "mode": "remove"}


def test_the_card_names_the_configured_n_and_the_model_size():
    from llmflow.tasks.evaluation.card import CardConfig, evaluation_section, limitations_section

    results = {
        "metrics": {"t": {"acc": 0.5}},
        "contamination": {"t": {"label": "0%"}},
        "contamination_method": {"n": 8, "mode": "remove"},
    }
    text = evaluation_section(results)
    assert "8-grams" in text and "13-grams" not in text and "removed before training" in text
    facts = {"parameters": 3_075_000_000, "stages": [{"tokens": 11_000_000_000}]}
    limits = limitations_section(CardConfig(model_name="m"), facts)
    assert "3,075.0M parameters" in limits and "11,000,000,000 pretraining tokens" in limits
    assert "small" not in limits
