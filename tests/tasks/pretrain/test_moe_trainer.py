"""Mixture-of-experts models in the trainer: load balancing, metrics, Muon on experts, FSDP2.

Run as a script (``python test_moe_trainer.py --config ...``, under torchrun too) it is the
trainer with one more component: rank 0 writes each step's expert loads (summed over the
data-parallel ranks) and selection biases to ``loads.jsonl``, which the two-rank tests compare.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, losses_by_step, read_jsonl, run_trainer, tiny_config

from llmflow.model.moe import load_balancing_loss, moe_layers, router_z_loss
from llmflow.tasks.pretrain.callbacks import Callback

SCRIPT = Path(__file__)
# The tiny model with 8 experts of width 32, 2 per token, in both layers (moe-debug's layout),
# balanced by the aux-free bias alone (the tests that train the auxiliary loss set its weight).
MOE_MODEL = {**TINY_MODEL, "moe_intermediate_size": 32, "router_aux_loss_coef": 0.0}
MUON = {"name": "muon", "lr": 3e-3, "muon_lr": 0.02}
ADAMW = {"name": "adamw", "lr": 3e-3}


def moe_config(rate: float = 0.001, **changes):
    """``tiny_config`` with the moe-debug preset at the tiny model's sizes."""
    overrides = {**MOE_MODEL, "router_bias_update_rate": rate, **changes.pop("model", {})}
    return tiny_config(model={"preset": "moe-debug", "overrides": overrides}, **changes)


class LoadRecorder(Callback):
    """Rank 0 appends each accepted step's loads and biases to ``loads.jsonl`` (after the
    balancing component: the loads are over every rank, the bias after its update)."""

    def on_step_end(self, trainer, out) -> None:
        if not trainer.runtime.is_main:
            return
        layers = trainer.moe_balance.layers
        row = {
            "step": out.step,
            "load": trainer.moe_balance.last_load.tolist(),
            "bias": [moe.router.expert_bias.tolist() for _, moe in layers],
        }
        with open(Path(trainer.out_dir) / "loads.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def loads_by_step(out_dir: Path) -> dict[int, dict]:
    """step -> that step's row of ``loads.jsonl`` (the last one for steps replayed)."""
    return {row["step"]: row for row in read_jsonl(Path(out_dir) / "loads.jsonl")}


def final_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(out_dir) / "final" / "model.safetensors")


def in_process(cfg, data: Path, out: Path):
    """A one-process trainer in this process (the tests read its model and components)."""
    from llmflow.tasks.pretrain.train import Trainer

    out.mkdir(parents=True, exist_ok=True)
    return Trainer(cfg, data, out)


# ------------------------------------------------------------------------- one process
@torch.no_grad()
def _skew(trainer, delta: float) -> None:
    """Make experts 0 and 1 every token's top 2: every embedding gets a common direction v (the
    tied output head's logits all move alike: the loss is unchanged) and rows 0 and 1 of each
    router a component along v, so their logits are about ``delta`` above the others'."""
    hidden = trainer.model_config.hidden_size
    v = torch.randn(hidden, generator=torch.Generator().manual_seed(0))
    v /= v.norm()
    trainer.model.embed.weight += 0.5 * v
    for _, moe in moe_layers(trainer.model):
        moe.router.weight[:2] += delta / hidden**0.5 * v


