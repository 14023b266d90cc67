"""Preflight: the checklist to pass before launching a long run, on the machine it runs on.

For a recipe it (1) resolves and validates the config; (2) checks that every data source is
reachable and yields documents; (3) plans the run on the recipe's declared GPUs; (4) builds the
model at full shape on the meta device and checks its parameter count against the plan; (5) runs
a few real optimizer steps at full width and depth through the trainer, with the recipe's
sharding (FSDP2 over ``processes`` ranks; a short sequence and micro-batch where the machine is
small), resumes the checkpoint of the middle step in a new process, and checks that the loss
continues bitwise;
(6) measures tokens/s and peak memory and compares the memory with the plan's prediction for
those very settings; (7) writes the first evaluation scores (held-out loss and perplexity of the
trained model, and the loss at initialisation against ln(vocab)). It prints a go/no-go table and
publishes it as a Prefect artifact.

    llmflow preflight configs/smollm3-135m.yaml --processes 2 --seq-len 64
    llmflow preflight configs/smollm3-3b.yaml --no-train     # meta build and memory plan only

Training data for step (5) are uniform random tokens of the model's vocabulary: the steps test
the machine, the shapes and the sharding, not the corpus (step (2) tests that).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.framework.errors import BadInputError

MEMORY_TOLERANCE = 0.15
"""Largest relative error of the plan's peak memory against the measured one for a "go"."""
INIT_LOSS_TOLERANCE = 1.0
"""A fresh model's loss on uniform random tokens must be within this of ln(vocab) (nats)."""
HOST_MEMORY_SHARE = 0.7
"""Share of the memory available per rank that a rehearsal scaled to this host may plan to use
(the rest: the runtime, about 0.35 GB per CPU rank, and the plan's error)."""
RUNTIME_GB = 0.5
"""Memory per CPU rank that no plan counts (Python, torch, the process group: 0.35 GB measured)."""
MIN_SCALED_SEQ_LEN = 64
"""The shortest sequence a rehearsal is scaled down to."""


class PreflightOptions(BaseModel):
    """How much of the checklist to run here, and at what size."""

    model_config = ConfigDict(extra="forbid")

    processes: int = Field(2, ge=1, description="Ranks of the test steps (FSDP2 when > 1).")
    seq_len: int | None = Field(
        None, gt=1, description="Sequence length of the test steps (None: the recipe's)."
    )
    micro_batch_size: int | None = Field(
        None, gt=0, description="Sequences per rank per step (None: the recipe's)."
    )
    steps: int = Field(
        4, ge=2, description="Optimizer steps; the resume starts after half of them."
    )
    docs_per_source: int = Field(2, ge=1, description="Documents read from each data source.")
    check_data: bool = Field(True, description="Open every data source and read documents.")
    train: bool = Field(True, description="Run the test steps (False: plan and meta build only).")
    timeout_s: float = Field(1800, gt=0, description="Deadline of each trainer launch.")
    host_memory_gb: float | None = Field(
        None,
        gt=0,
        description="Memory per rank the test steps are scaled to (None: this host's available "
        "memory shared by the ranks, or a GPU's free memory).",
    )


@dataclass
class Check:
    """One row of the go/no-go table."""

    check: str
    go: bool
    detail: str
    seconds: float = 0.0


@dataclass
class Report:
    """Everything preflight found: the table's rows and the numbers behind them."""

    recipe: str
    checks: list[Check] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def go(self) -> bool:
        return all(c.go for c in self.checks)

    def rows(self) -> list[dict[str, Any]]:
        return [asdict(c) | {"go": "go" if c.go else "NO-GO"} for c in self.checks]

    def table(self) -> str:
        """The go/no-go table as text."""
        width = max(len(c.check) for c in self.checks)
        lines = [f"{'check':<{width}}  result  seconds  detail"]
        for c in self.checks:
            mark = "go" if c.go else "NO-GO"
            lines.append(f"{c.check:<{width}}  {mark:<6}  {c.seconds:7.1f}  {c.detail}")
        verdict = "GO" if self.go else "NO-GO"
        lines.append(
            f"{self.recipe}: {verdict} ({sum(c.go for c in self.checks)}/{len(self.checks)} checks pass)"
        )
        return "\n".join(lines)


