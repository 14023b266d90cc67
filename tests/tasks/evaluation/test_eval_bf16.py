"""lm-eval (``evaluate.dtype=bfloat16``) and the safety step's classifier in bf16 on CPU: each
runs in bf16 and gives numbers close to float32.

Tolerances (``u = 2**-8``, bf16's unit roundoff).

lm-eval: the model computes its logits in bf16; their log-softmax and the sum over a
continuation's tokens are float32 (``harness.load_model`` passes ``softmax_dtype``). A token's
log-prob ``z_y - logsumexp(z)`` then moves by at most ``2 max|dz|``; the two-layer model's
logits are small (``|z| < 1``) and carry a few ``u`` of relative error, while a log-prob is about
``-ln(vocab) ~ -6``, so a loglikelihood is within ``u/2`` relative of float32 (measured: 0.05 u;
bits per byte within 1e-6 relative). Before, lm-eval took the log-softmax in bf16 and summed
there: each log-prob rounded to 8 bits (``u/2`` relative alone) and the sums lost more with each
token: measured 1.56 u relative, and bits per byte 0.16% off.

The classifier: ``p = softmax(z)[toxic]`` of a two-class head moves by
``p(1-p) |d(z1 - z0)| <= max|dz| / 2``; each logit of a one-layer encoder passes about 16 bf16
roundings, ``8 u max|z|`` in the worst case, so ``|p_bf16 - p_fp32| <= 4 u max|z|`` (measured:
at most 1.4 u with ``max|z|`` about 1.2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.harness import evaluate_hf, load_model

U = 2.0**-8
DOC = "The quick brown fox jumps over the lazy dog.\nWhat is 3 + 4? The answer is 7.\n"


def _samples(out: Path, task: str) -> list[float]:
    rows = [json.loads(x) for x in (out / f"samples_{task}.jsonl").read_text().splitlines()]
    rows.sort(key=lambda r: r["doc_id"])
    flat = []
    for row in rows:
        for resp in row["filtered_resps"]:
            flat.append(float(resp[0] if isinstance(resp, list) else resp))
    return flat


def test_lm_eval_runs_in_bf16_close_to_float32(tmp_path, tiny_model):
    heldout = tmp_path / "heldout"
    heldout.mkdir()
    rows = [{"id": "d0", "text": DOC, "domain": "Prose", "source": "t"}]
    pq.write_table(pa.Table.from_pylist(rows), heldout / "part.parquet")
    metrics, logliks = {}, {}
    for dtype in ("float32", "bfloat16"):
        cfg = EvalConfig(tasks=["ppl_prose", "cf_arith"], limit=8, batch_size=1, device="cpu",
                         log_samples=True, dtype=dtype)  # fmt: skip
        assert load_model(cfg, tiny_model).model.dtype == getattr(torch, dtype)
        out = tmp_path / dtype
        out.mkdir()
        metrics[dtype] = evaluate_hf(cfg, tiny_model, out, heldout_dir=heldout)
        logliks[dtype] = _samples(out, "cf_arith") + _samples(out, "ppl_prose")
        assert json.loads((out / "results.json").read_text())["config"]["dtype"] == dtype
    fp32, bf16 = torch.tensor(logliks["float32"]), torch.tensor(logliks["bfloat16"])
    assert len(fp32) == 8 * 4 + 1  # 8 items x 4 choices, 1 rolling document
    relative = ((bf16 - fp32).abs() / fp32.abs()).max().item()
    print(f"lm-eval bf16 vs fp32: loglikelihoods within {relative / U:.3f} u relative; "
          f"{metrics['float32']} vs {metrics['bfloat16']}")  # fmt: skip
    assert 0 < relative <= U / 2  # bf16 did run, and within the bound (before: 1.56 u)
    bpb = [metrics[d]["ppl_prose/bits_per_byte"] for d in ("float32", "bfloat16")]
    assert bpb[1] == pytest.approx(bpb[0], rel=U / 2)  # before: 2.67929 vs 2.67492
    # a choice flips only where float32's own margin is inside the tolerance
    choices = fp32[:32].view(8, 4), bf16[:32].view(8, 4)
    top2 = choices[0].topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > U * top2[:, 0].abs()
    assert torch.equal(choices[0].argmax(1)[clear], choices[1].argmax(1)[clear])


def _logit_scale(scorer, texts: list[str]) -> float:
    """The largest |logit| the float32 classifier gives on ``texts``."""
    batch = scorer.tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return scorer.model(**batch).logits.abs().max().item()


def test_the_safety_classifier_in_bf16_scores_close_to_float32(tmp_path):
    from llmflow.tasks.safety.hf_classifier import TransformersScorer
    from tests.tasks.safety.test_toxicity_classifier import make_classifier

    folder = make_classifier(tmp_path / "clf", initializer_range=0.2)  # logits of about 1
    texts = [f"Sentence {i}: the quick brown fox, {'and ' * i}the lazy dog." for i in range(12)]
    texts += ["x", "What is 3 + 4? The answer is 7."]
    fp32 = TransformersScorer(folder, None, batch_size=5, device="cpu")
    bf16 = TransformersScorer(folder, None, batch_size=5, device="cpu", dtype="bfloat16")
    assert bf16.model.dtype == torch.bfloat16 and fp32.model.dtype == torch.float32
    want, got = torch.tensor(fp32.scores(texts)), torch.tensor(bf16.scores(texts))
    diff, scale = (got - want).abs().max().item(), _logit_scale(fp32, texts)
    print(f"classifier bf16 vs fp32: max |dp| {diff:.2e} ({diff / U:.2f} u), max|logit| "
          f"{scale:.2f}, scores spread {want.max() - want.min():.3f}")  # fmt: skip
    assert 0 < diff <= 4 * U * scale
    assert want.max() - want.min() > 10 * diff  # the scores differ far more than bf16 moves them


def test_the_safety_step_in_bf16_scores_with_a_bf16_classifier(tmp_path):
    """``evaluate.dtype=bfloat16`` reaches the safety step (the recipe's ``safety_config``): the
    model under test and the transformers classifier both load in bf16, the step runs, and
    its classifier scores are the float32 classifier's on the same continuations (tolerance
    above)."""
    from llmflow.tasks.framework.step import RawFiles
    from llmflow.tasks.safety.classifier import toxicity_classifier
    from llmflow.tasks.safety.config import SafetyEvalConfig, ToxicityClassifierConfig
    from llmflow.tasks.safety.data import safety_files
    from llmflow.tasks.safety.hf_classifier import TransformersScorer
    from llmflow.tasks.safety.step import CONTINUATIONS, RESULTS, safety
    from tests.needs import shared_path
    from tests.tasks.evaluation.eval_fixtures import make_tiny_model
    from tests.tasks.safety.test_toxicity_classifier import make_classifier

    data = RawFiles(safety_files(shared_path("safety")))
    folder = make_classifier(tmp_path / "clf", initializer_range=0.2)
    make_tiny_model(tmp_path / "lm" / "hf")
    (tmp_path / "c").mkdir()
    toxicity_classifier(ToxicityClassifierConfig(model=str(folder)), data=data, out=tmp_path / "c")
    run = SafetyEvalConfig(crows_limit=4, prompts_per_file=1, samples_per_prompt=2,
                           max_new_tokens=6, dtype="bfloat16", device="cpu")  # fmt: skip
    (tmp_path / "s").mkdir()
    safety(run, model=tmp_path / "lm", classifier=tmp_path / "c", data=data, out=tmp_path / "s")
    results = json.loads((tmp_path / "s" / RESULTS).read_text())
    assert results["dtype"] == "bfloat16"
    assert 0 <= results["crows_pairs"]["pct_stereotype"] <= 100
    rows = [json.loads(x) for x in (tmp_path / "s" / CONTINUATIONS).read_text().splitlines()]
    texts = [t for row in rows for t in row["continuations"]]
    scored = torch.tensor([s for row in rows for s in row["scores"]["classifier"]])
    scorer = TransformersScorer(folder, None, device="cpu")
    fp32 = torch.tensor(scorer.scores(texts))
    diff, scale = (scored - fp32).abs().max().item(), _logit_scale(scorer, texts)
    print(f"safety step bf16 classifier vs fp32 on {len(texts)} continuations: {diff:.2e}")
    assert 0 < diff <= 4 * U * scale


def test_bf16_evaluations_take_new_addresses():
    """float32 evaluate and safety configs keep their hashes; bf16 ones (whose numbers the
    float32 log-softmax changed) move."""
    from llmflow.tasks.framework.hashing import versioned_fields
    from llmflow.tasks.safety.config import SafetyEvalConfig

    for cls in (EvalConfig, SafetyEvalConfig):
        assert "log_softmax_dtype" not in versioned_fields(cls())
        assert versioned_fields(cls(dtype="bfloat16"))["log_softmax_dtype"] == "float32"
