import json

import yaml

from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.suite import build_suite, heldout_documents, read_manifest
from llmflow.tasks.evaluation.synthetic import arithmetic_items, fact_items


def test_synthetic_items_are_deterministic_and_consistent():
    assert arithmetic_items(20, seed=1) == arithmetic_items(20, seed=1)
    assert arithmetic_items(20, seed=1) != arithmetic_items(20, seed=2)
    for item in arithmetic_items(200, seed=0) + fact_items(200, seed=0):
        assert len(set(item["choices"])) == 4
        assert item["choices"][item["label"]] == item["answer"]
    for item in arithmetic_items(200, seed=0):
        a, op, b = item["question"].removeprefix("What is ").removesuffix("?").split()
        assert int(item["answer"]) == eval(f"{int(a)} {op} {int(b)}")


def test_build_suite_writes_absolute_data_files_and_stable_key(tmp_path, heldout_dir):
    cfg = EvalConfig(num_items=10)
    suite = build_suite(cfg, heldout_dir, tmp_path / "a")
    manifest = read_manifest(suite)
    assert {"ppl_prose", "ppl_code", "cf_arith", "mcf_arith", "gen_facts"} <= set(manifest["tasks"])
    task = yaml.safe_load((suite / "ppl_code.yaml").read_text())
    (data_file,) = task["dataset_kwargs"]["data_files"].values()
    assert data_file.startswith("/") and data_file.endswith("ppl_code.jsonl")
    assert task["tag"] == ["heldout_ppl"]
    again = read_manifest(build_suite(cfg, heldout_dir, tmp_path / "b"))
    assert again["suite_key"] == manifest["suite_key"]
    other = read_manifest(build_suite(EvalConfig(num_items=11), heldout_dir, tmp_path / "c"))
    assert other["suite_key"] != manifest["suite_key"]
    assert len((suite / "data" / "arith.jsonl").read_text().splitlines()) == 10


def test_heldout_documents_per_domain_cut_and_limited(heldout_dir):
    docs = heldout_documents(heldout_dir, num_docs=2, max_chars=30)
    assert sorted(docs) == ["code", "prose"]
    assert all(len(d) == 2 for d in docs.values())
    assert all(len(doc["text"]) <= 30 for d in docs.values() for doc in d)


def test_real_sets_converted(tmp_path, shared_eval_dir):
    eval_dir = shared_eval_dir
    suite = build_suite(EvalConfig(data_root=str(eval_dir), num_items=5), None, tmp_path)
    assert {"piqa_local", "wikitext2_local", "gsm8k_local"} <= set(read_manifest(suite)["tasks"])
    piqa = [json.loads(x) for x in (suite / "data" / "piqa_local.jsonl").read_text().splitlines()]
    labels = (eval_dir / "piqa_valid_labels.lst").read_text().split()
    assert len(piqa) == len(labels) == 1838
    assert [str(p["label"]) for p in piqa] == labels
    pages = (suite / "data" / "wikitext2_local.jsonl").read_text().splitlines()
    assert len(pages) == 62
    assert json.loads(pages[0])["page"].startswith(" = Robert <unk> = \n")