@contextlib.contextmanager
def timed(report: Report, name: str) -> Iterator[dict]:
    """Run a check; its body fills ``row["go"]`` and ``row["detail"]``; a BadInputError is a no-go
    naming the problem."""
    row: dict[str, Any] = {"go": True, "detail": ""}
    started = time.perf_counter()
    try:
        yield row
    except BadInputError as err:
        row.update(go=False, detail=" ".join(line.strip() for line in str(err).splitlines()))
    report.checks.append(Check(name, bool(row["go"]), row["detail"], time.perf_counter() - started))


# ----------------------------------------------------------------------------- the checks
def check_config(report: Report, config_path: str | None, overrides: list[str]):
    """(1) Resolve and validate the recipe."""
    from llmflow.tasks.config import load_config
    from llmflow.tasks.ingest.import_model import init_config

    with timed(report, "config") as row:
        config = load_config(config_path, overrides)
        config, _ = init_config(config)  # init: its architecture, pinned and checked
        report.recipe = config.name
        if not config.pretrain.stages:  # the init model as it is: no architecture of ours
            from llmflow.tasks.pretrain.planner import NO_STAGE

            row["detail"] = f"{config.name}: {NO_STAGE}, init {config.init}"
            return config
        model = config.pretrain.train.model_config_obj()
        row["detail"] = (
            f"{config.name}: {model.num_layers} layers x {model.hidden_size}, {len(config.pretrain.stages)} stages"
        )
        return config
    return None


def check_sources(report: Report, config, docs: int) -> None:
    """(2) Every data source is reachable and yields documents; every weighed domain has one."""
    from llmflow.tasks.dataprep.mixture import check_data_domains
    from llmflow.tasks.ingest import hub
    from llmflow.tasks.ingest.ingest import list_files

    local, sources = hub.split_sources(config.data)
    if not config.data:
        with timed(report, "data: generated sample") as row:
            row["detail"] = "the quickstart sample (made on this machine)"
    for source in sources:
        with timed(report, f"data: {source.dataset}") as row:
            texts = hub.sample_documents(source, config.ingest.text_field, docs)
            row["detail"] = (
                f"{len(texts)} docs, first {len(texts[0])} chars ({source.split}, domain {source.domain})"
            )
    if local:
        with timed(report, "data: local files") as row:
            row["detail"] = _check_local(local, config.ingest, docs)
    if config.data:
        with timed(report, "data: domains") as row:
            files = list_files(local) if local else []
            found = check_data_domains(config, files, [s.uri for s in sources])
            row["detail"] = (
                "not checked before ingest (no mixture weighs a domain, or a Hub source names none)"
                if found is None
                else f"every weighed domain has a source (the data gives {sorted(found)})"
            )


def _check_local(paths: list[str], ingest_cfg, docs: int) -> str:
    from llmflow.tasks.ingest.ingest import first_documents, list_files

    files = list_files(paths)
    for uri in files:
        if not first_documents(uri, ingest_cfg, docs):
            raise BadInputError(f"data file {uri} yields no usable document")
    return f"{len(files)} files, each yields documents"


def check_plan(report: Report, config):
    """(3) The plan on the declared hardware: a recipe that does not fit is a no-go with fixes."""
    from llmflow.tasks.pretrain.planner import NO_STAGE, recipe_plan

    with timed(report, "plan") as row:
        if not config.pretrain.stages:
            row["detail"] = f"{NO_STAGE}: nothing to pretrain, so no steps, time or memory to plan"
            return None
        plan = recipe_plan(config.pretrain, config.hardware)
        m, hw = plan.memory, config.hardware
        report.numbers["plan"] = {"num_parameters": plan.num_parameters, "memory_gb": m.total_gb,
                                  "steps": plan.num_steps, "hours": plan.estimated_hours}  # fmt: skip
        row["detail"] = (
            f"{m.total_gb:.1f} GB per GPU of {hw.gpu_mem_gb:g}, {plan.num_steps:,} steps, {plan.estimated_hours:,.1f} h on {hw.gpus} GPUs"
        )
        if not plan.fits:
            row.update(go=False, detail="does not fit: " + "; ".join(plan.warnings))
        return plan
    return None


