"""SFT and DPO in bf16 on CPU: TRL's ``bf16=True``, the mixed precision GPU runs use (autocast
over float32 weights and optimizer state), reached here through ``use_cpu``.

``precision`` chooses: ``auto`` (the default, left out of the hash so old addresses stay) is
bf16 on CUDA and fp32 on CPU, as ``pretrain.train.precision``; the older ``bf16: true`` still
means bf16.

Tolerance of the bf16 held-out loss against the float32 one (same weights, same examples): the
loss is computed in float32 from logits the last matmul rounds to bf16, a relative error of at
most ``u/2`` (``u = 2**-8``) each, plus what the earlier bf16 layers add (the same order again
per layer, two layers here). The loss ``logsumexp(z) - z_y`` moves by at most twice the largest
logit error, ``2 * n * u/2 * max|z|`` for ``n`` roundings in a chain; the tiny random models'
logits are small (``max|z|`` about 1), so with ``n ~ 20``, ``|loss_bf16 - loss_fp32| <= 20 u
~ 0.08`` is the worst case; measured: 1.8e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmflow.tasks.evaluation.models import hf_dir
from llmflow.tasks.framework.hashing import versioned_fields
from llmflow.tasks.posttrain.common import common_training_args, split_heldout
from llmflow.tasks.posttrain.config import DPOStepConfig, GRPOStepConfig, SFTStepConfig
from llmflow.tasks.posttrain.dpo import (
    build_dpo_trainer,
    dpo,
    evaluate_heldout,
    prepare_pairs,
    resolve_dpo_data,
)
from llmflow.tasks.posttrain.sft import (
    build_sft_trainer,
    prepare_sft_examples,
    resolve_sft_data,
    sft,
)

U = 2.0**-8
FAST = dict(max_length=64, per_device_batch_size=4, num_heldout=8, logging_steps=1)


def _matmul_dtypes(model) -> list[torch.dtype]:
    """Record the dtype each call of the first attention projection computes in."""
    seen: list[torch.dtype] = []
    layer = model.model.layers[0].self_attn.q_proj
    layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


def _sft_trainer(cfg: SFTStepConfig, model_output, out):
    model_dir = hf_dir(model_output)
    examples, _ = prepare_sft_examples(cfg, model_dir, resolve_sft_data(cfg, out, None))
    train, heldout = split_heldout(examples, cfg.num_heldout, cfg.seed)
    return build_sft_trainer(cfg, model_dir, out, train, heldout)


def test_sft_in_bf16_computes_in_bf16_and_lowers_heldout_loss(tiny_model_output, tmp_path):
    """Before: TrainingArguments refused bf16 on CPU ("Your setup doesn't support bf16/gpu. You
    need to assign use_cpu ..."). After: the forward computes in bf16 over float32 weights,
    the held-out loss before training is the float32 one within bf16 rounding, and training
    lowers it."""
    fields = dict(**FAST, max_steps=6, learning_rate=3e-3)
    losses, dtypes = {}, {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        out.mkdir()
        trainer = _sft_trainer(SFTStepConfig(**fields, precision=precision), tiny_model_output, out)
        seen = _matmul_dtypes(trainer.model)
        losses[precision] = trainer.evaluate()["eval_loss"]
        dtypes[precision] = set(seen)
        assert trainer.args.bf16 == (precision == "bf16")
        assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert dtypes == {"fp32": {torch.float32}, "bf16": {torch.bfloat16}}
    diff = abs(losses["bf16"] - losses["fp32"])
    print(f"sft held-out loss: fp32 {losses['fp32']:.5f}, bf16 {losses['bf16']:.5f} ({diff:.2e})")
    assert 0 < diff <= 20 * U

    out = tmp_path / "step"
    out.mkdir()
    metrics = sft(SFTStepConfig(**fields, precision="bf16"), tiny_model_output, out)
    assert metrics["heldout_loss_before"] == pytest.approx(losses["bf16"], abs=1e-6)
    assert metrics["heldout_loss_after"] < metrics["heldout_loss_before"] - 0.3
    assert metrics["num_steps"] == 6


def test_dpo_in_bf16_lowers_heldout_loss(tiny_model_output, tmp_path):
    """Policy and reference both under bf16 autocast: before training they give the same log
    probabilities, so the held-out DPO loss is ln 2 and every margin 0 exactly, as in float32
    (before: the policy computed in float32 there, margins 1.7e-6); training lowers the loss."""
    cfg = DPOStepConfig(**{**FAST, "num_heldout": 16}, max_steps=6, learning_rate=3e-3,
                        precision="bf16")  # fmt: skip
    probe = tmp_path / "probe"
    probe.mkdir()
    model_dir = hf_dir(tiny_model_output)
    pairs, _ = prepare_pairs(cfg, model_dir, resolve_dpo_data(cfg, probe, None))
    train, heldout = split_heldout(pairs, cfg.num_heldout, cfg.seed)
    trainer = build_dpo_trainer(cfg, model_dir, probe, train, heldout)
    seen = _matmul_dtypes(trainer.model)
    before = evaluate_heldout(trainer, heldout, cfg, "before")
    # before the fix the policy ran in float32 here against a bf16 reference: margins 1.7e-6
    assert set(seen) == {torch.bfloat16} and trainer.args.bf16
    assert before["heldout_rewards_margins_before"] == 0.0
    assert before["heldout_rewards_accuracies_before"] == 0.0

    out = tmp_path / "step"
    out.mkdir()
    metrics = dpo(cfg, tiny_model_output, out)
    print({k: round(v, 4) for k, v in metrics.items() if k.startswith("heldout_")})
    assert metrics["heldout_loss_before"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["heldout_rewards_margins_before"] == 0.0
    assert metrics["heldout_loss_after"] < metrics["heldout_loss_before"] - 0.01
    assert metrics["heldout_rewards_margins_after"] > 0


@pytest.mark.parametrize("config_cls", [SFTStepConfig, DPOStepConfig, GRPOStepConfig])
def test_precision_setting(config_cls, tmp_path, monkeypatch):
    """auto: bf16 on CUDA only, left out of the hash (old outputs keep their addresses);
    bf16 and the older bf16=true both set TRL's bf16; a contradiction is refused."""
    from llmflow.tasks.posttrain import common

    default = config_cls()
    assert default.precision == "auto" and "precision" not in versioned_fields(default)
    assert versioned_fields(config_cls(precision="bf16"))["precision"] == "bf16"
    assert not default.uses_bf16("cpu") and default.uses_bf16("cuda")
    assert not config_cls(precision="fp32").uses_bf16("cuda")
    assert config_cls(bf16=True).uses_bf16("cpu")
    monkeypatch.setattr(common, "_has_cuda", lambda: False)
    args = common_training_args(default, tmp_path)
    assert (args["bf16"], args["use_cpu"]) == (False, False)  # as before on CPU
    args = common_training_args(config_cls(precision="bf16"), tmp_path)
    assert (args["bf16"], args["use_cpu"]) == (True, True)
    monkeypatch.setattr(common, "_has_cuda", lambda: True)
    args = common_training_args(default, tmp_path)
    assert (args["bf16"], args["use_cpu"]) == (True, False)
    with pytest.raises(ValueError, match=r"bf16=True contradicts precision='fp32'"):
        config_cls(bf16=True, precision="fp32")
    with pytest.raises(ValueError, match=r"precision"):
        config_cls(precision="fp16")
