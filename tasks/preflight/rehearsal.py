"""The training rehearsal, preflight's steps (5)-(7): real optimizer steps at full width and
depth through the pipeline's launcher and trainer (uniform random tokens: the steps test the
machine, the shapes and the sharding, not the corpus), a resume in a new process, throughput,
peak memory against the plan, and the first evaluation scores."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.preflight.memory import MEASURE_ENV, RankMemory, environment, out_of_memory
from llmflow.tasks.preflight.report import PreflightOptions, Report, timed
from llmflow.tasks.preflight.shape import memory_fixes, rehearsal_plan_gb, rehearsal_shape

MEMORY_TOLERANCE = 0.15
"""Largest relative error of the plan's peak memory against the measured one for a "go"."""
INIT_LOSS_TOLERANCE = 1.0
"""A fresh model's loss on uniform random tokens must be within this of ln(vocab) (nats)."""
STEP_LINE = re.compile(r"\bstep (\d+) loss (\S+)")
"""The trainer's console line of a step (``MetricsLogger.log``): its number and loss."""
logger = logging.getLogger("llmflow.preflight")


def random_packed(out_dir: Path, *, vocab: int, seq_len: int, rows: int, seed: int) -> Path:
    """A packed dataset of uniform random tokens (the trainer's input format)."""
    from llmflow.tasks.dataprep.pack import write_packed

    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=rows * (seq_len + 1), dtype=np.int64)
    tokens[seq_len :: seq_len + 1] = 0  # one eos per row: every row is one document
    lengths = np.full(rows, seq_len + 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_packed([(tokens, lengths)], out_dir, seq_len=seq_len, vocab_size=vocab, eos_id=0,
                 pad_id=0, seed=seed, rows_per_shard=max(rows, 1))  # fmt: skip
    return out_dir


def steps_train_config(config, seq_len: int, micro: int, steps: int):
    """Stage 1's trainer config at full width and depth, cut to ``steps`` short steps."""
    from llmflow.tasks.pretrain.curriculum import stage_train_config

    train = stage_train_config(config.pretrain, 0)
    return train.replaced(
        max_steps=steps, num_tokens=None,
        batch={"micro_batch_size": micro, "grad_accum_steps": 1, "warmup_start_micro_batch": None},
        checkpoint={"interval": steps // 2, "keep_last": 2},
        schedule={"warmup_steps": 0, "total_steps": None},
        eval_interval=steps, log_interval=1, progress_bar=False, deterministic=True,
        tracker={"tensorboard": False, "others": []},
    )  # fmt: skip


def run_losses(run_dir: Path) -> dict[int, float]:
    """The loss of every step a run logged to its ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def peak_memory_gb(run_dir: Path) -> float:
    """The largest ``memory_gib`` a run logged (its trainer's peak per rank), GB."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return max(r.get("memory_gib", 0.0) for r in rows) * 2**30 / 1e9


@dataclass
class RehearsalLauncher:
    """Starts the trainer through the pipeline's launcher (``launch_training`` with this
    machine's ``local_launcher``) on ``processes`` ranks; ``peak_gb`` is the largest peak RSS of
    one rank in the last launch (sampled, so a rank that is killed still leaves the peak it had
    reached)."""

    processes: int
    timeout_s: float
    log: Callable[[str], Any]
    """Gets every output line of the trainer; its steps are logged as progress besides."""
    peak_gb: float = 0.0
    out_of_memory: str | None = None
    """Why a rank of the last launch ran out of memory, from its output (None: it did not)."""
    run: str = ""
    """The last launch's run folder name, which names it in the progress lines."""
    num_steps: int = 0
    started: float = 0.0
    last: float = 0.0

    def __call__(self, train, data: Path, out: Path, val: Path | None = None):
        from llmflow.tasks.pretrain.faults import ENV
        from llmflow.tasks.pretrain.launch import launch_training
        from llmflow.tasks.pretrain.launchers import local_launcher

        self.out_of_memory = None
        self.start(Path(out).name, train.max_steps)
        env = {ENV: None, **MEASURE_ENV}  # no fault injection leaks in from the caller
        launcher = local_launcher(self.processes)  # torchrun for several ranks, as a stage's
        with environment(env), RankMemory() as memory:
            try:
                return launch_training(train, data, out, val_dir=val, launcher=launcher,
                                       on_line=self._line, timeout_s=self.timeout_s)  # fmt: skip
            finally:
                self.peak_gb = memory.peak_gb()

    def start(self, run: str, num_steps: int) -> None:
        """Log the launch of run folder ``run`` to step ``num_steps``; time its steps from now."""
        self.run, self.num_steps = run, num_steps
        self.started = self.last = time.monotonic()
        ranks = f"{self.processes} rank" + ("s" if self.processes > 1 else "")
        logger.info(
            "preflight: %s run: starting the trainer on %s, %d steps", run, ranks, num_steps
        )

    def _line(self, line: str) -> None:
        # NOTE: a rank's allocation error can scroll out of the failure's tail behind
        # torchrun's own traceback, so every line is looked at as it comes.
        self.out_of_memory = self.out_of_memory or out_of_memory(None, [line])
        self.log(line)
        step = STEP_LINE.search(line)
        if step is not None:
            now = time.monotonic()
            logger.info("preflight: %s run: step %s/%d loss %s, %.1f s (%.1f s since start)",
                        self.run, step.group(1), self.num_steps, step.group(2), now - self.last,
                        now - self.started)  # fmt: skip
            self.last = now


def run_test_steps(report: Report, config, options: PreflightOptions, work: Path, log) -> None:
    """(5)-(7) Real steps, crash and resume, throughput, memory against plan, first scores.

    A trainer that fails is a no-go row, never a traceback; one that ran out of memory (killed
    by the OOM killer, or an allocation refused) is a no-go row of its memory against the plan
    with the settings that would fit.
    """
    model_cfg = config.pretrain.train.model_config_obj()
    steps, ranks = options.steps, options.processes
    seq_len, micro = rehearsal_shape(report, config, options)
    rows = (steps + 2) * micro * ranks * 2
    data = random_packed(
        work / "data", vocab=model_cfg.vocab_size, seq_len=seq_len, rows=rows, seed=0
    )
    val = random_packed(
        work / "val", vocab=model_cfg.vocab_size, seq_len=seq_len, rows=micro * ranks * 4, seed=1
    )
    train = steps_train_config(config, seq_len, micro, steps)
    launch = RehearsalLauncher(ranks, options.timeout_s, log)
    report.numbers["test_shape"] = {
        "seq_len": seq_len,
        "micro_batch_size": micro,
        "processes": ranks,
        "steps": steps,
    }

    with timed(report, f"train {steps} steps") as row, trainer_failure(report, row, config, launch):
        summary = launch(train, data, work / "straight", val)
        straight = run_losses(work / "straight")
        finite = all(math.isfinite(v) for v in straight.values())
        row.update(go=finite and len(straight) == steps,
                   detail=f"{ranks} ranks, seq {seq_len} x micro {micro}: losses " + ", ".join(f"{v:.4f}" for v in straight.values()))  # fmt: skip
    if not report.checks[-1].go:
        return
    with timed(report, "checkpoint, resume") as row, trainer_failure(report, row, config, launch):
        half = steps // 2
        resumed = resume_from_checkpoint(launch, train, data, val, work, half)
        same = all(resumed.get(s) == straight[s] for s in range(half + 1, steps + 1))
        row.update(go=same, detail=f"a new process resumed step {half}'s checkpoint: steps {half + 1}..{steps} "
                   + ("bitwise equal" if same else f"DIFFER: {resumed} vs {straight}"))  # fmt: skip
    throughput(report, summary, model_cfg, seq_len)
    memory_vs_plan(
        report, config, model_cfg, work, launch, seq_len=seq_len, micro=micro, ranks=ranks
    )
    first_scores(report, straight, summary, model_cfg, work)


def last_error(tail: list[str]) -> str:
    """The last line of the output that names an error (else the last line)."""
    errors = [line.strip() for line in tail if re.search(r"\w(Error|Exception|Failed)\b", line)]
    return (errors or [line.strip() for line in tail if line.strip()] or ["(no output)"])[-1]


@contextlib.contextmanager
def trainer_failure(report: Report, row: dict, config, launch: RehearsalLauncher) -> Iterator[None]:
    """A trainer that fails makes ``row`` a no-go: its error line, or, out of memory, its
    measured peak against the plan and the settings that would fit."""
    from llmflow.tasks.pretrain.launch import TrainingFailed

    try:
        yield
    except TrainingFailed as err:
        reason = out_of_memory(err.returncode, err.tail) or launch.out_of_memory
        if reason is None:
            first = str(err).splitlines()[0]
            row.update(go=False, detail=f"{first}: {last_error(err.tail)}")
            return
        _out_of_memory(report, row, config, launch, reason)


def _out_of_memory(report: Report, row: dict, config, launch: RehearsalLauncher, reason: str):
    """``row`` a no-go for running out of memory: the measured peak against the plan and the
    settings that would fit, also kept in the report's numbers."""
    shape = report.numbers["test_shape"]
    seq, micro, ranks = shape["seq_len"], shape["micro_batch_size"], shape["processes"]
    plan = rehearsal_plan_gb(config, seq, micro, ranks)
    usable = report.numbers.get("host", {}).get("usable_gb")
    fixes = memory_fixes(config, seq, micro, ranks, usable)
    report.numbers["out_of_memory"] = {"reason": reason, "peak_gb": launch.peak_gb,
                                       "plan_gb": plan, "fixes": fixes}  # fmt: skip
    row.update(go=False, detail=(
        f"out of memory at seq {seq} x micro {micro} on {ranks} ranks: {reason}; measured "
        f"peak {launch.peak_gb:.2f} GB per rank (RSS when last sampled) against a plan of "
        f"{plan:.2f} GB" + ("" if usable is None else f" ({usable:.1f} GB usable here)")
        + "; to fit, change " + "; or ".join(fixes)))  # fmt: skip


def resume_from_checkpoint(launch, train, data: Path, val: Path, work: Path, step: int) -> dict:
    """Start a new run folder holding only the straight run's checkpoint of ``step`` (as a run
    killed after it would); the trainer resumes it. Returns the resumed run's losses."""
    from llmflow.tasks.pretrain.checkpoint import step_dir_name

    name = step_dir_name(step)
    source = work / "straight" / "checkpoints" / name
    if not source.is_dir():
        raise BadInputError(f"the straight run wrote no checkpoint of step {step} ({source})")
    shutil.copytree(source, work / "resumed" / "checkpoints" / name)
    launch(train, data, work / "resumed", val)
    return run_losses(work / "resumed")


def throughput(report: Report, summary: dict, model_cfg, seq_len: int) -> None:
    """Tokens/s measured, and the FLOP/s they mean (the plan's time assumes its MFU x peak)."""
    from llmflow.tasks.pretrain.planner import flops_per_token

    with timed(report, "throughput") as row:
        tps = summary["tokens_per_s"]
        achieved = tps * flops_per_token(model_cfg, seq_len)
        report.numbers["tokens_per_s"] = tps
        report.numbers["achieved_tflops"] = achieved / 1e12
        row["detail"] = (
            f"{tps:,.0f} tokens/s over all ranks = {achieved / 1e12:.3f} TFLOP/s of model FLOPs"
        )
        row["go"] = tps > 0


def memory_vs_plan(
    report: Report, config, model_cfg, work: Path, launch, *, seq_len, micro, ranks
) -> None:
    """Peak memory per rank against the plan's prediction for the test steps' own settings.

    On GPU the measure is torch's peak allocation; on CPU it is the peak RSS less that of the
    same launch with a tiny model (Python, torch, the process group: what no plan counts).
    """
    import torch

    with timed(report, "memory vs plan") as row, trainer_failure(report, row, config, launch):
        cuda = torch.cuda.is_available()
        predicted = rehearsal_plan_gb(config, seq_len, micro, ranks)
        peak = peak_memory_gb(work / "straight")
        baseline = 0.0 if cuda else runtime_baseline_gb(config, work, launch, seq_len, micro)
        measured = peak - baseline
        if measured <= 0:  # NOTE: a model this small is lost in the runtime's own RSS
            report.numbers["memory"] = {"predicted_gb": predicted, "measured_gb": measured,
                                        "peak_gb": peak, "runtime_baseline_gb": baseline,
                                        "error": None}  # fmt: skip
            row["go"] = True
            row["detail"] = (f"plan {predicted:.3f} GB; not measurable here: the peak "
                             f"{peak:.3f} GB is no more than the runtime's {baseline:.3f} GB")  # fmt: skip
            return
        error = (predicted - measured) / measured
        report.numbers["memory"] = {"predicted_gb": predicted, "measured_gb": measured,
                                    "peak_gb": peak, "runtime_baseline_gb": baseline, "error": error}  # fmt: skip
        row["go"] = abs(error) <= MEMORY_TOLERANCE
        row["detail"] = (f"plan {predicted:.3f} GB, measured {measured:.3f} GB per rank "
                         f"(peak {peak:.3f} less runtime {baseline:.3f}): error {error:+.1%}")  # fmt: skip


def runtime_baseline_gb(config, work: Path, launch, seq_len: int, micro: int) -> float:
    """Peak RSS of the same launch with a tiny model: the runtime's share of the peak."""
    tiny = {"vocab_size": 256, "hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
            "intermediate_size": 32, "max_seq_len": max(seq_len, 16), "nope_interval": 0}  # fmt: skip
    small = config.pretrain.train.replaced(model={"overrides": tiny})
    cfg = config.model_copy(
        update={"pretrain": config.pretrain.model_copy(update={"train": small})}
    )
    train = steps_train_config(cfg, seq_len, micro, 2)
    data = random_packed(
        work / "tiny-data", vocab=256, seq_len=seq_len, rows=8 * micro * launch.processes, seed=0
    )
    launch(train, data, work / "tiny")
    return peak_memory_gb(work / "tiny")


def first_scores(
    report: Report, losses: dict[int, float], summary: dict, model_cfg, work: Path
) -> None:
    """The evaluation suite's first scores: held-out loss and perplexity, and the initial loss."""
    with timed(report, "first scores") as row:
        init_loss, uniform = losses[min(losses)], math.log(model_cfg.vocab_size)
        val_loss = summary.get("val_loss")
        scores = {"init_loss": init_loss, "ln_vocab": uniform, "heldout_loss": val_loss,
                  "heldout_ppl": math.exp(val_loss) if val_loss is not None else None}  # fmt: skip
        (work / "scores.json").write_text(json.dumps(scores, indent=1))
        report.numbers["scores"] = scores
        row["go"] = abs(init_loss - uniform) <= INIT_LOSS_TOLERANCE and val_loss is not None
        row["detail"] = (f"init loss {init_loss:.3f} vs ln(vocab) {uniform:.3f}; held-out loss "
                         f"{val_loss:.3f}, ppl {scores['heldout_ppl']:,.0f}")  # fmt: skip