def check_extension_plan(report: Report, config) -> None:
    """(3b) Each context-extension stage's memory on the declared GPUs."""
    from llmflow.tasks.pretrain.planner import extension_memory

    if not config.extend.stages:
        return
    with timed(report, "plan: extension") as row:
        lines = extension_memory(config.pretrain, config.extend, config.hardware)
        row.update(go=not any("NOT fit" in line for line in lines), detail="; ".join(lines))


def meta_parameter_count(model_cfg) -> int:
    """Parameters of the model built at full shape on the meta device (no memory allocated)."""
    import torch

    from llmflow.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(model_cfg)
    return sum(p.numel() for p in model.parameters())


def check_meta_build(report: Report, config, plan) -> None:
    """(4) The model at full shape on the meta device has the plan's parameter count."""
    with timed(report, "meta build") as row:
        count = meta_parameter_count(config.pretrain.train.model_config_obj())
        report.numbers["meta_parameters"] = count
        row["go"] = plan is not None and count == plan.num_parameters
        planned = plan.num_parameters if plan is not None else "?"
        row["detail"] = (
            f"{count:,} parameters built, plan counts {planned:,}"
            if plan
            else f"{count:,} parameters"
        )


# ----------------------------------------------------------------------------- test steps
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


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _peak_memory_gb(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return max(r.get("memory_gib", 0.0) for r in rows) * 2**30 / 1e9


@dataclass
class Launcher:
    """Starts the trainer (the pipeline's launcher) on this machine's ranks; ``peak_gb`` is the
    largest peak RSS of one rank in the last launch (sampled, so a rank that is killed still
    leaves the peak it had reached)."""

    processes: int
    timeout_s: float
    log: Callable[[str], Any]
    peak_gb: float = 0.0
    out_of_memory: str | None = None
    """Why a rank of the last launch ran out of memory, from its output (None: it did not)."""

    def __call__(self, train, data: Path, out: Path, val: Path | None = None):
        from llmflow.tasks.pretrain.faults import ENV
        from llmflow.tasks.pretrain.launch import launch_training

        self.out_of_memory = None
        env = {ENV: None, **MEASURE_ENV}  # no fault injection leaks in from the caller
        with _environment(env), RankMemory() as memory:
            try:
                return launch_training(train, data, out, val_dir=val, num_processes=self.processes,
                                       on_line=self._line, timeout_s=self.timeout_s)  # fmt: skip
            finally:
                self.peak_gb = memory.peak_gb()

    def _line(self, line: str) -> None:
        # NOTE: a rank's allocation error can scroll out of the failure's tail behind
        # torchrun's own traceback, so every line is looked at as it comes.
        self.out_of_memory = self.out_of_memory or out_of_memory(None, [line])
        self.log(line)


class RankMemory:
    """Samples the peak RSS (``VmHWM``) of the trainer processes this process started."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s, self.peaks = interval_s, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RankMemory:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def peak_gb(self) -> float:
        """The largest peak RSS of one trainer process so far, GB."""
        return max(self.peaks.values(), default=0) / 1e9

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        for pid in _descendants(os.getpid()):
            try:
                if TRAIN_MODULE_NAME not in Path(f"/proc/{pid}/cmdline").read_text():
                    continue
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:  # it exited meanwhile
                continue
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    self.peaks[pid] = max(self.peaks.get(pid, 0), int(line.split()[1]) * 1024)


TRAIN_MODULE_NAME = "llmflow.tasks.pretrain.train"


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2"}
"""glibc malloc settings of the test steps: every tensor over 64 KiB is its own mapping, returned
to the system when freed, so peak RSS measures the live tensors rather than freed memory the
allocator kept (without it, two identical CPU runs differ by 25% in peak RSS)."""


@contextlib.contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    """Set (or, for None, unset) environment variables for the duration of the block."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


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
    launch = Launcher(ranks, options.timeout_s, log)
    report.numbers["test_shape"] = {
        "seq_len": seq_len,
        "micro_batch_size": micro,
        "processes": ranks,
        "steps": steps,
    }

    with timed(report, f"train {steps} steps") as row, trainer_failure(report, row, config, launch):
        summary = launch(train, data, work / "straight", val)
        straight = _losses(work / "straight")
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


# ----------------------------------------------------------------------------- host memory
def rehearsal_plan_gb(
    config, seq_len: int, micro: int, ranks: int, activation_checkpointing: str | None = None
) -> float:
    """The plan's memory per rank of the test steps, at the recipe's precision on this machine
    (``auto``: bf16 on a GPU, float32 on a CPU)."""
    import torch

    from llmflow.tasks.pretrain.planner import memory_per_gpu, precision_bytes

    train = config.pretrain.train  # the test steps' own optimizer, checkpointing and precision
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return memory_per_gpu(
        train.model_config_obj(), seq_len=seq_len, micro_batch_size=micro, num_gpus=ranks,
        param_dtype_bytes=precision_bytes(train, device), optimizer=train.optimizer.name,
        fsdp=ranks > 1, activation_checkpointing=activation_checkpointing or train.activation_checkpointing,
        every_k=train.activation_checkpointing_every_k,
    ).total_gb  # fmt: skip


def host_memory_per_rank_gb(ranks: int) -> tuple[float, str]:
    """Memory one rank may use here, GB, and where it comes from: a GPU's free memory, or the
    host's available memory (within its cgroup's limit) shared by the ranks."""
    import torch

    if torch.cuda.is_available():
        count = min(ranks, torch.cuda.device_count())
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(count)) / 1e9
        return free, f"{free:.1f} GB free per GPU"
    available = _meminfo_bytes("MemAvailable")
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):  # fmt: skip
        with contextlib.suppress(OSError, ValueError):
            room = int(Path(limit).read_text()) - int(Path(usage).read_text())
            available = min(available, max(room, 0))
    per_rank = available / ranks / 1e9
    return per_rank, f"{available / 1e9:.1f} GB available / {ranks} ranks = {per_rank:.1f} GB"


