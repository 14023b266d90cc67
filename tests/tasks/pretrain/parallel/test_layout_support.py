"""One rule (``support.check_layout``) decides which parallel layouts run: config validation
refuses the others before any step, ``llmflow plan`` proposes only accepted ones, preflight and
the trainer ask the same function, and (slow) every accepted combination trains on CPU ranks,
its losses equal to one process's."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmflow.model.config import preset
from llmflow.tasks.framework.errors import ConfigError
from llmflow.tasks.pretrain.parallel.config import Layout, ParallelConfig
from llmflow.tasks.pretrain.parallel.support import StageShape, check_layout

ROOT = Path(__file__).resolve().parents[4]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


# ---------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    ("layout", "model", "support", "needles"),
    [
        (Layout(cp=2, pp=2), {}, {}, ["parallel.cp=2 with pp=2"]),
        (Layout(tp=2), {}, {"compile": True}, ["parallel.tp=2", "compile=true"]),
        (Layout(tp=2), {"qk_norm": True}, {}, ["parallel.tp=2", "model.qk_norm=true"]),
        (Layout(tp=3), {"hidden_size": 192, "num_heads": 6}, {}, ["tp=3", "num_kv_heads=2"]),
        (Layout(tp=2), {"intermediate_size": 67}, {}, ["tp=2", "intermediate_size=67"]),
        (Layout(tp=2), {"vocab_size": 129}, {}, ["tp=2", "vocab_size=129"]),
        (Layout(pp=4), {"num_layers": 2}, {}, ["pp=4 exceeds", "num_layers=2"]),
        (
            Layout(tp=2),
            {"num_experts": 4, "hf_model_type": "mixtral"},
            {},
            ["parallel.tp=2 with model.num_experts=4", "use tp 1"],
        ),
        (Layout(tp=2, pp=2), {}, {}, ["parallel.tp=2 with pp=2", "tie_embeddings=true"]),
        (
            Layout(cp=2),
            {},
            {"stages": [StageShape(66, 1, "pretrain.stages.0.mixture.seq_len")]},
            ["parallel.cp=2", "pretrain.stages.0.mixture.seq_len=66", "2 x cp = 4"],
        ),
        (Layout(tp=2), {}, {"stages": [StageShape(33, 1)]}, ["parallel.tp=2", "seq_len=33"]),
        (
            Layout(tp=4, cp=2),
            {"num_kv_heads": 4},
            {"stages": [StageShape(12, 1)]},
            ["parallel.tp=4", "seq_len=12", "cp x tp = 8"],
        ),
        (
            Layout(pp=2),
            {},
            {"stages": [StageShape(64, 1)]},
            ["parallel.pp=2", "pretrain.train.batch.grad_accum_steps=1"],
        ),
    ],
)
def test_check_layout_names_the_field_and_value(layout, model, support, needles):
    with pytest.raises(ConfigError) as err:
        check_layout(layout, preset("debug", **model), **support)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_check_layout_accepts_what_the_trainer_runs_and_names_where_a_layout_is_set():
    model = preset("debug")
    for layout in (Layout(tp=2, cp=2), Layout(dp_replicate=2, cp=2), Layout(pp=2)):
        check_layout(layout, model, optimizer="adamw", stages=[StageShape(64, 2)])
    untied = preset("debug", tie_embeddings=False)
    check_layout(Layout(tp=2, pp=2), untied, optimizer="adamw", stages=[StageShape(64, 2)])
    # Muon with tensor parallelism and with data-parallel replicas (HSDP)
    check_layout(Layout(tp=2, dp_replicate=2), model, optimizer="muon")
    with pytest.raises(ConfigError, match=r"^extend.stages.1.parallel.cp=4: extend.stages.1"):
        check_layout(Layout(cp=4), model, stages=[StageShape(12, 1, "extend.stages.1.seq_len")],
                     field="extend.stages.1.parallel")  # fmt: skip
    # resolve asks the same rule
    with pytest.raises(ConfigError, match="cp=2 with pp=2"):
        ParallelConfig(cp=2, pp=2).resolve(4)


# ------------------------------------------------------------------------- config validation
RUN = ["run", "--until", "pretrain"]


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (
            ["pretrain.num_processes=2", "pretrain.parallel.pp=2",
             "pretrain.train.batch.grad_accum_steps=1"],
            ["pretrain.train.parallel.pp=2", "pretrain.train.batch.grad_accum_steps=1"],
        ),
        (
            ["pretrain.num_processes=3", "pretrain.parallel.tp=3",
             "pretrain.train.optimizer.name=adamw"],
            ["pretrain.train.parallel.tp=3 does not divide the model's num_heads=4"],
        ),
        (
            ["pretrain.num_processes=3", "pretrain.parallel.cp=3"],
            ["pretrain.train.parallel.cp=3", "pretrain.stages.0.mixture.seq_len=256"],
        ),
        (
            ["pretrain.num_processes=4", "pretrain.parallel.cp=2", "pretrain.parallel.pp=2",
             "pretrain.train.batch.grad_accum_steps=2"],
            ["pretrain.train.parallel.cp=2 with pp=2"],
        ),
        (  # an extension stage's own layout, at its own length
            ["pretrain.num_processes=3", "extend.stages.1.parallel={cp: 3}"],
            ["extend.stages.1.parallel.cp=3", "extend.stages.1.seq_len=1024"],
        ),
        (
            ["pretrain.num_processes=2", "pretrain.parallel.tp=2",
             "pretrain.train.optimizer.name=adamw", "pretrain.train.model.overrides.qk_norm=true"],
            ["pretrain.train.parallel.tp=2", "model.qk_norm=true"],
        ),
        (
            ["pretrain.num_processes=3", "pretrain.parallel.tp=2"],
            ["pretrain.train.parallel", "does not divide the world size 3"],
        ),
        (
            ["pretrain.num_processes=2", "pretrain.parallel.tp=2",
             "pretrain.train.optimizer.name=adamw", "pretrain.train.model.preset=moe-debug"],
            ["pretrain.train.parallel.tp=2 with model.num_experts=8"],
        ),
        (
            ["pretrain.num_processes=2", "pretrain.parallel.ep=2"],
            ["pretrain.train.parallel.ep=2 needs a mixture-of-experts model"],
        ),
    ],
)  # fmt: skip
def test_run_refuses_an_unsupported_layout_before_any_step(tmp_path, capfd, overrides, needles):
    """``llmflow run`` validates every stage's layout with the config: one error line, exit 2,
    in well under a few seconds, and nothing written (no step ran)."""
    from llmflow.flows.cli import main

    root = tmp_path / "runs"
    argv = [*RUN, "--root", str(root)] + [a for o in overrides for a in ("--set", o)]
    started = time.perf_counter()
    assert main(argv) == 2
    seconds = time.perf_counter() - started
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("llmflow: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert seconds < 5, seconds
    assert not root.exists() or not any(root.iterdir())


def test_an_init_recipe_checks_degrees_before_it_knows_the_architecture():
    """With ``init`` the placeholder ``pretrain.train.model`` is not judged (the imported
    model's architecture replaces it when the recipe is built), the degrees still are."""
    from llmflow.tasks.config import load_config

    config = "configs/continue-pretrain.yaml"
    placeholder_refuses = ["pretrain.num_processes=4", "pretrain.parallel.tp=4"]  # 2 KV heads
    assert load_config(config, placeholder_refuses).pretrain.train.parallel.tp == 4
    with pytest.raises(ConfigError, match="pretrain.train.parallel.pp=2 needs at least 2"):
        load_config(config, ["pretrain.num_processes=2", "pretrain.parallel.pp=2"])


# --------------------------------------------------------------------------------- planner
PLANNED_DEGREES = ({"pp": 2}, {"tp": 2}, {"cp": 2}, None)
VARIANTS = ({}, {"model": {"overrides": {"qk_norm": True}}}, {"compile": True})


def _variant(config, optimizer: str, changes: dict):
    """The recipe with another optimizer, QK-norm or compile (the trainer config only: a recipe
    whose own layout refuses it must still reach the planner, which names the field). QK-norm
    on a Mixtral-layout mixture of experts is Qwen3-MoE's layout."""
    if changes.get("model") and config.pretrain.train.model_config_obj().hf_model_type == "mixtral":
        changes = {"model": {"overrides": {"qk_norm": True, "hf_model_type": "qwen3_moe"}}}
    train = config.pretrain.train.replaced(optimizer={"name": optimizer}, **changes)
    return config.pretrain.model_copy(update={"train": train})


def test_the_planner_returns_only_layouts_check_layout_accepts():
    """Every preset x optimizer x fixed degree (``--parallel``) x QK-norm/compile, on the
    recipe's GPUs and on 8: each stage's plan is accepted, or the planner refuses naming the
    field. Before: smollm3-3b with pp=2 planned cp=8 pp=2 (the trainer refuses CP with PP),
    QK-norm and compile got TP layouts."""
    from llmflow.tasks.config import load_config
    from llmflow.tasks.pretrain.layout_planner import stage_layout_plans

    checked, refused = 0, 0
    recipes = {path: load_config(path, []) for path in CONFIGS}
    for path, optimizer, fixed, changes, gpus in itertools.product(
        CONFIGS, ("adamw", "muon"), PLANNED_DEGREES, VARIANTS, (None, 8)
    ):
        config = recipes[path]
        pretrain = _variant(config, optimizer, changes)
        train = pretrain.train
        try:
            plans = stage_layout_plans(pretrain, config.extend, config.hardware, parallel=fixed,
                                       num_gpus=gpus)  # fmt: skip
        except ConfigError as err:
            assert "parallel" in str(err), str(err)
            refused += 1
            continue
        for name, seq_len, plan in plans:
            where = (path.name, optimizer, fixed, changes, gpus, name)
            check_layout(
                plan.layout, train.model_config_obj(), optimizer=optimizer, compile=train.compile,
                stages=[StageShape(seq_len, plan.grad_accum_steps)],
            )  # fmt: skip
            assert fixed is None or all(getattr(plan.layout, k) == v for k, v in fixed.items()), (
                where
            )
            checked += 1
    assert checked > 500 and refused > 0, (checked, refused)
    config = load_config("configs/smollm3-3b.yaml", [])
    plans = stage_layout_plans(config.pretrain, config.extend, config.hardware,
                               parallel={"pp": 2})  # fmt: skip
    assert [seq for _, seq, _ in plans] == [4096] * 3 + [32768, 65536]
    assert all(p.layout.pp == 2 and p.layout.cp == 1 for _, _, p in plans)


# ---------------------------------------------------------------------------------- preflight
def test_preflight_skips_a_layout_the_trainer_would_refuse():
    from llmflow.tasks.config import load_config
    from llmflow.tasks.preflight.layouts import _unsupported, tiny_train_config

    config = load_config(
        "configs/smollm3-1.7b.yaml", ["pretrain.train.model.overrides.qk_norm=true"]
    )
    train = tiny_train_config(config)
    assert _unsupported(train, {"cp": 2, "dp_shard": 2}, 4) is None
    assert "model.qk_norm=true" in _unsupported(train, {"tp": 2, "dp_shard": 2}, 4)


# ------------------------------------------------- slow: every accepted combination trains
STEPS, GRAD_ACCUM, GLOBAL_ROWS = 3, 2, 4
"""A step is ``GRAD_ACCUM`` micro-batches of ``GLOBAL_ROWS`` rows over the data-parallel ranks:
the same rows in every layout, so each loss is one process's."""
LOSS_TOLERANCE = 1e-4
MOE_MODEL = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "router_bias_update_rate": 0.01}  # fmt: skip
DEADLINE_S = {1: 120, 2: 240, 4: 360}


