"""lm-eval on a tiny local Llama: numbers checked against a hand computation with transformers."""

import json
import math
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.harness import EvalTaskError, ModelLoadError, evaluate_hf, table_rows
from llmflow.tasks.evaluation.suite import build_suite
from llmflow.tasks.evaluation.synthetic import arithmetic_items

DOC = "The quick brown fox jumps over the lazy dog.\nWhat is 3 + 4? The answer is 7.\n"


def _loaded(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


def test_perplexity_matches_hand_computation(tmp_path, tiny_model):
    heldout = tmp_path / "heldout"
    heldout.mkdir()
    rows = [{"id": "d0", "text": DOC, "domain": "Prose", "source": "t"}]
    pq.write_table(pa.Table.from_pylist(rows), heldout / "part.parquet")
    out = tmp_path / "out"
    out.mkdir()
    cfg = EvalConfig(tasks=["ppl_prose"], batch_size=1, device="cpu", log_samples=True)
    metrics = evaluate_hf(cfg, tiny_model, out, heldout_dir=heldout)

    tok, model = _loaded(tiny_model)
    ids = tok.encode(DOC, add_special_tokens=False)
    inputs = torch.tensor([[tok.bos_token_id] + ids[:-1]])  # lm-eval's prefix token is BOS
    with torch.no_grad():
        logprobs = torch.log_softmax(model(inputs).logits[0].double(), dim=-1)
    loglik = logprobs[torch.arange(len(ids)), torch.tensor(ids)].sum().item()
    num_words, num_bytes = len(DOC.split(" ")) + DOC.count("\n"), len(DOC.encode())
    assert num_words == len(__import__("re").split(r"\s+", DOC))
    assert metrics["ppl_prose/word_perplexity"] == pytest.approx(
        math.exp(-loglik / num_words), rel=1e-4
    )
    assert metrics["ppl_prose/bits_per_byte"] == pytest.approx(
        -loglik / num_bytes / math.log(2), rel=1e-4
    )
    results = json.loads((out / "results.json").read_text())
    assert results["num_requests"] == 1 and results["requests_per_second"] > 0
    assert results["versions"]["ppl_prose"] == 1.0
    assert results["model_dir"] == str(tiny_model)
    assert (out / "samples_ppl_prose.jsonl").exists()
    assert {r["metric"] for r in table_rows(results)} == {
        "word_perplexity", "byte_perplexity", "bits_per_byte"
    }  # fmt: skip


def _greedy_answer(tok, model, prompt: str, max_new_tokens: int) -> str:
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
        )
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    for stop in ("\n", "Question:"):
        text = text.split(stop)[0]
    return text


def test_exact_match_on_crafted_items(tmp_path, tiny_model):
    cfg = EvalConfig(tasks=["gen_arith"], batch_size=1, device="cpu", max_gen_toks=4)
    suite = build_suite(cfg, None, tmp_path / "suite")
    tok, model = _loaded(tiny_model)
    question = "What is 1 + 1?"
    answer = _greedy_answer(tok, model, f"Question: {question}\nAnswer:", cfg.max_gen_toks)
    items = [
        {"question": question, "answer": "  " + answer.strip().upper() + " ", "choices": [],
         "label": 0},  # exact match ignores case and surrounding whitespace
        {"question": question, "answer": answer.strip() + "x", "choices": [], "label": 0},
    ]  # fmt: skip
    (suite / "data" / "arith.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    out = tmp_path / "out"
    out.mkdir()
    metrics = evaluate_hf(cfg, tiny_model, out, suite_dir=suite)
    assert metrics["gen_arith/exact_match"] == pytest.approx(0.5)


def _choice_logliks(tok, model, context: str, choices: list[str]) -> list[float]:
    """log P(" " + choice | context) by hand, split into tokens the way lm-eval's hf model does."""
    context_ids = tok.encode(context, add_special_tokens=False)
    logliks = []
    for choice in choices:
        whole = tok.encode(context + " " + choice, add_special_tokens=False)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([whole[:-1]])).logits[0].double(), -1)
        positions = range(len(context_ids), len(whole))
        logliks.append(sum(logprobs[t - 1, whole[t]].item() for t in positions))
    return logliks


def _mc_request(task: str, item: dict) -> tuple[str, list[str]]:
    """The context and the scored choices of one item, as the suite's task YAML words them."""
    if task.startswith("cf_"):
        return f"Question: {item['question']}\nAnswer:", item["choices"]
    options = "".join(f"\n{letter}. {c}" for letter, c in zip("ABCD", item["choices"], strict=True))
    return f"Question: {item['question']}{options}\nAnswer:", ["A", "B", "C", "D"]