def test_aux_free_bias_evens_out_a_skewed_router(tmp_path, train_data):
    """50 steps from a router that sends every token to experts 0 and 1 (max/mean load 4): the
    bias brings the load of the last 10 steps under 1.5 max/mean; without it (rate 0, same seed)
    it stays above 3. Measured by the trainer's own metric rows."""
    results = {}
    for rate in (0.01, 0.0):
        cfg = moe_config(rate, max_steps=50, log_interval=10, eval_interval=1000,
                         batch={"micro_batch_size": 8}, optimizer=ADAMW,
                         checkpoint={"interval": 1000, "keep_last": 1})  # fmt: skip
        out = tmp_path / f"rate-{rate}"
        trainer = in_process(cfg, train_data, out)
        _skew(trainer, delta=1.5)
        summary = trainer.fit()
        rows = read_jsonl(out / "metrics.jsonl")
        assert [r["step"] for r in rows] == [10, 20, 30, 40, 50]
        assert rows[0]["moe/load_max_mean"] > 3.5  # the skew took: experts 0 and 1 get it all
        assert summary["moe_load_max_mean"] == rows[-1]["moe/load_max_mean"]
        biases = [(r["moe/layer0/bias_min"], r["moe/layer0/bias_max"]) for r in rows]
        results[rate] = rows[-1]["moe/load_max_mean"], biases
    balanced, biases = results[0.01]
    assert balanced < 1.5, results
    assert biases[-1][0] < -0.05 and biases[-1][1] > 0.05  # it moved experts 0, 1 down
    unbalanced, biases = results[0.0]
    assert unbalanced > 3.0, results
    assert all(b == (0.0, 0.0) for b in biases)


def test_metric_rows_summary_and_state(tmp_path, train_data):
    """Per-layer router metrics in each row (compact: scalars only), one console line per row,
    the summary key; the loads are the tokens routed: every token counted top-k times."""
    cfg = moe_config(max_steps=4, log_interval=2, eval_interval=1000,
                     batch={"micro_batch_size": 4, "grad_accum_steps": 2},
                     checkpoint={"interval": 1000, "keep_last": 1})  # fmt: skip
    out = tmp_path / "run"
    trainer = in_process(cfg, train_data, out)
    assert all(moe.aux_scale == 0.5 for _, moe in moe_layers(trainer.model))
    loads = []

    class Loads(Callback):
        def on_step_end(self, trainer, out) -> None:
            loads.append((out.num_tokens, trainer.moe_balance.last_load.clone()))

    trainer.callbacks.append(Loads())
    summary = trainer.fit()
    for num_tokens, load in loads:  # 2 layers x 8 experts; each token goes to 2 experts
        assert load.shape == (2, 8) and load.sum(dim=1).tolist() == [2 * num_tokens] * 2
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 4]
    row = rows[-1]
    for layer in (0, 1):
        for key in ("load_max_mean", "router_entropy", "aux_loss", "z_loss", "bias_min"):
            assert isinstance(row[f"moe/layer{layer}/{key}"], float)
        # softmax over 8 experts: entropy at most log 8; the aux loss is 1 when balanced
        assert 0 < row[f"moe/layer{layer}/router_entropy"] <= float(torch.tensor(8.0).log())
        assert 0.9 < row[f"moe/layer{layer}/aux_loss"] < 2
    # the row's load is over the 2 steps since the last row
    interval = loads[2][1] + loads[3][1]
    ratio = (interval.max(dim=1).values / interval.mean(dim=1)).max().item()
    assert row["moe/load_max_mean"] == pytest.approx(ratio)
    assert all(not isinstance(v, (dict, list)) for v in row.values())
    assert summary["moe_load_max_mean"] == row["moe/load_max_mean"]
    assert trainer.registry.main_state()["moe_balance"]["last_row"] == {
        k: v for k, v in row.items() if k.startswith("moe/")
    }


def test_dense_model_has_no_moe_component(tmp_path, train_data):
    trainer = in_process(tiny_config(max_steps=1), train_data, tmp_path / "dense")
    assert trainer.moe_balance is None
    assert "moe_balance" not in trainer.registry.main
    summary = trainer.fit()
    assert not any(k.startswith("moe") for k in summary)
    assert not any(k.startswith("moe") for k in read_jsonl(tmp_path / "dense/metrics.jsonl")[0])