@dataclass(frozen=True)
class Combination:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    optimizer: str = "adamw"
    qk_norm: bool = False
    compile: bool = False
    tied: bool = True
    """Tied embeddings (the tiny model's); untied only where the rule tells them apart."""
    moe: bool = False
    """A mixture of experts in every layer (4 experts, 2 per token), with the aux-free bias (no
    auxiliary loss: a function of each micro-batch's rows, which layouts split differently)."""

    @property
    def parallel(self) -> dict:
        """The degrees; dp_shard 2 where the rest leave one rank (plain FSDP2 on 2 ranks) or
        only replicas (HSDP: 2 replicas of 2 shards), else 1."""
        degrees = {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp_replicate": self.dp_replicate}
        alone = self.tp == self.cp == self.pp == 1 and self.dp_replicate <= 2
        return {**degrees, "dp_shard": 2 if alone else 1}

    @property
    def world_size(self) -> int:
        return math.prod(self.parallel.values())

    @property
    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in self.parallel.items() if v > 1]
        parts += [self.optimizer] + ["qk_norm"] * self.qk_norm + ["compile"] * self.compile
        return "-".join(parts + ["untied"] * (not self.tied) + ["moe"] * self.moe)

    def layout(self) -> Layout:
        return ParallelConfig(**self.parallel).resolve(self.world_size)

    def train_config(self, parallel: dict | None = None):
        helpers = _helpers()
        parallel = self.parallel if parallel is None else parallel
        dp = parallel.get("dp_replicate", 1) * parallel.get("dp_shard", 1)
        return helpers.tiny_config(
            model={"preset": "debug", "overrides": {**helpers.TINY_MODEL, **self.model_changes}},
            optimizer={"name": self.optimizer, "lr": 3e-3},
            compile=self.compile,
            parallel=parallel,
            batch={"micro_batch_size": GLOBAL_ROWS // dp, "grad_accum_steps": GRAD_ACCUM},
            max_steps=STEPS,
            checkpoint={"interval": 100, "keep_last": 1},
            eval_interval=100,
        )

    @property
    def model_changes(self) -> dict:
        changes = {"qk_norm": self.qk_norm, "tie_embeddings": self.tied}
        if self.moe:
            changes.update(MOE_MODEL, hf_model_type="qwen3_moe" if self.qk_norm else "mixtral")
        return changes

    def reference(self) -> Combination:
        return Combination(
            optimizer=self.optimizer, qk_norm=self.qk_norm, tied=self.tied, moe=self.moe
        )


@functools.cache
def _helpers():
    """tests/tasks/pretrain/conftest.py's helpers (make_packed, tiny_config, TINY_MODEL)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "conftest.py"
    spec = importlib.util.spec_from_file_location("pretrain_test_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def accepted_combinations() -> list[Combination]:
    """Each (tp, cp, pp, dp_replicate, optimizer, qk_norm, compile) at world size <= 4 that
    ``check_layout`` accepts for the tiny model; TP with PP untied (tied, it is refused)."""
    found = []
    for tp, cp, pp, replicas, optimizer, qk_norm, compiled, moe in itertools.product(
        (1, 2),
        (1, 2),
        (1, 2),
        (1, 2),
        ("adamw", "muon"),
        (False, True),
        (False, True),
        (False, True),
    ):
        tied = not (tp > 1 and pp > 1)
        combo = Combination(tp, cp, pp, replicas, optimizer, qk_norm, compiled, tied, moe)
        if combo.world_size > 4 or moe and (qk_norm or compiled):
            continue
        model = preset("debug", **{**_helpers().TINY_MODEL, **combo.model_changes})
        try:
            check_layout(combo.layout(), model, optimizer=optimizer, compile=compiled,
                         stages=[StageShape(_helpers().SEQ_LEN, GRAD_ACCUM)])  # fmt: skip
        except ConfigError:
            continue
        found.append(combo)
    return found


def _marks(combo: Combination) -> list:
    if combo.compile:
        return [pytest.mark.skip(reason="torch.compile on CPU builds C++ kernels for minutes")]
    return []


COMBINATIONS = accepted_combinations()


def _run_worker() -> None:
    """One rank: train each run of the plan in turn in this process group; rank 0 writes the
    outcome of each (``ok`` or its error) to ``results.json``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", type=Path, required=True)
    args = parser.parse_args()
    from llmflow.tasks.pretrain.config import TrainConfig
    from llmflow.tasks.pretrain.distributed import teardown_runtime
    from llmflow.tasks.pretrain.train import Trainer

    plan = json.loads(args.plan.read_text())
    results = {}
    for run in plan["runs"]:
        try:
            cfg, out = TrainConfig.load(Path(run["config"])), Path(run["out"])
            out.mkdir(parents=True, exist_ok=True)
            Trainer(cfg, Path(plan["data"]), out).fit()
            results[run["out"]] = "ok"
        except Exception as err:  # noqa: BLE001  (each run's outcome is reported, not raised)
            results[run["out"]] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    if int(os.environ.get("RANK", "0")) == 0:
        (args.plan.parent / "results.json").write_text(json.dumps(results, indent=1))
    teardown_runtime()


def _launch(root: Path, data: Path, runs: list[tuple[str, object]], world: int) -> dict:
    """One process group of ``world`` ranks training every run in turn (one start for all)."""
    from tests.tasks.pretrain.parallel.ranks import run_group

    folder = root / f"world{world}"
    folder.mkdir(parents=True)
    plan = {"data": str(data), "runs": []}
    for name, cfg in runs:
        cfg.save(folder / f"{name}.json")
        plan["runs"].append({"config": str(folder / f"{name}.json"), "out": str(folder / name)})
    (folder / "plan.json").write_text(json.dumps(plan))
    command = [sys.executable, __file__, "--plan", str(folder / "plan.json")]
    if world > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(world), *command[1:]]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_group(command, env, DEADLINE_S[world], f"{len(runs)} runs on {world} ranks")
    results = json.loads((folder / "results.json").read_text())
    return {Path(out).name: (outcome, Path(out)) for out, outcome in results.items()}


