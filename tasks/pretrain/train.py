"""The pretraining loop: one process of a run on a CPU, one GPU, or FSDP2 over many.

Run it as its own process (never imports Prefect)::

    python -m llmflow.tasks.pretrain.train --config cfg.json --data-dir D --out-dir O [--val-dir V]
    torchrun --nproc_per_node 2 -m llmflow.tasks.pretrain.train ...      # CPU (gloo) or GPU (nccl)
    accelerate launch --config_file deployments/accelerate/multi_gpu_fsdp2.yaml \
        -m llmflow.tasks.pretrain.train ...

``out_dir`` may hold a previous attempt: training resumes exactly from its latest checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from llmflow.model.hf import save_model
from llmflow.model.loss import IGNORE_INDEX, causal_lm_loss
from llmflow.model.transformer import Transformer
from llmflow.tasks.dataprep.loader import PackedLoader
from llmflow.tasks.pretrain import checkpoint as ckpt
from llmflow.tasks.pretrain.callbacks import MetricsLogger, log_event
from llmflow.tasks.pretrain.config import TrainConfig
from llmflow.tasks.pretrain.distributed import (
    all_reduce_sum,
    param_checksum,
    setup_runtime,
    shard_model,
    sharding_report,
    teardown_runtime,
)
from llmflow.tasks.pretrain.guard import StabilityGuard
from llmflow.tasks.pretrain.optim import build_optimizers, set_lr
from llmflow.tasks.pretrain.schedule import lr_multiplier, micro_batch_size, steps_for_tokens
from llmflow.tasks.pretrain.validate import check_data, check_source, check_world_size

# Dense bf16 peak FLOP/s per GPU, for MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


class Trainer:
    """Owns the model, optimizers, data and run state of one process."""

    def __init__(
        self,
        cfg: TrainConfig,
        data_dir: Path,
        out_dir: Path,
        val_dir: Path | None = None,
        init_from: Path | None = None,
    ) -> None:
        self.cfg, self.out_dir, self.val_dir = cfg, Path(out_dir), val_dir
        self.runtime = rt = setup_runtime()
        if cfg.deterministic and rt.device.type == "cpu":
            torch.use_deterministic_algorithms(True)
        check_world_size(cfg, rt.world_size)
        self.meta = check_data(cfg, data_dir)
        if val_dir is not None:
            check_data(cfg, val_dir, role="val_dir")
        self.model_config = cfg.model_config_obj()
        self.model = self._build_model()
        self.optimizers = build_optimizers(self.model, cfg.optimizer)
        self.base_lrs = [[g["base_lr"] for g in o.param_groups] for o in self.optimizers]
        self.guard = StabilityGuard(cfg.guard)
        self.loader = PackedLoader(
            data_dir, cfg.batch.micro_batch_size, rt.rank, rt.world_size, seed=cfg.seed
        )
        self.state: dict[str, Any] = {
            "step": 0,
            "start_step": 0,
            "end_step": 0,
            "tokens_seen": 0,
            "batches_drawn": 0,
            "train_time_s": 0.0,
            "recent_losses": [],
            "val_loss": None,
        }
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if rt.device.type == "cuda" and not rt.distributed
            else contextlib.nullcontext()
        )
        self.resumed_from: Path | None = None
        self._fired_debug: set[int] = set()
        self._restore(init_from)

    # ----------------------------------------------------------------------------- setup
    def _build_model(self) -> torch.nn.Module:
        """Same weights on every rank (one seed), then shard (FSDP2) or move to the device."""
        rt = self.runtime
        model = Transformer(self.model_config)
        model.init_weights(seed=self.cfg.seed)
        self.init_checksum = param_checksum(model)
        if self.cfg.compile:  # per block, before sharding, as torchtitan does
            for block in model.layers:
                block.compile()
        if rt.distributed:
            shard_model(model, rt)
        else:
            model.to(rt.device)
        return model

    def _seed_rng(self) -> None:
        """Runtime RNG (dropout, sampling): differs per rank on purpose."""
        seed = self.cfg.seed * 1000 + self.runtime.rank
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def _restore(self, init_from: Path | None) -> None:
        """Resume from out_dir's latest checkpoint, else start from init_from, else fresh."""
        if self.runtime.is_main:
            ckpt.clean_tmp(self.out_dir)
        ckpt.barrier()
        latest = ckpt.latest_checkpoint(self.out_dir)
        if latest is not None:
            self._load(latest, resume=True)
            self.resumed_from = latest
            print(f"resumed from {latest} at step {self.state['step']}", flush=True)
            return
        self._seed_rng()
        if init_from is not None:
            source = ckpt.resolve_init_from(init_from)
            self._load(source, resume=False)
            self.state.update(
                start_step=self.state["step"],
                tokens_seen=0,
                train_time_s=0.0,
                recent_losses=[],
                val_loss=None,
                batches_drawn=0,
            )
            print(f"initialised from {source} at step {self.state['step']}", flush=True)
        self.state["end_step"] = self.state["start_step"] + self._stage_steps()

    def _load(self, path: Path, resume: bool) -> None:
        check_source(self.cfg, path)
        trainer_state, rank_state = ckpt.load_checkpoint(path, self.model, self.optimizers)
        self._reset_base_lrs()
        self.state.update(trainer_state["train"])
        if not resume:
            return
        self.guard.load_state_dict(trainer_state["guard"])
        if rank_state is None:  # NOTE: written by another world size: the data restarts.
            print("checkpoint from another world size: data loader restarts", flush=True)
            self._seed_rng()
            return
        ckpt.set_rng_state(rank_state["rng"])
        self.loader.load_state_dict(rank_state["loader"])

    def _reset_base_lrs(self) -> None:
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
            self.runtime.world_size,
            self.state["start_step"],
        )

    @property
    def total_steps(self) -> int:
        return self.cfg.schedule.total_steps or self.state["end_step"]

    # ----------------------------------------------------------------------------- the step
    def next_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """Draw this step's micro-batches (resizing them under batch-size warmup)."""
        size = micro_batch_size(step, self.cfg.batch)
        if size != self.loader.batch_size:
            self.loader.set_batch_size(size)
        batches = [self.loader.next_batch() for _ in range(self.cfg.batch.grad_accum_steps)]
        self.state["batches_drawn"] += len(batches)
        return batches

    def forward_backward(self, batches: list[dict], step: int) -> tuple[float, int]:
        """Accumulate gradients of the token-mean loss over the global batch.

        Returns the global mean loss and the global number of tokens.
        """
        rt = self.runtime
        counts = [int((b["labels"] != IGNORE_INDEX).sum()) for b in batches]
        totals = torch.tensor(
            [sum(counts), sum(b["input_ids"].numel() for b in batches)],
            dtype=torch.float64,
            device=rt.device,
        )
        num_valid, num_tokens = all_reduce_sum(totals, rt).tolist()
        loss_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
        for batch, count in zip(batches, counts, strict=True):
            batch = {k: v.to(rt.device, non_blocking=True) for k, v in batch.items()}
            with self.autocast:
                logits = self.model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
            loss, _ = causal_lm_loss(logits, batch["labels"], self.cfg.z_loss)
            loss = loss * self._debug_scale(step)
            # NOTE: FSDP averages gradients over ranks; weighting by this micro-batch's share
            # of the global tokens times world_size makes the result the global token mean.
            (loss * (count * rt.world_size / max(num_valid, 1))).backward()
            loss_sum += loss.detach().double() * count
        return all_reduce_sum(loss_sum, rt).item() / max(num_valid, 1), int(num_tokens)

    def clip_gradients(self) -> float:
        """Clip the (possibly sharded) gradients; return the global norm before clipping."""
        max_norm = self.cfg.optimizer.grad_clip or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def optimizer_step(self, step: int) -> float:
        """Apply the schedule's LR and step every optimizer; return the LR of group 0."""
        if self.cfg.schedule.per_stage:
            start = self.state["start_step"]
            multiplier = lr_multiplier(
                step - start, self.cfg.schedule, self.state["end_step"] - start
            )
        else:
            multiplier = lr_multiplier(step, self.cfg.schedule, self.total_steps)
        set_lr(self.optimizers, multiplier * self.guard.lr_scale)
        for optimizer in self.optimizers:
            optimizer.step()
        self.zero_grad()
        return self.optimizers[-1].param_groups[0]["lr"]

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def _debug_scale(self, step: int) -> float:
        """Fault injection for tests: scale one step's loss, once per process."""
        debug = self.cfg.debug
        if step in debug.scale_loss_at_steps and step not in self._fired_debug:
            self._fired_debug.add(step)
            return debug.loss_scale
        return 1.0

    # ----------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        """Train until the stage's last step; write final/ and summary.json; return summary."""
        rt, cfg = self.runtime, self.cfg
        logger = (
            MetricsLogger(cfg, self.out_dir, self.state["step"], self.state["end_step"])
            if rt.is_main
            else None
        )
        if cfg.guard.policy == "rewind" and ckpt.latest_checkpoint(self.out_dir) is None:
            self.save(self.out_dir / "checkpoints" / ckpt.step_dir_name(self.state["step"]))
        recent = deque(self.state["recent_losses"], maxlen=10)
        self.model.train()
        first = True
        tick, interval_tokens = time.perf_counter(), 0
        while self.state["step"] < self.state["end_step"]:
            step = self.state["step"]
            batch_start = self.state["batches_drawn"]
            batches = self.next_batches(step)
            if first:
                self._write_rank_info(batches[0])
                first = False
            loss, num_tokens = self.forward_backward(batches, step)
            grad_norm = self.clip_gradients()
            kind, zscore = self.guard.check(loss, grad_norm)
            if kind != "ok":
                self._on_guard_event(
                    kind, step, loss, grad_norm, zscore, [batch_start, self.state["batches_drawn"]]
                )
                recent = deque(self.state["recent_losses"], maxlen=10)
                continue
            lr = self.optimizer_step(step)
            self.guard.accept(loss)
            recent.append(loss)
            interval_tokens += num_tokens
            self.state.update(
                step=step + 1,
                tokens_seen=self.state["tokens_seen"] + num_tokens,
                recent_losses=list(recent),
            )
            step += 1
            if logger is not None:
                logger.advance()
            if (
                step % cfg.log_interval == 0
                or step % cfg.eval_interval == 0
                or step == self.state["end_step"]
            ):
                elapsed = time.perf_counter() - tick
                self.state["train_time_s"] += elapsed
                row = self._metrics_row(step, loss, grad_norm, lr, interval_tokens, elapsed)
                if self.val_dir is not None and (
                    step % cfg.eval_interval == 0 or step == self.state["end_step"]
                ):
                    row["val_loss"] = self.state["val_loss"] = self.evaluate()
                if logger is not None:
                    logger.log(row)
                tick, interval_tokens = time.perf_counter(), 0
            if step % cfg.checkpoint.interval == 0 and step < self.state["end_step"]:
                paused = time.perf_counter()
                self.save(self.out_dir / "checkpoints" / ckpt.step_dir_name(step))
                tick += time.perf_counter() - paused  # saving is not training time
            if cfg.debug.crash_after_step == step:
                print(f"debug: crashing after step {step}", flush=True)
                os._exit(3)
        if self.resumed_from is None or self.resumed_from.name != "final":
            self.save(self.out_dir / "final", final=True)
        summary = self.summary()
        if rt.is_main:
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            logger.close()
        return summary

    def _metrics_row(
        self, step: int, loss: float, grad_norm: float, lr: float, tokens: int, elapsed: float
    ) -> dict[str, Any]:
        tokens_per_s = tokens / max(elapsed, 1e-9)
        row = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_seen": self.state["tokens_seen"],
            "tokens_per_s": tokens_per_s,
            "skipped_batches": self.guard.num_skipped,
            "memory_gib": _memory_gib(),
        }
        mfu = self._mfu(tokens_per_s)
        if mfu is not None:
            row["mfu"] = mfu
        return row

    def _mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilisation on GPU (6N + attention per token); None on CPU."""
        if self.runtime.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.runtime.device)
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
        if peak is None:
            return None
        mc = self.model_config
        dense = mc.num_parameters(non_embedding=True) + mc.vocab_size * mc.hidden_size
        flops = 6 * dense + 12 * mc.num_layers * mc.hidden_size * self.loader.seq_len
        return flops * tokens_per_s / (peak * self.runtime.world_size)

    def _on_guard_event(
        self,
        kind: str,
        step: int,
        loss: float,
        grad_norm: float,
        zscore: float,
        batch_ids: list[int],
    ) -> None:
        """Apply the guard policy (skip, rewind or stop) and log the event."""
        guard, policy = self.guard, self.cfg.guard.policy
        self.zero_grad()
        guard.num_events += 1
        event = {
            "step": step,
            "kind": kind,
            "policy": policy,
            "loss": _finite(loss),
            "grad_norm": _finite(grad_norm),
            "zscore": _finite(zscore),
            "batch_ids": batch_ids,
            "loader_state": self.loader.state_dict(),
        }
        target = ckpt.latest_checkpoint(self.out_dir) if policy == "rewind" else None
        if policy == "skip" or (policy == "rewind" and target is None):
            guard.num_skipped += 1
        elif policy == "rewind":
            self._rewind(target)
            event.update(rewound_to=self.state["step"], lr_scale=guard.lr_scale)
        if self.runtime.is_main:
            log_event(self.out_dir, event)
        if policy == "stop" or guard.num_events > self.cfg.guard.max_events:
            raise RuntimeError(
                f"stability guard: {kind} at step {step} (loss {loss}); "
                f"{guard.num_events} events; policy={policy}"
            )

    def _rewind(self, target: Path) -> None:
        """Reload weights, optimizer and step from ``target``; keep the data moving forward."""
        counters = {k: getattr(self.guard, k) for k in ("num_events", "num_skipped")}
        kept = {k: self.state[k] for k in ("batches_drawn", "train_time_s", "end_step")}
        trainer_state, _ = ckpt.load_checkpoint(target, self.model, self.optimizers)
        self._reset_base_lrs()
        self.state.update(trainer_state["train"], **kept)
        lr_scale = self.guard.lr_scale * self.cfg.guard.rewind_lr_factor
        num_rewinds = self.guard.num_rewinds + 1
        self.guard.load_state_dict(trainer_state["guard"])
        self.guard.lr_scale, self.guard.num_rewinds = lr_scale, num_rewinds
        for key, value in counters.items():
            setattr(self.guard, key, value)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-mean loss on the first eval_batches batches of the held-out set."""
        rt, cfg = self.runtime, self.cfg
        loader = PackedLoader(
            self.val_dir, cfg.batch.micro_batch_size, rt.rank, rt.world_size, seed=cfg.seed
        )
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=rt.device)
        for _ in range(cfg.eval_batches):
            batch = {k: v.to(rt.device) for k, v in loader.next_batch().items()}
            with self.autocast:
                logits = self.model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
            loss, _ = causal_lm_loss(logits, batch["labels"], 0.0)
            count = (batch["labels"] != IGNORE_INDEX).sum()
            totals += torch.stack([loss.double() * count, count.double()])
        loader.close()
        self.model.train()
        total, count = all_reduce_sum(totals, rt).tolist()
        return total / max(count, 1)

    # ----------------------------------------------------------------------------- saving
    def save(self, path: Path, final: bool = False) -> None:
        """Write a checkpoint (all ranks); final ones also hold model.safetensors."""
        trainer_state = {
            "train": self.state,
            "guard": self.guard.state_dict(),
            "optimizer": self.cfg.optimizer.name,
            "world_size": self.runtime.world_size,
        }
        full = None
        if final:  # NOTE: collective: every rank takes part, rank 0 receives the tensors.
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full = get_model_state_dict(self.model, options=options)
        ckpt.save_checkpoint(
            path,
            self.model,
            self.optimizers,
            trainer_state,
            self.loader.state_dict(),
            self.model_config,
            write_extra=(lambda tmp: save_model(full, self.model_config, tmp)) if final else None,
        )
        if self.runtime.is_main:
            if not final:
                ckpt.prune_checkpoints(self.out_dir, self.cfg.checkpoint.keep_last)
            # NOTE: the Prefect wrapper watches for this line to push partial state.
            print(f"saved checkpoint {path} at step {self.state['step']}", flush=True)

    def summary(self) -> dict[str, Any]:
        """Headline metrics (JSON scalars) for summary.json."""
        recent = self.state["recent_losses"]
        return {
            "final_loss": sum(recent) / len(recent) if recent else None,
            "last_loss": recent[-1] if recent else None,
            "val_loss": self.state["val_loss"],
            "steps": self.state["step"],
            "stage_steps": self.state["step"] - self.state["start_step"],
            "tokens_seen": self.state["tokens_seen"],
            "tokens_per_s": self.state["tokens_seen"] / max(self.state["train_time_s"], 1e-9),
            "skipped_batches": self.guard.num_skipped,
            "guard_events": self.guard.num_events,
            "rewinds": self.guard.num_rewinds,
            "world_size": self.runtime.world_size,
        }

    def _write_rank_info(self, batch: dict[str, torch.Tensor]) -> None:
        """Record this rank's init fingerprint, first batch and sharding (checked by tests)."""
        digest = hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest()
        info = {
            "rank": self.runtime.rank,
            "world_size": self.runtime.world_size,
            "init_checksum": self.init_checksum,
            "first_batch_sha256": digest,
            "step": self.state["step"],
            **sharding_report(self.model),
        }
        folder = self.out_dir / "ranks"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank-{self.runtime.rank:05d}.json").write_text(json.dumps(info, indent=1))


def _finite(value: float) -> float | None:
    return value if np.isfinite(value) else None


def _memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


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
    cfg = TrainConfig.load(args.config)
    summary = run(cfg, args.data_dir, args.out_dir, args.val_dir, args.init_from)
    if int(os.environ.get("RANK", "0")) == 0:
        print("summary: " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