def test_guard_skip_drops_the_counts_and_keeps_the_bias(tmp_path, train_data, monkeypatch):
    """A spike the guard skips at step 7: the refused step's tokens are not counted and the bias
    does not move; the step taken again counts its tokens once."""
    monkeypatch.setenv("LLMFLOW_FAULTS", json.dumps({"scale_loss_at_steps": [7]}))
    guard = {"policy": "skip", "window": 8, "min_history": 4, "zscore": 5.0}
    cfg = moe_config(0.01, max_steps=9, guard=guard, eval_interval=1000,
                     checkpoint={"interval": 1000, "keep_last": 1})  # fmt: skip
    trainer = in_process(cfg, train_data, tmp_path / "run")
    seen = []

    class Watch(Callback):
        def on_step_start(self, trainer, step) -> None:
            bias = [moe.router.expert_bias.clone() for _, moe in trainer.moe_balance.layers]
            seen.append(("start", step, bias))

        def on_step_end(self, trainer, out) -> None:
            seen.append(("end", out.num_tokens, trainer.moe_balance.last_load.clone()))

    trainer.callbacks.insert(trainer.callbacks.index(trainer.moe_balance) + 1, Watch())
    summary = trainer.fit()
    assert summary["skipped_batches"] == 1
    starts = [(step, bias) for kind, step, bias in seen if kind == "start"]
    steps = [step for step, _ in starts]
    assert steps.count(7) == 2  # the 8th step refused, then taken with the next batch
    (_, before), (_, again) = [s for s in starts if s[0] == 7]
    for a, b in zip(before, again, strict=True):
        assert torch.equal(a, b) and a.abs().sum() > 0  # the refused step moved no bias
    for kind, num_tokens, load in seen:
        if kind == "end":
            assert load.sum(dim=1).tolist() == [2 * num_tokens] * 2


def test_aux_and_z_loss_are_trained(tmp_path, train_data):
    """With grad_accum 2, the last sparse layer's router gradient with router_aux_loss_coef and
    router_z_loss_coef > 0 differs from the coefficients-0 one by the gradient of
    ``(coef * aux + z_coef * z) / 2`` summed over the two micro-batches, computed by hand."""
    aux_coef, z_coef = 0.1, 0.01
    grads, inputs = {}, []
    for name, coefs in (("on", (aux_coef, z_coef)), ("off", (0.0, 0.0))):
        model = {"router_aux_loss_coef": coefs[0], "router_z_loss_coef": coefs[1]}
        cfg = moe_config(model=model, batch={"micro_batch_size": 4, "grad_accum_steps": 2})
        trainer = in_process(cfg, train_data, tmp_path / name)
        moe = moe_layers(trainer.model)[-1][1]
        handle = moe.register_forward_hook(lambda m, args, out: inputs.append(args[0].detach()))
        trainer.model.train()
        trainer.forward_backward(trainer.next_batches(0))
        handle.remove()
        grads[name] = moe.router.weight.grad.clone()
        weight, bias = moe.router.weight.detach(), moe.router.expert_bias
    on, off = inputs[:2], inputs[2:]
    for a, b in zip(on, off, strict=True):
        assert torch.equal(a, b)  # the forwards are the same: only the backward differs
    leaf = weight.clone().requires_grad_(True)
    total = 0.0
    for x in on:
        tokens = x.reshape(-1, x.shape[-1])
        logits = tokens @ leaf.T
        scores = logits.softmax(dim=-1)
        ids = (scores + bias).topk(2, dim=-1).indices
        counts = torch.bincount(ids.reshape(-1), minlength=scores.shape[1])
        aux = load_balancing_loss(scores, counts, 2)
        total = total + (aux_coef * aux + z_coef * router_z_loss(logits)) / 2
    (expected,) = torch.autograd.grad(total, leaf)
    difference = grads["on"] - grads["off"]
    assert expected.abs().max() > 1e-4  # not vacuous
    torch.testing.assert_close(difference, expected, rtol=1e-4, atol=1e-7)