def _meminfo_bytes(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise BadInputError(f"/proc/meminfo has no {key}")


def rehearsal_shape(report: Report, config, options: PreflightOptions) -> tuple[int, int]:
    """The test steps' sequence length and micro-batch: as asked, else the recipe's, scaled down
    (micro-batch first, then sequence length, halving) until the plan fits this host.

    Adds a "rehearsal shape" row saying what was scaled, or that an asked shape is over.
    """
    import torch

    ranks = options.processes
    recipe_seq = max(s.mixture.seq_len for s in config.pretrain.stages)
    recipe_micro = config.pretrain.train.batch.micro_batch_size
    seq, micro = options.seq_len or recipe_seq, options.micro_batch_size or recipe_micro
    with timed(report, "rehearsal shape") as row:
        budget, where = (
            (options.host_memory_gb, "as given")
            if options.host_memory_gb
            else host_memory_per_rank_gb(ranks)
        )
        runtime = 0.0 if torch.cuda.is_available() else RUNTIME_GB
        usable = HOST_MEMORY_SHARE * budget

        def need(seq_len: int, micro_batch: int) -> float:
            return rehearsal_plan_gb(config, seq_len, micro_batch, ranks) + runtime

        asked = need(seq, micro)
        while need(seq, micro) > usable and options.micro_batch_size is None and micro > 1:
            micro //= 2
        while need(seq, micro) > usable and options.seq_len is None and seq > MIN_SCALED_SEQ_LEN:
            seq = max(MIN_SCALED_SEQ_LEN, seq // 2)
        plan = f"plan {need(seq, micro) - runtime:.2f} GB per rank"
        here = f"{usable:.1f} GB usable per rank here ({where}, x{HOST_MEMORY_SHARE:g})"
        scaled = [f"{name} {old} -> {new}" for name, old, new in
                  (("micro-batch", options.micro_batch_size or recipe_micro, micro),
                   ("seq", options.seq_len or recipe_seq, seq)) if old != new]  # fmt: skip
        report.numbers["host"] = {"memory_per_rank_gb": budget, "usable_gb": usable,
                                  "asked_plan_gb": asked - runtime, "scaled": scaled}  # fmt: skip
        if scaled:
            row["detail"] = (f"scaled to this host: {', '.join(scaled)} ({plan}; the asked shape "
                             f"plans {asked - runtime:.2f} GB, {here})")  # fmt: skip
        else:
            row["detail"] = f"seq {seq} x micro {micro} on {ranks} ranks: {plan}, {here}"
        if need(seq, micro) > usable:
            row["detail"] += "; over it: the test steps may run out of memory"
    return seq, micro


OUT_OF_MEMORY = [
    (re.compile(r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)"), "a rank was killed by signal 9 (the OOM killer)"),
    (re.compile(r"CUDA out of memory|OutOfMemoryError"), "CUDA out of memory"),
    (re.compile(r"can't allocate memory|Cannot allocate memory|std::bad_alloc|MemoryError"),
     "an allocation was refused (out of memory)"),
]  # fmt: skip
"""Output that means a rank ran out of memory, and how to say it."""


def out_of_memory(returncode: int | None, tail: list[str]) -> str | None:
    """Why the trainer ran out of memory, from its exit code and last lines; None if it did not."""
    if returncode == -9:
        return "the trainer was killed by signal 9 (the OOM killer)"
    text = "\n".join(tail)
    return next((reason for pattern, reason in OUT_OF_MEMORY if pattern.search(text)), None)


def _last_error(tail: list[str]) -> str:
    """The last line of the output that names an error (else the last line)."""
    errors = [line.strip() for line in tail if re.search(r"\w(Error|Exception|Failed)\b", line)]
    return (errors or [line.strip() for line in tail if line.strip()] or ["(no output)"])[-1]


@contextlib.contextmanager
def trainer_failure(report: Report, row: dict, config, launch: Launcher) -> Iterator[None]:
    """A trainer that fails makes ``row`` a no-go: its error line, or, out of memory, its
    measured peak against the plan and the settings that would fit."""
    from llmflow.tasks.pretrain.launch import TrainingFailed

    try:
        yield
    except TrainingFailed as err:
        reason = out_of_memory(err.returncode, err.tail) or launch.out_of_memory
        if reason is None:
            first = str(err).splitlines()[0]
            row.update(go=False, detail=f"{first}: {_last_error(err.tail)}")
            return
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


def memory_fixes(config, seq: int, micro: int, ranks: int, usable_gb: float | None) -> list[str]:
    """The settings that shrink the rehearsal's memory, each with its plan per rank."""
    train = config.pretrain.train
    fixes = []
    if micro > 1:
        fixes.append(f"--micro-batch-size 1 ({rehearsal_plan_gb(config, seq, 1, ranks):.2f} GB)")
    if train.activation_checkpointing != "full":
        full = rehearsal_plan_gb(config, seq, micro, ranks, "full")
        fixes.append(f"pretrain.train.activation_checkpointing=full ({full:.2f} GB)")
    shorter = seq // 2
    limit = (usable_gb or 0) - RUNTIME_GB
    while shorter > MIN_SCALED_SEQ_LEN and rehearsal_plan_gb(config, shorter, 1, ranks) > limit:
        shorter //= 2
    if MIN_SCALED_SEQ_LEN <= shorter < seq:
        fixes.append(f"--seq-len {shorter} ({rehearsal_plan_gb(config, shorter, 1, ranks):.2f} GB "
                     "at micro-batch 1)")  # fmt: skip
    return fixes


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
    return _losses(work / "resumed")


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
        peak = _peak_memory_gb(work / "straight")
        baseline = 0.0 if cuda else _runtime_baseline_gb(config, work, launch, seq_len, micro)
        measured = peak - baseline
        error = (predicted - measured) / measured
        report.numbers["memory"] = {"predicted_gb": predicted, "measured_gb": measured,
                                    "peak_gb": peak, "runtime_baseline_gb": baseline, "error": error}  # fmt: skip
        row["go"] = abs(error) <= MEMORY_TOLERANCE
        row["detail"] = (f"plan {predicted:.3f} GB, measured {measured:.3f} GB per rank "
                         f"(peak {peak:.3f} less runtime {baseline:.3f}): error {error:+.1%}")  # fmt: skip


def _runtime_baseline_gb(config, work: Path, launch, seq_len: int, micro: int) -> float:
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
    return _peak_memory_gb(work / "tiny")


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


# ----------------------------------------------------------------------------- the whole
def preflight(
    config_path: str | None,
    overrides: list[str] | None = None,
    options: PreflightOptions | None = None,
    work_dir: Path | None = None,
    log: Callable[[str], Any] = lambda _: None,
) -> Report:
    """Run the checklist; return the report (``report.go`` is the verdict)."""
    options = options or PreflightOptions()
    report = Report(recipe=str(config_path or "quickstart"))
    config = check_config(report, config_path, overrides or [])
    if config is None:
        return report
    if options.check_data:
        check_sources(report, config, options.docs_per_source)
    plan = check_plan(report, config)
    check_extension_plan(report, config)
    if not config.pretrain.stages:
        with timed(report, "training rehearsal") as row:
            row["detail"] = (
                "skipped: pretrain.stages is empty, no stage to rehearse (the meta build, test "
                "steps, resume, throughput, memory and first scores are a stage's)"
            )
        return report
    check_meta_build(report, config, plan)
    if options.train:
        work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="llmflow-preflight-"))
        try:
            run_test_steps(report, config, options, work, log)
        finally:
            if work_dir is None:
                shutil.rmtree(work, ignore_errors=True)
    return report


class PreflightRun(BaseModel):
    """A preflight as the Prefect UI asks for it: a recipe, overrides, and how much to run."""

    model_config = ConfigDict(extra="forbid")

    preset: str = Field("smollm3-1.7b", description="A recipe in configs/ or a YAML path.")
    overrides: list[str] = Field(default_factory=list, description="Dotted overrides (a.b=value).")
    options: PreflightOptions = Field(default_factory=PreflightOptions)

    def path(self) -> str:
        """The recipe file: a path as given when it exists, else a preset shipped in configs/."""
        from llmflow.flows.deploy import PRESET_ROOT

        path = self.preset if self.preset.endswith(".yaml") else f"configs/{self.preset}.yaml"
        return path if Path(path).is_file() else str(PRESET_ROOT / path)

    def config(self):
        """The resolved recipe (a bad value fails here, before any compute)."""
        from llmflow.tasks.config import load_config

        return load_config(self.path(), self.overrides)


@flow(name="llmflow-preflight", log_prints=False)
def preflight_flow(run: PreflightRun = PreflightRun()) -> dict[str, Any]:  # noqa: B008
    """Preflight a recipe: the go/no-go table as an artifact; the report's numbers returned."""
    logger = get_run_logger()
    report = preflight(run.path(), run.overrides, run.options, log=logger.debug)
    verdict = "GO" if report.go else "NO-GO"
    create_table_artifact(
        report.rows(), key="preflight", description=f"Preflight of {report.recipe}: {verdict}"
    )
    logger.info(report.table().splitlines()[-1])  # the verdict; the table is the artifact
    return {"go": report.go, "table": report.table(), "numbers": report.numbers}
