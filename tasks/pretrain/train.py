"""The pretraining loop: one process of a run on a CPU, one GPU, or FSDP2 over many.

Run it as its own process (never imports Prefect)::

    python -m llmflow.tasks.pretrain.train --config cfg.json --data-dir D --out-dir O [--val-dir V]
    torchrun --nproc_per_node 2 -m llmflow.tasks.pretrain.train ...      # CPU (gloo) or GPU (nccl)
    accelerate launch --config_file deployments/accelerate/multi_gpu_fsdp2.yaml \
        -m llmflow.tasks.pretrain.train ...

``out_dir`` may hold a previous attempt: training resumes exactly from its latest checkpoint.

The train step (forward, backward, clip, step, schedule) is :meth:`Trainer.train_step`; everything
with a cadence (logging, validation, checkpointing, preemption, the stability guard, test fault
injection) is a component in ``Trainer.callbacks`` whose hooks the loop calls (``callbacks.py``).

Exit codes: 0 done; 75 (``PREEMPTED_EXIT_CODE``) stopped by SIGTERM after saving a checkpoint
(``preemption.py``; a retry resumes it); anything else is a failure.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmflow.model.kernels import chosen_kernels
from llmflow.model.loss import IGNORE_INDEX
from llmflow.model.transformer import Transformer
from llmflow.tasks.dataprep.loader import PackedLoader
from llmflow.tasks.pretrain.callbacks import Callback, MetricsLogger, RankInfo, Validator
from llmflow.tasks.pretrain.checkpointer import Checkpointer
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.detectors import StallDetector, ThroughputDetector
from llmflow.tasks.pretrain.distributed import (
    launched_world_size,
    materialize_sharded,
    param_checksum,
    setup_runtime,
    teardown_runtime,
)
from llmflow.tasks.pretrain.faults import FaultInjector
from llmflow.tasks.pretrain.guard import StabilityGuard
from llmflow.tasks.pretrain.health import LayerStats, StepClock
from llmflow.tasks.pretrain.init_weights import is_weights_only, load_weights
from llmflow.tasks.pretrain.launch import die_with_launcher, failure_report
from llmflow.tasks.pretrain.moe_balance import MoEBalance
from llmflow.tasks.pretrain.optim import build_optimizers, set_lr
from llmflow.tasks.pretrain.parallel.mesh import build_mesh
from llmflow.tasks.pretrain.parallel.parts import Parallelism
from llmflow.tasks.pretrain.preemption import Preemption
from llmflow.tasks.pretrain.schedule import lr_multiplier, micro_batch_size, steps_for_tokens
from llmflow.tasks.pretrain.state import StepOutput, TrainState
from llmflow.tasks.pretrain.state_registry import Info, RngState, StateRegistry
from llmflow.tasks.pretrain.validate import check_data, check_world_size
from llmflow.tasks.summaries import PretrainSummary

# Dense bf16 peak FLOP/s per GPU, for MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


class Trainer:
    """Owns the model, optimizers, data, run state and components of one process."""

    def __init__(
        self,
        cfg: TrainConfig,
        data_dir: Path,
        out_dir: Path,
        val_dir: Path | None = None,
        init_from: Path | None = None,
    ) -> None:
        self.cfg, self.out_dir, self.data_dir = cfg, Path(out_dir), Path(data_dir)
        self.model_config = cfg.model_config_obj()
        # NOTE: before joining the process group: a layout that does not fit fails at once.
        self.layout = cfg.parallel.resolve(
            launched_world_size(), self.model_config, check_data(cfg, data_dir)["seq_len"],
            cfg.batch.grad_accum_steps, optimizer=cfg.optimizer.name, compile=cfg.compile,
        )  # fmt: skip
        self.runtime = rt = setup_runtime()
        if cfg.deterministic and rt.device.type == "cpu":
            torch.use_deterministic_algorithms(True)
        check_world_size(cfg, rt.world_size)
        if val_dir is not None:
            check_data(cfg, val_dir, role="val_dir")
        self.mesh = build_mesh(rt.device.type, self.layout) if rt.distributed else None
        self.dp_rank = self.mesh.dp_rank if self.mesh is not None else 0
        self.compute_dtype = cfg.compute_dtype(rt.device.type)
        # how this rank builds, steps, evaluates and exports the model (parallel/parts.py)
        self.parallel = Parallelism(self.layout, self.mesh, rt, cfg, self.compute_dtype)
        self.model = self._build_model()
        self.optimizers = build_optimizers(self.model, cfg.optimizer)
        self.base_lrs = [[g["base_lr"] for g in o.param_groups] for o in self.optimizers]
        self.loss_fn = functools.partial(model_loss, z_loss_weight=cfg.z_loss)
        # NOTE: the tensor/context/pipeline-parallel ranks of one data-parallel rank read the
        # same sequences; the global batch is micro_batch_size x grad_accum x layout.dp.
        self.loader = PackedLoader(
            data_dir, cfg.batch.micro_batch_size, self.dp_rank, self.layout.dp, seed=cfg.seed
        )
        self.state = TrainState()
        self.guard = StabilityGuard(cfg.guard, cfg.monitor)
        self.checkpointer = Checkpointer(cfg.checkpoint, self.out_dir)
        self.clock = StepClock()  # where the step's time goes (health.py)
        self.layer_stats = LayerStats(self, cfg.monitor.layer_stats_every)
        self.callbacks = self._components(val_dir)
        self.registry = self._state_registry()
        self._start(init_from)

    # ----------------------------------------------------------------------------- setup
    def _build_model(self) -> torch.nn.Module:
        """Build on the meta device, parallelize (PP stage, TP, activation checkpointing,
        compile, FSDP2), then allocate and init (seeded).

        No rank ever holds the full weights: each draws only its shard's rows of the seeded
        init, which equals a one-process ``init_weights(seed)``.
        """
        with torch.device("meta"):
            model = Transformer(self.model_config)
        model = self.parallel.parallelize(model)
        self.matmul_dtype: str | None = None  # seen in the first forward (ranks/*.json)
        if not self.cfg.compile:  # NOTE: a hook inside a compiled block would be traced into it
            self._watch_matmul_dtype(model)
        materialize_sharded(model, self.runtime, self.cfg.seed)
        self.init_checksum = param_checksum(model)
        self.parallel.attach(model)  # PP: the stage's schedule runner (collective)
        return model

    def dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data- and context-parallel ranks (in place; returns it)."""
        return self.parallel.dp_sum(value)

    def _watch_matmul_dtype(self, model: torch.nn.Module) -> None:
        """Record the dtype the first block's first projection computes in (bf16 or float32)."""
        linear = next(m for m in model.layers[0].modules() if isinstance(m, torch.nn.Linear))

        def hook(module, args, output) -> None:
            self.matmul_dtype = str(output.dtype).removeprefix("torch.")
            handle.remove()

        handle = linear.register_forward_hook(hook)

    def _components(self, val_dir: Path | None) -> list[Callback]:
        """The components in hook order; the fault injector only under ``LLMFLOW_FAULTS``.

        The detectors (rank 0) come after the logger: they judge the row it just wrote.
        """
        main, monitor, stage = self.runtime.is_main, self.cfg.monitor, self.out_dir.name
        self.moe_balance = MoEBalance.build(self)  # None for a dense model (moe_balance.py)
        found: list[Callback | None] = [
            self.guard,
            self.moe_balance,
            Validator(val_dir, self.cfg.eval_interval) if val_dir is not None else None,
            MetricsLogger(self.cfg, self.out_dir) if main else None,
            ThroughputDetector(monitor, self.out_dir, stage) if main else None,
            StallDetector(monitor, self.out_dir, stage) if main else None,
            self.checkpointer,
            Preemption(self.cfg.checkpoint.preempt_grace_s),
            RankInfo(self.out_dir),
            FaultInjector.from_env(),
        ]
        return [c for c in found if c is not None]

    def _state_registry(self) -> StateRegistry:
        """What a checkpoint holds besides the model and optimizer tensors: the run counters,
        the optimizer's name and the world size (rank 0), each rank's RNG and data position,
        and every component that declares a ``state_key`` (the guard, the detectors)."""
        registry = StateRegistry()
        registry.register("train", self.state)
        registry.register("optimizer", Info(lambda: self.cfg.optimizer.name))
        registry.register("world_size", Info(lambda: self.runtime.world_size))
        registry.register("rng", RngState(), per_rank=True)
        registry.register("loader", self.loader, per_rank=True)
        registry.register_components(self.callbacks)
        return registry

    def _start(self, init_from: Path | None) -> None:
        """Resume this run's latest checkpoint, else start from init_from, else fresh."""
        if self.checkpointer.resume(self) is not None:
            return
        self.seed_rng()
        if init_from is not None and is_weights_only(init_from):  # an imported model
            load_weights(self, init_from)
        elif init_from is not None:
            self.checkpointer.initialise(self, init_from)
        self.state.end_step = self.state.start_step + self._stage_steps()

    def seed_rng(self) -> None:
        """Runtime RNG (dropout, sampling): differs per rank on purpose."""
        seed = self.cfg.seed * 1000 + self.runtime.rank
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def reset_base_lrs(self) -> None:
        """A loaded optimizer state carries the old run's LRs; the config's LRs win."""
        for optimizer, lrs in zip(self.optimizers, self.base_lrs, strict=True):
            for group, lr in zip(optimizer.param_groups, lrs, strict=True):
                group["base_lr"] = lr

    def _stage_steps(self) -> int:
        if self.cfg.max_steps is not None:
            return self.cfg.max_steps
        return steps_for_tokens(
            self.cfg.num_tokens,
            self.cfg.batch,
            self.loader.seq_len,
            self.layout.dp,
            self.state.start_step,
        )

    # ----------------------------------------------------------------------------- the step
    def train_step(self) -> StepOutput | None:
        """One optimizer step on the next global batch; None when the guard refused it."""
        started, step, clock = time.perf_counter(), self.state.step, self.clock
        first = self.state.batches_drawn
        with clock.timing("data"):
            batches = self.next_batches(step)
        with clock.timing("compute"):
            loss, num_tokens = self.forward_backward(batches)
        layers = self.layer_stats if self.layer_stats.due(step) else None
        if layers is not None:
            layers.before_update()
        with clock.timing("optimizer"):
            grad_norm = self.clip_gradients()
        if not self.guard.admit(self, loss, grad_norm, [first, self.state.batches_drawn]):
            self.state.train_time_s += time.perf_counter() - started
            return None
        with clock.timing("optimizer"):
            lr = self.optimizer_step(step)
        if layers is not None:
            layers.after_update()
            self.guard.remember_layers(layers.last_grad_norms, layers.last_weight_norms)
        self.state.advance(loss, num_tokens)
        seconds = time.perf_counter() - started
        self.state.train_time_s += seconds
        return StepOutput(step + 1, loss, grad_norm, lr, num_tokens, seconds, batches[0])

    def next_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """Draw this step's micro-batches (resizing them under batch-size warmup)."""
        size = micro_batch_size(step, self.cfg.batch)
        if size != self.loader.batch_size:
            self.loader.set_batch_size(size)
        batches = [self.loader.next_batch() for _ in range(self.cfg.batch.grad_accum_steps)]
        self.state.batches_drawn += len(batches)
        return batches

    def forward_backward(self, batches: list[dict]) -> tuple[float, int]:
        """Accumulate gradients of the token-mean loss over the global batch.

        Returns the global mean loss and the global number of tokens.
        """
        batches = self.parallel.local_batches(batches)  # CP: this rank's T/cp tokens (cp.py)
        counts = [int((b["labels"] != IGNORE_INDEX).sum()) for b in batches]
        totals = torch.tensor(
            [sum(counts), sum(b["input_ids"].numel() for b in batches)],
            dtype=torch.float64,
            device=self.runtime.device,
        )
        num_valid, num_tokens = self.dp_sum(totals).tolist()
        loss_sum = self.parallel.forward_backward(
            self.model, self.loss_fn, batches, counts, num_valid
        )
        return self.dp_sum(loss_sum).item() / max(num_valid, 1), int(num_tokens)

    def clip_gradients(self) -> float:
        """Clip the (possibly sharded) gradients; return the global norm before clipping."""
        max_norm = self.cfg.optimizer.grad_clip or float("inf")
        return self.parallel.clip_grad_norm_(self.model, max_norm)

    def optimizer_step(self, step: int) -> float:
        """Apply the schedule's LR and step every optimizer; return the LR of group 0."""
        set_lr(self.optimizers, self.lr_multiplier(step) * self.guard.lr_scale)
        for optimizer in self.optimizers:
            optimizer.step()
        self.zero_grad()
        return self.optimizers[-1].param_groups[0]["lr"]

    def lr_multiplier(self, step: int) -> float:
        """The schedule at ``step``: over the whole run, or over this stage (``per_stage``)."""
        schedule, state = self.cfg.schedule, self.state
        if schedule.per_stage:
            start = state.start_step
            return lr_multiplier(step - start, schedule, state.end_step - start)
        return lr_multiplier(step, schedule, schedule.total_steps or state.end_step)

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    # ----------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        """Train until the stage's last step; write final/ and summary.json; return summary."""
        self._hook("on_train_start")
        self.model.train()
        while self.state.step < self.state.end_step:
            self._hook("on_step_start", self.state.step)
            out = self.train_step()
            if out is not None:
                self._hook("on_step_end", out)
        self._hook("on_train_end")
        summary = self.summary()
        if self.runtime.is_main:
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _hook(self, name: str, *args: Any) -> None:
        for callback in self.callbacks:
            part = _CLOCKED.get(type(callback))  # time outside the step that blocks training
            if part is None:
                getattr(callback, name)(self, *args)
                continue
            with self.clock.timing(part):
                getattr(callback, name)(self, *args)

    def summary(self) -> dict[str, Any]:
        """Headline metrics (JSON scalars) for summary.json."""
        state, recent = self.state, self.state.recent_losses
        by_domain = state.val_loss_by_domain
        return PretrainSummary.written(
            {
                "final_loss": sum(recent) / len(recent) if recent else None,
                "last_loss": recent[-1] if recent else None,
                "val_loss": state.val_loss,
                "steps": state.step,
                "stage_steps": state.step - state.start_step,
                "tokens_seen": state.tokens_seen,
                "total_tokens_seen": state.total_tokens_seen,
                "tokens_per_s": state.tokens_seen / max(state.train_time_s, 1e-9),
                "skipped_batches": self.guard.num_skipped,
                "guard_events": self.guard.num_events,
                "rewinds": self.guard.num_rewinds,
                "world_size": self.runtime.world_size,
                "precision": "bf16" if self.compute_dtype == torch.bfloat16 else "fp32",
                # the kernels attention ran (model/kernels.py): sdpa-causal, sdpa-buckets, ...
                "attention": chosen_kernels(),
                # NOTE: only when measured: other stages' summary.json stay as they were
                **({"val_loss_by_domain": by_domain} if by_domain is not None else {}),
                **(self.moe_balance.summary() if self.moe_balance is not None else {}),
            }
        )

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilisation on GPU (6N + attention per token, N the parameters a token
        goes through: a mixture of experts counts its active experts); None on CPU."""
        if self.runtime.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.runtime.device)
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
        if peak is None:
            return None
        mc = self.model_config
        active = mc.active_parameters(non_embedding=True) + mc.vocab_size * mc.hidden_size
        flops = 6 * active + 12 * mc.num_layers * mc.hidden_size * self.loader.seq_len
        return flops * tokens_per_s / (peak * self.runtime.world_size)


_CLOCKED = {Checkpointer: "checkpoint", Validator: "validation"}


def model_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], z_loss_weight: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch, the output projection fused into it (no logits kept twice).

    Equal to ``causal_lm_loss(model(...), labels)`` up to float rounding.
    """
    ids, positions, cu_seqlens = batch["input_ids"], batch["position_ids"], batch["cu_seqlens"]
    return model(
        ids,
        positions,
        cu_seqlens,
        labels=batch["labels"],
        z_loss_weight=z_loss_weight,
        context=batch.get("context"),  # context parallel: the shard's place in its rows
    )


def run(
    cfg: TrainConfig,
    data_dir: Path,
    out_dir: Path,
    val_dir: Path | None = None,
    init_from: Path | None = None,
) -> dict[str, Any]:
    """Train in this process (one rank); return the summary."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    try:
        return Trainer(cfg, data_dir, out_dir, val_dir, init_from).fit()
    finally:
        teardown_runtime()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="TrainConfig JSON or YAML")
    parser.add_argument("--data-dir", type=Path, required=True, help="packed training data")
    parser.add_argument("--out-dir", type=Path, required=True, help="run folder (resumable)")
    parser.add_argument("--val-dir", type=Path, default=None, help="packed held-out data")
    parser.add_argument("--init-from", type=Path, default=None, help="previous stage's run")
    args = parser.parse_args(argv)
    die_with_launcher()  # a killed worker never leaves this process writing into --out-dir
    with failure_report(args.out_dir):  # why it failed, for the launcher: retry or not
        cfg = TrainConfig.load(args.config)
        summary = run(cfg, args.data_dir, args.out_dir, args.val_dir, args.init_from)
    if int(os.environ.get("RANK", "0")) == 0:
        print("summary: " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