@pytest.mark.parametrize("task", ["cf_arith", "mcf_arith"])
def test_choice_accuracy_matches_hand_computation(tmp_path, tiny_model, task):
    """Labels set so the model's own best choice is right on items 0 and 3 only: acc = 2/6.

    A wrong label mapping, option order or prompt in the suite's YAML changes the score.
    """
    cfg = EvalConfig(tasks=[task], batch_size=1, device="cpu", log_samples=True)
    suite = build_suite(cfg, None, tmp_path / "suite")
    tok, model = _loaded(tiny_model)
    items, expected = arithmetic_items(6, seed=5), {}
    for i, item in enumerate(items):
        context, choices = _mc_request(task, item)
        logliks = _choice_logliks(tok, model, context, choices)
        best = max(range(4), key=lambda k: logliks[k])
        item["label"] = best if i % 3 == 0 else (best + i % 3) % 4
        item["answer"] = item["choices"][item["label"]]
        expected[item["question"]] = logliks
        norm = [ll / len(c) for ll, c in zip(logliks, choices, strict=True)]
        expected[item["question"], "norm"] = max(range(4), key=lambda k: norm[k]) == item["label"]
    (suite / "data" / "arith.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    out = tmp_path / "out"
    out.mkdir()
    metrics = evaluate_hf(cfg, tiny_model, out, suite_dir=suite)

    assert metrics[f"{task}/acc"] == pytest.approx(2 / 6)
    if task.startswith("cf_"):
        norm_hits = [expected[i["question"], "norm"] for i in items]
        assert metrics[f"{task}/acc_norm"] == pytest.approx(sum(norm_hits) / 6)
    samples = [json.loads(x) for x in (out / f"samples_{task}.jsonl").read_text().splitlines()]
    assert len(samples) == 6
    for sample in samples:
        got = [ll for ll, _ in sample["filtered_resps"]]
        assert got == pytest.approx(expected[sample["doc"]["question"]], rel=1e-4)


def test_bundled_suite_runs_fast_on_tiny_model(tmp_path, tiny_model, heldout_dir):
    cfg = EvalConfig(
        tasks=["heldout_ppl", "cf_arith", "mcf_arith", "gen_arith", "cf_facts", "mcf_facts"],
        limit=8,
        device="cpu",
    )
    out = tmp_path / "out"
    out.mkdir()
    metrics = evaluate_hf(cfg, tiny_model, out, heldout_dir=heldout_dir)
    for key in ["ppl_code/bits_per_byte", "ppl_prose/word_perplexity", "cf_arith/acc",
                "cf_arith/acc_norm", "mcf_arith/acc", "gen_arith/exact_match", "mcf_facts/acc"]:  # fmt: skip
        assert key in metrics
    assert 0.0 <= metrics["mcf_arith/acc"] <= 1.0
    # 3 + 3 rolling docs, 8 items x 4 choices x 4 MC tasks, 8 generations
    assert metrics["num_requests"] == 6 + 8 * 4 * 4 + 8


def test_unknown_task_or_absent_data_named(tmp_path, tiny_model):
    cfg = EvalConfig(tasks=["cf_arith", "no_such_task_xyz"], limit=2, device="cpu")
    suite = build_suite(cfg, None, tmp_path / "suite")
    with pytest.raises(EvalTaskError, match="no_such_task_xyz"):
        evaluate_hf(cfg, tiny_model, tmp_path, suite_dir=suite)
    # lm-eval's own piqa needs the Hub, which is offline here
    cfg = EvalConfig(tasks=["cf_arith", "piqa"], limit=2, device="cpu")
    with pytest.raises(EvalTaskError, match="'piqa': cannot load its data"):
        evaluate_hf(cfg, tiny_model, tmp_path, suite_dir=suite)


def test_bundled_task_without_its_data_named(tmp_path, tiny_model):
    with pytest.raises(EvalTaskError, match="ppl_prose.*heldout_dir is None"):
        evaluate_hf(EvalConfig(tasks=["ppl_prose"]), tiny_model, tmp_path)
    with pytest.raises(EvalTaskError, match="piqa_local.*data_root"):
        evaluate_hf(EvalConfig(tasks=["piqa_local"]), tiny_model, tmp_path)


def test_truncated_weights_named(tmp_path, tiny_model):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=str(broken)):
        evaluate_hf(EvalConfig(tasks=["cf_arith"], limit=2, device="cpu"), broken, tmp_path)


@pytest.mark.slow
def test_real_sets_evaluate(tmp_path, tiny_model, shared_eval_dir):
    cfg = EvalConfig(
        tasks=["piqa_local", "wikitext2_local", "gsm8k_local"],
        data_root=str(shared_eval_dir),
        limit=2,
        device="cpu",
    )
    out = tmp_path / "out"
    out.mkdir()
    metrics = evaluate_hf(cfg, tiny_model, out)
    assert 0.0 <= metrics["piqa_local/acc"] <= 1.0
    assert metrics["wikitext2_local/word_perplexity"] > 1.0
    assert metrics["gsm8k_local/exact_match:strict-match"] == 0.0