def test_muon_orthogonalizes_each_expert_matrix():
    """One process: the trainer's Muon on the experts' 3-D weights equals torch.optim.Muon on
    each expert's gate, up and down matrices; the routers go to AdamW."""
    from llmflow.model.config import preset
    from llmflow.model.transformer import Transformer
    from llmflow.tasks.pretrain.config import OptimizerConfig
    from llmflow.tasks.pretrain.optim import build_optimizers, split_parameters

    def model():
        m = Transformer(preset("moe-debug", **MOE_MODEL))
        m.init_weights(seed=0)
        return m

    cfg = OptimizerConfig(**MUON, muon_weight_decay=0.1)
    ours, ref = model(), model()
    groups = split_parameters(ours)
    assert [n for n, _ in groups["decay"]] == [f"layers.{i}.mlp.router.weight" for i in (0, 1)]
    optimizers = build_optimizers(ours, cfg)
    assert {p.ndim for p in optimizers[0].param_groups[0]["params"]} == {2, 3}
    blocks = []  # (parameter, expert, first row, last row + 1, leaf)
    for name, param in split_parameters(ref)["hidden_matrix"]:
        if param.ndim == 2:
            parts = [(None, 0, param.shape[0])]
        else:
            rows = param.shape[1] // (2 if name.endswith("gate_up_proj") else 1)
            parts = [(e, r, r + rows) for e in range(param.shape[0])
                     for r in range(0, param.shape[1], rows)]  # fmt: skip
        for expert, lo, hi in parts:
            if param.ndim == 2 and name.endswith("qkv_proj.weight"):
                continue  # fused q, k, v: test_muon_fsdp.py covers them
            blocks.append((param, expert, lo, hi))
    reference = _ReferenceExperts(ref, blocks, cfg)
    for step in range(3):
        ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(step))
        for m in (ours, ref):
            logits = m(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        reference.step()
    theirs = ref.state_dict()
    for name, value in ours.state_dict().items():
        if "experts" in name:
            torch.testing.assert_close(value, theirs[name], rtol=0, atol=1e-5, msg=name)
    moved = ours.layers[0].mlp.experts.down_proj - model().layers[0].mlp.experts.down_proj
    assert moved.abs().max() > 1e-3


class _ReferenceExperts:
    """torch.optim.Muon on each expert's matrices (copied in and out), the trainer's optimizers
    on the other parameters."""

    def __init__(self, model, blocks, cfg) -> None:
        from llmflow.tasks.pretrain.optim import build_optimizers

        expert_ids = {id(p) for p, e, *_ in blocks if e is not None}
        self.others = build_optimizers(model, cfg)  # takes the experts too: their step undone
        self.blocks = [(p, e, lo, hi, torch.nn.Parameter(p.detach()[e, lo:hi].clone()))
                       for p, e, lo, hi in blocks if e is not None]  # fmt: skip
        self.expert_ids = expert_ids
        self.muon = torch.optim.Muon(
            [leaf for *_, leaf in self.blocks],
            lr=cfg.muon_lr,
            weight_decay=cfg.muon_weight_decay,
            momentum=cfg.muon_momentum,
            adjust_lr_fn=cfg.muon_adjust_lr,
        )

    @torch.no_grad()
    def step(self) -> None:
        for param, e, lo, hi, leaf in self.blocks:
            leaf.copy_(param[e, lo:hi])
            leaf.grad = param.grad[e, lo:hi].clone()
        for optimizer in self.others:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.muon.step()
        for param, e, lo, hi, leaf in self.blocks:
            param[e, lo:hi] = leaf


# ------------------------------------------------------------------------- two ranks
@pytest.mark.slow  # 2 trainer launches per optimizer, about 10-20 s each on 2 cores
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_ranks_match_one_process(tmp_path, train_data, optimizer):
    """FSDP2 over 2 gloo ranks (activation checkpointing on) against one process with the same
    global batch, 10 steps. AdamW: losses within 1e-5 relative and the same expert loads and
    biases at every step (the recompute in the backward counts nothing).

    Muon: Newton–Schulz runs in bf16, so the ~1e-7 float32 differences of FSDP's gradient sums
    flip bf16 roundings of the update and the weights part at ~1e-5; a token whose top-2 is a
    near tie can then go to another expert. Losses within 1e-4 relative (as the dense Muon
    trainer test), the loads equal at the first two steps and within 2% after."""
    opt = MUON if optimizer == "muon" else ADAMW
    common = dict(max_steps=10, optimizer=opt, checkpoint={"interval": 100, "keep_last": 1})
    single, double = tmp_path / "one", tmp_path / "two"
    run_trainer(moe_config(batch={"micro_batch_size": 4}, **common), train_data, single,
                script=SCRIPT)  # fmt: skip
    cfg = moe_config(batch={"micro_batch_size": 2}, activation_checkpointing="full", **common)
    run_trainer(cfg, train_data, double, num_processes=2, script=SCRIPT)
    expected, got = losses_by_step(single), losses_by_step(double)
    assert sorted(got) == list(range(1, 11))
    tolerance = 1e-4 if optimizer == "muon" else 1e-5
    for step in got:
        assert abs(got[step] - expected[step]) <= tolerance * abs(expected[step]), step
    one, two = loads_by_step(single), loads_by_step(double)
    assert sum(sum(layer) for layer in one[1]["load"]) > 0
    for step in range(1, 11):
        if optimizer == "adamw" or step <= 2:
            assert two[step]["load"] == one[step]["load"], step
            assert two[step]["bias"] == one[step]["bias"], step
            continue
        a, b = torch.tensor(one[step]["load"]), torch.tensor(two[step]["load"])
        assert (a - b).abs().sum() <= 0.02 * a.sum(), step


@pytest.mark.slow  # 3 two-rank launches, about 40-60 s on 2 cores
def test_kill9_and_resume_at_two_ranks_is_bitwise(tmp_path, train_data):
    """bf16, Muon, activation checkpointing, dp=2: SIGKILL after step 6 (last checkpoint 4) and
    a resume end on the uninterrupted run's weights and expert biases, bit for bit."""
    cfg = moe_config(0.01, max_steps=8, optimizer=MUON, precision="bf16",
                     activation_checkpointing="full", batch={"micro_batch_size": 2},
                     checkpoint={"interval": 4, "keep_last": 2})  # fmt: skip
    full, killed = tmp_path / "full", tmp_path / "killed"
    run_trainer(cfg, train_data, full, num_processes=2, script=SCRIPT)
    proc = run_trainer(cfg, train_data, killed, num_processes=2, check=False, script=SCRIPT,
                       faults={"sigkill_after_step": 6})  # fmt: skip
    assert proc.returncode != 0 and "SIGKILL after step 6" in proc.stdout + proc.stderr
    assert not (killed / "final").exists()
    proc = run_trainer(cfg, train_data, killed, num_processes=2, script=SCRIPT)
    assert "resumed from" in proc.stdout and "step 4" in proc.stdout
    assert losses_by_step(killed) == losses_by_step(full)
    assert loads_by_step(killed) == loads_by_step(full)
    expected, got = final_weights(full), final_weights(killed)
    assert got.keys() == expected.keys()
    assert any(k.endswith("expert_bias") for k in expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    bias = expected["layers.0.mlp.router.expert_bias"]
    assert bias.abs().max() > 0  # the bias moved: the comparison covers it
    summaries = [json.loads((d / "summary.json").read_text()) for d in (full, killed)]
    assert summaries[0]["moe_load_max_mean"] == summaries[1]["moe_load_max_mean"]


def _trainer_with_load_recorder(self, val_dir):
    found = ORIGINAL(self, val_dir)
    at = found.index(self.moe_balance) + 1 if self.moe_balance is not None else len(found)
    return [*found[:at], LoadRecorder(), *found[at:]]


if __name__ == "__main__":
    from llmflow.tasks.pretrain import train

    ORIGINAL = train.Trainer._components
    train.Trainer._components = _trainer_with_load_recorder
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    train.main()
