"""Which parallel layouts the trainer runs: one rule, :func:`check_layout`.

Config validation (every stage of a recipe, before any step), ``llmflow plan`` (every candidate
layout), preflight's layout rehearsal and the trainer (before it joins the process group) all
ask it, so a layout one of them accepts, the others accept too. A refusal is a ``ConfigError``
naming the field, its value and the rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmflow.tasks.framework.errors import ConfigError

if TYPE_CHECKING:
    from llmflow.model.config import ModelConfig
    from llmflow.tasks.pretrain.config import TrainConfig
    from llmflow.tasks.pretrain.parallel.config import Layout

PARALLEL_FIELD = "pretrain.train.parallel"
MICRO_BATCHES_FIELD = "pretrain.train.batch.grad_accum_steps"


@dataclass(frozen=True)
class StageShape:
    """What one stage asks of its layout, and the fields that set it (named in a refusal)."""

    seq_len: int | None = None
    """Tokens per row; None: not known here."""
    micro_batches: int | None = None
    """Micro-batches per optimizer step (the accumulation, the pipeline schedule's count)."""
    seq_len_field: str = "seq_len"
    micro_batches_field: str = MICRO_BATCHES_FIELD


def check_layout(
    layout: Layout,
    model: ModelConfig | None = None,
    *,
    optimizer: str | None = None,
    compile: bool = False,
    stages: Iterable[StageShape] = (),
    field: str = PARALLEL_FIELD,
) -> None:
    """Refuse a layout the trainer cannot run, before any compute.

    Args:
        layout: The resolved degrees (``ParallelConfig.resolve`` checked them against the
            world size).
        model: The architecture; None skips its checks (an ``init`` model not read yet).
        optimizer: ``optimizer.name``; None skips its checks (every optimizer runs on every
            layout today: Muon orthogonalizes whole matrices under FSDP2, TP and HSDP).
        compile: ``train.compile`` (blocks compiled with ``torch.compile``).
        stages: Each stage's sequence length and micro-batches per step on this layout.
        field: Where the layout is set: ``pretrain.train.parallel`` or an extension stage's.

    Raises:
        ConfigError: An unsupported combination (CP with PP, TP with compile, TP with
            ``model.qk_norm``, TP with PP and tied embeddings; EP with anything but FSDP2,
            with compile or Muon, on a dense model), a degree that does not divide
            the model (TP: heads, KV heads, intermediate and vocabulary sizes; PP: layers) or
            a stage (CP: ``seq_len`` by 2 x cp; TP: ``seq_len`` by cp x tp; PP: fewer
            micro-batches than stages; EP: ``dp_shard`` and the experts); the message names
            the fields.
    """
    _check_combination(layout, compile, field)
    _check_ep(layout, compile, field)
    if model is not None:
        _check_model(layout, model, field)
    for stage in stages:
        _check_stage(layout, stage, field)


def _check_combination(layout: Layout, compile: bool, field: str) -> None:
    if layout.cp > 1 and layout.pp > 1:
        # NOTE: pipeline stages (pp.py) derive document masks from the positions they receive
        # and take no SequenceShard, so a shard's attention would be wrong, not slow.
        raise ConfigError(
            f"{field}.cp={layout.cp} with pp={layout.pp}: pipeline stages do not take a "
            "context-parallel shard yet; use cp or pp, not both"
        )
    if layout.tp > 1 and compile:
        # NOTE: torch 2.13, blocks compiled after the TP plan: the backward of the sequence
        # all-gather receives a plain tensor ('Tensor' object has no attribute '_local_tensor').
        raise ConfigError(
            f"{field}.tp={layout.tp} with pretrain.train.compile=true: compiled blocks do not "
            "work with tensor parallelism yet; set compile false or tp 1"
        )


def _check_ep(layout: Layout, compile: bool, field: str) -> None:
    """Expert parallelism (parallel/ep.py): carved from ``dp_shard``, with FSDP2 and nothing
    else yet."""
    ep = layout.ep
    if ep == 1:
        return
    if layout.dp_shard % ep:
        raise ConfigError(
            f"{field}.ep={ep} does not divide dp_shard={layout.dp_shard} (the expert-parallel "
            "ranks are carved from the FSDP2 ranks: dp_shard = dp_shard_mod_ep x ep)"
        )
    others = {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp}
    others["dp_replicate"] = layout.dp_replicate
    for name, degree in others.items():
        if degree > 1:
            # NOTE: the dispatcher exchanges whole (unsharded) token rows over the EP group; TP's
            # sequence shards, CP's load-balanced chunks, a pipeline stage's schedule and HSDP's
            # replicated expert shards are not wired to it (nor tested).
            raise ConfigError(
                f"{field}.ep={ep} with {name}={degree}: expert parallelism runs with FSDP2 "
                "(dp_shard) only yet; set tp, cp, pp and dp_replicate to 1"
            )
    if compile:
        raise ConfigError(
            f"{field}.ep={ep} with pretrain.train.compile=true: compiled blocks are not tested "
            "with the expert all-to-all yet; set compile false or ep 1"
        )


def _check_model(layout: Layout, model: ModelConfig, field: str) -> None:
    if layout.ep > 1:
        if not model.num_experts:
            raise ConfigError(
                f"{field}.ep={layout.ep} needs a mixture-of-experts model; the model is dense "
                "(model.num_experts=0)"
            )
        if model.num_experts % layout.ep:
            raise ConfigError(
                f"{field}.ep={layout.ep} does not divide the model's "
                f"num_experts={model.num_experts}"
            )
    if layout.tp > 1 and model.num_experts:
        # NOTE: tp.apply_tp plans the dense MLP's projections; a sparse layer's router and
        # 3-D experts under sequence parallelism are not planned (torchtitan shards them with
        # expert-tensor parallelism, which we do not have).
        raise ConfigError(
            f"{field}.tp={layout.tp} with model.num_experts={model.num_experts}: tensor "
            "parallelism does not shard mixture-of-experts layers yet; use tp 1 (and ep for "
            "the experts)"
        )
    if layout.tp > 1:
        for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            size = getattr(model, name)
            if size % layout.tp:
                raise ConfigError(
                    f"{field}.tp={layout.tp} does not divide the model's {name}={size}"
                )
        if model.qk_norm:
            # NOTE: q_norm/k_norm act on this rank's heads only: their gradients would need a
            # sum over the TP group that no DTensor placement gives here.
            raise ConfigError(
                f"{field}.tp={layout.tp} with model.qk_norm=true: tensor parallelism does not "
                "support QK-norm yet; use tp 1"
            )
    if layout.tp > 1 and layout.pp > 1 and model.tie_embeddings:
        # NOTE: the first stage's embedding is vocabulary-sharded by TP, the last stage's copy
        # of it (the output projection) is not: summing their gradients over the tied group
        # sends tensors of different sizes (gloo: "Received data size doesn't match expected
        # size", tp=2 x pp=2 on the debug model).
        raise ConfigError(
            f"{field}.tp={layout.tp} with pp={layout.pp} and model.tie_embeddings=true: the "
            "tied embedding's gradients cannot be summed across TP-sharded stages yet; untie "
            "the embeddings or use tp or pp, not both"
        )
    if model.num_layers < layout.pp:
        raise ConfigError(
            f"{field}.pp={layout.pp} exceeds the model's num_layers={model.num_layers} "
            "(each pipeline stage needs at least one layer)"
        )


def _check_stage(layout: Layout, stage: StageShape, field: str) -> None:
    cp, seq_len = layout.cp, stage.seq_len
    if cp > 1 and seq_len is not None and seq_len % (2 * cp):
        raise ConfigError(
            f"{field}.cp={cp}: {stage.seq_len_field}={seq_len} must be divisible by 2 x cp = "
            f"{2 * cp} (each rank holds one chunk from the start and one from the end)"
        )
    tp = layout.tp
    if tp > 1 and seq_len is not None and seq_len % (cp * tp):
        # NOTE: sequence parallelism cuts each rank's seq_len / cp tokens into tp equal parts;
        # uneven parts fail in the first all-gather (tp=2 at seq_len 33: "The size of tensor a
        # (34) must match the size of tensor b (33)").
        raise ConfigError(
            f"{field}.tp={tp}: {stage.seq_len_field}={seq_len} must be divisible by cp x tp = "
            f"{cp * tp} (sequence parallelism splits each rank's tokens over the TP ranks)"
        )
    micro_batches = stage.micro_batches
    if layout.pp > 1 and micro_batches is not None and micro_batches < layout.pp:
        raise ConfigError(
            f"{field}.pp={layout.pp} needs at least {layout.pp} micro-batches per step; "
            f"{stage.micro_batches_field}={micro_batches}"
        )


# ------------------------------------------------------------------------------ a recipe's stages
@dataclass(frozen=True)
class RecipeStage:
    """One training stage of a recipe as it runs: its trainer config and where it is set."""

    name: str
    train: TrainConfig
    shape: StageShape
    parallel_field: str


def recipe_stages(pretrain: Any, extend: Any) -> list[RecipeStage]:
    """Each pretraining stage and each context-extension stage, in run order.

    ``pretrain`` is a ``PretrainConfig``, ``extend`` an ``ExtendConfig``. A stage's fields are
    the override paths that set its layout, sequence length and accumulation.
    """
    from llmflow.tasks.extend.config import extension_train_config

    train = pretrain.train
    accumulation = train.batch.grad_accum_steps
    stages = [
        RecipeStage(
            s.name,
            train,
            StageShape(s.mixture.seq_len, accumulation, f"pretrain.stages.{i}.mixture.seq_len"),
            PARALLEL_FIELD,
        )
        for i, s in enumerate(pretrain.stages)
    ]
    for i, s in enumerate(extend.stages):
        where = f"extend.stages.{i}"
        stage_train = extension_train_config(train, s)
        shape = StageShape(
            s.seq_len,
            stage_train.batch.grad_accum_steps,
            f"{where}.seq_len",
            MICRO_BATCHES_FIELD if s.grad_accum_steps is None else f"{where}.grad_accum_steps",
        )
        field = PARALLEL_FIELD if s.parallel is None else f"{where}.parallel"
        stages.append(RecipeStage(f"extension {i + 1}", stage_train, shape, field))
    return stages


def check_recipe_layouts(pretrain: Any, extend: Any, *, with_model: bool = True) -> None:
    """Every stage's layout at the recipe's world size (``pretrain.num_processes``, or the Ray
    workers), through :func:`check_layout`.

    Args:
        with_model: False skips the architecture's checks (an ``init`` model replaces
            ``pretrain.train.model`` when the recipe is built; checked again then).

    Raises:
        ConfigError: The first stage whose layout the trainer would refuse, naming the field.
    """
    world = pretrain.world_size
    for stage in recipe_stages(pretrain, extend):
        train = stage.train
        layout = train.parallel.resolve(world, field=stage.parallel_field)
        check_layout(
            layout,
            train.model_config_obj() if with_model else None,
            optimizer=train.optimizer.name,
            compile=train.compile,
            stages=[stage.shape],
            field=stage.parallel_field,
        )