def _reference_name(combo: Combination) -> str:
    parts = ["one-process", combo.optimizer] + ["qk_norm"] * combo.qk_norm
    return "-".join(parts + ["untied"] * (not combo.tied) + ["moe"] * combo.moe)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """Every accepted combination (compile left out on CPU) trained, one launch per world size,
    and one-process references per model and optimizer."""
    helpers = _helpers()
    root = tmp_path_factory.mktemp("layout_support")
    data = helpers.make_packed(root / "data", num_docs=300, seed=0)
    runnable = [c for c in COMBINATIONS if not c.compile]
    references = {c.reference() for c in runnable}
    by_world: dict[int, list] = {1: [(_reference_name(r), r.train_config({})) for r in sorted(
        references, key=_reference_name)]}  # fmt: skip
    for combo in runnable:
        by_world.setdefault(combo.world_size, []).append((combo.name, combo.train_config()))
    outcomes = {}
    for world, runs in sorted(by_world.items()):
        for name, (outcome, out) in _launch(root, data, runs, world).items():
            outcomes[(world, name)] = (outcome, out)
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize(
    "combo", [pytest.param(c, id=c.name, marks=_marks(c)) for c in COMBINATIONS]
)
def test_every_accepted_combination_trains_like_one_process(request, combo):
    """All accepted combinations of (tp, cp, pp, dp_replicate, optimizer, qk_norm) at world
    size <= 4 train ``STEPS`` steps; each step's loss is one process's on the same rows."""
    helpers = _helpers()
    trained = request.getfixturevalue("trained")
    outcome, out = trained[(combo.world_size, combo.name)]
    assert outcome == "ok", f"{combo.name} on {combo.world_size} ranks: {outcome}"
    reference_outcome, reference = trained[(1, _reference_name(combo.reference()))]
    assert reference_outcome == "ok", reference_outcome
    expected, got = helpers.losses_by_step(reference), helpers.losses_by_step(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert abs(got[step] - expected[step]) <= LOSS_TOLERANCE * abs(expected[step]), (
            step, got, expected,
        )  # fmt: skip


if __name__ == "__main__":
    _run_worker()
