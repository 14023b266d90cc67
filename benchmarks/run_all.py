"""Run every benchmark with fixed, documented arguments; one JSONL file and one markdown table.

    python benchmarks/run_all.py [--data ../shared/data] [--out benchmarks/results] [--quick]
        [--only NAME ...] [--max-load 2.5]

Each benchmark runs alone, as its own process, with the arguments in ``BENCHMARKS`` below (at
least 3 rounds; real text from ``--data`` where a benchmark takes it). Before each one the
1-minute load average must be at most ``--max-load``: the runner waits up to ``--wait`` seconds
for it to fall, and otherwise refuses to report that benchmark (its row says so). Ratios taken
on a loaded machine did not reproduce; nothing else should run while this does.

``--quick`` runs each benchmark for seconds on tiny settings, so the scripts never rot (CI's
second job runs it); its figures are not results and the table says so.

Outputs: ``{out}/run-{UTC time}.jsonl`` (one line per benchmark: the benchmark's own JSON
record, plus ``runner`` fields: arguments, exit code, wall seconds, load before, goals met) and
``{out}/run-{UTC time}.md`` (figure, goal, measured, met, load average).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Goal:
    """A figure of a benchmark's record (dotted path) and the bound it must meet."""

    path: str
    op: str  # ">=" or "<="
    bound: float
    label: str

    def value(self, record: dict):
        value = record
        for key in self.path.split("."):
            if not isinstance(value, dict) or key not in value:
                return None
            value = value[key]
        return value

    def met(self, record: dict) -> bool | None:
        value = self.value(record)
        if not isinstance(value, int | float):
            return None
        return value >= self.bound if self.op == ">=" else value <= self.bound


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    full: list[str]
    quick: list[str]
    goals: list[Goal] = field(default_factory=list)
    needs_data: bool = False
    timeout_s: int = 1800


def benchmarks(data: Path) -> list[Bench]:
    text = str(data / "text")
    return [
        Bench("train_step", "bench_train_step.py", ["--rounds", "9", "--steps", "2", "--warmup", "1"],
              ["--rounds", "1", "--steps", "1", "--warmup", "0", "--no-compile",
               "--packed-shape", "2", "256", "64"],
              [Goal("ratio", ">=", 1.2, "eager train step vs transformers SmolLM3"),
               Goal("ratios.packed", ">=", 1.5,
                    "packed documents train step vs transformers SmolLM3")]),
        Bench("pack", "bench_pack.py", ["--text-dir", text, "--rounds", "3"],
              ["--text-dir", text, "--rounds", "1", "--repeat", "1"],
              [Goal("ratio", ">=", 1.5, "tokenize + pack vs datasets.map, real text")], True),
        Bench("activation_ckpt", "bench_activation_ckpt.py", ["--rounds", "3"],
              ["--rounds", "1", "--seq", "64", "--preset", "debug", "--steps", "1"],
              [Goal("memory_ratio", "<=", 0.3, "full activation checkpointing, memory"),
               Goal("time_ratio", "<=", 1.4, "full activation checkpointing, time")]),
        Bench("async_ckpt", "bench_async_ckpt.py",
              ["--num-layers", "8", "--steps", "8", "--interval", "4", "--rounds", "3",
               "--seq-len", "256"],
              ["--preset", "debug", "--steps", "2", "--interval", "1", "--rounds", "1",
               "--seq-len", "16"],
              [Goal("ratio", "<=", 0.2, "async checkpoint, blocked time vs sync")]),
        Bench("quality_per_compute", "bench_quality_per_compute.py", ["--text-dir", text,
              "--seeds", "3"], ["--text-dir", text, "--quick", "--seeds", "1"],
              [Goal("ratio", ">=", 1.05, "GPT-2 held-out loss / ours, equal FLOPs")], True,
              timeout_s=3600),
        Bench("curation", "bench_curation.py", ["--text-dir", text, "--rounds", "3"],
              ["--rounds", "1", "--near-copies", "10"],
              [Goal("ratio.filters", ">=", 1.0, "filter chain vs datatrove"),
               Goal("ratio.minhash", ">=", 1.0, "MinHash vs datatrove")], True),
        Bench("decontam", "bench_decontam.py", ["--data", str(data), "--rounds", "3",
              "--lm-eval"], ["--data", str(data), "--rounds", "1", "--clean", "50",
              "--per-set", "5"],
              [Goal("ratio", ">=", 1.0, "decontamination scan vs datatrove")], True),
        Bench("meta_init", "bench_meta_init.py", ["--rounds", "3"],
              ["--rounds", "1", "--preset", "debug"],
              [Goal("ratio", "<=", 0.6, "meta-device init, peak RSS per rank")]),
        Bench("loader", "bench_loader.py", ["--rounds", "4"],
              ["--rounds", "1", "--gib", "0.01"],
              [Goal("ratio", ">=", 1000, "train steps per loader batch")]),
        Bench("muon", "bench_muon.py", ["--rounds", "4", "--steps", "3"],
              ["--rounds", "1", "--steps", "1"]),
        Bench("ingest_rss", "bench_ingest_rss.py", [], ["--scales", "1", "2"]),
        Bench("mfu", "bench_mfu.py", ["--rounds", "5", "--steps", "5", "--warmup", "3"],
              ["--quick", "--rounds", "1", "--steps", "1", "--warmup", "0", "--no-compile"],
              [Goal("mfu_compiled", ">=", 0.45, "MFU, 1.7B compiled bf16, one GPU"),
               Goal("compiled_vs_smollm3_eager", ">=", 1.3,
                    "compiled tokens/s vs transformers SmolLM3 eager")]),
        Bench("cached_rerun", "bench_cached_rerun.py", ["--rounds", "3"], ["--rounds", "1", "--until", "ingest"],
              [Goal("cached_s", "<=", 10.0, "cached re-run of the whole quickstart, seconds")],
              timeout_s=2400),
        Bench("data_scale", "bench_data_scale.py", ["--text-dir", text, "--stress"],
              ["--text-dir", text, "--quick"],
              [Goal("ratio.ray_vs_datatrove", ">=", 1.0, "curate on Ray vs datatrove local, wall"),
               Goal("ratio.stage_vs_datatrove", ">=", 1.0, "curate on threads vs datatrove local, wall"),
               Goal("ways.ray.noop_ms_per_shard", "<=", 20, "Ray stage overhead, ms per shard"),
               Goal("ways.stage.noop_ms_per_shard", "<=", 20,
                    "threads stage overhead, ms per shard")], True, timeout_s=3600),
        Bench("stage_layout", "bench_stage_layout.py", ["--shards", "2000", "10000", "--rounds", "3"],
              ["--quick"],
              [Goal("ratio.outputs", ">=", 1000, "outputs a 2,000-shard stage leaves, old / new"),
               Goal("ratio.stage_s", ">=", 0.9, "stage wall time, old layout / stage layout")],
              timeout_s=3600),
        Bench("cp_memory", "bench_cp_memory.py", ["--rounds", "3"], ["--quick"],
              [Goal("ratio", "<=", 0.55, "cp=2 step memory per rank vs one process, 8k tokens")]),
        Bench("attention", "bench_attention.py", ["--rounds", "3"], ["--quick"],
              [Goal("time_ratio", "<=", 0.5, "packed 8k row of 512-token documents vs causal, time"),
               Goal("memory_ratio", "<=", 1.1,
                    "packed 8k row of 512-token documents vs causal, memory")]),
        Bench("mfu_packed", "bench_mfu.py",
              ["--rounds", "5", "--steps", "5", "--warmup", "3", "--packed", "512"],
              ["--quick", "--rounds", "1", "--steps", "1", "--warmup", "0", "--no-compile",
               "--packed", "16"]),
        Bench("eval_overhead", "bench_eval_overhead.py", ["--rounds", "3", "--seeds", "5"],
              ["--quick"],
              [Goal("slowdown", "<=", 0.10,
                    "training slowdown, running evaluation on the second of two cores"),
               Goal("noise.clean_pairs_alerting", "<=", 0,
                    "clean seed pairs alerting at the default noise band")]),
        Bench("monitor", "bench_monitor.py", ["--rounds", "7", "--steps", "40"], ["--quick"],
              [Goal("overhead", "<=", 0.02, "health metrics + detectors, share of a train step"),
               Goal("clean_alerts", "<=", 0, "trainer alerts on 5 clean seeds")]),
        Bench("tp_seed_bug", "bench_tp_seed_bug.py", ["--steps", "48", "--seeds", "3"], ["--quick"]),
        Bench("moe", "bench_moe.py", ["--rounds", "7"], ["--quick", "--rounds", "1"],
              [Goal("ratio", ">=", 1.2,
                    "MoE block fwd+bwd vs transformers Qwen3-MoE (grouped_mm), fp32")]),
    ]  # fmt: skip


def wait_for_quiet(max_load: float, wait_s: float) -> float:
    """The 1-minute load average once at most ``max_load``, or the last one after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    load = os.getloadavg()[0]
    while load > max_load and time.monotonic() < deadline:
        time.sleep(5)
        load = os.getloadavg()[0]
    return load


def run_one(bench: Bench, quick: bool) -> tuple[dict | None, dict]:
    """The benchmark's last JSON record and the runner's facts about the run."""
    args = bench.quick if quick else bench.full
    command = [sys.executable, str(ROOT / "benchmarks" / bench.script), *args]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=bench.timeout_s,
                              cwd=ROOT / "benchmarks")  # fmt: skip
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = "timeout", exc.stdout or "", exc.stderr or ""
        out = out.decode() if isinstance(out, bytes) else out
        err = err.decode() if isinstance(err, bytes) else err
    records = []
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    facts = {"args": args, "exit": code, "wall_s": round(time.perf_counter() - started, 1)}
    if code != 0:
        facts["stderr_tail"] = err[-2000:]
    return (records[0] if records else None), {**facts, "extra_records": records[1:]}


def table(rows: list[dict], quick: bool) -> str:
    head = "# Benchmarks" + (" (quick mode: smoke run, not results)" if quick else "") + "\n\n"
    lines = ["| benchmark | figure | goal | measured | met | load before | load after |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        runner, record = row["runner"], row.get("record") or {}
        after = (record.get("load_avg") or ["-"])[0]
        if runner.get("refused"):
            lines.append(f"| {row['bench']} | - | - | refused: {runner['refused']} | - | "
                         f"{runner['load_before']} | - |")  # fmt: skip
            continue
        if not record:
            lines.append(f"| {row['bench']} | - | - | failed (exit {runner['exit']}) | - | "
                         f"{runner['load_before']} | - |")  # fmt: skip
            continue
        goals = row["goals"] or [{"label": "(no goal)", "goal": "-", "value": "-", "met": "-"}]
        for goal in goals:
            met = {True: "yes", False: "**no**", None: "-"}.get(goal["met"], goal["met"])
            lines.append(f"| {row['bench']} | {goal['label']} | {goal['goal']} | "
                         f"{goal['value']} | {met} | {runner['load_before']} | {after} |")  # fmt: skip
    return head + "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--quick", action="store_true", help="seconds each: scripts run, no figures"
    )
    parser.add_argument("--only", nargs="+", help="run only these benchmarks (names as listed)")
    parser.add_argument("--max-load", type=float, default=2.5)
    parser.add_argument("--wait", type=float, default=300, help="seconds to wait for a quiet box")
    args = parser.parse_args()
    specs = benchmarks(args.data.resolve())
    if args.only:
        unknown = sorted(set(args.only) - {b.name for b in specs})
        if unknown:
            parser.error(f"unknown benchmark(s) {unknown}; known: {[b.name for b in specs]}")
        specs = [b for b in specs if b.name in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + ("-quick" if args.quick else "")
    jsonl, md = args.out / f"run-{stamp}.jsonl", args.out / f"run-{stamp}.md"
    rows, failed = [], []
    for bench in specs:
        if bench.needs_data and not args.data.is_dir():
            print(f"{bench.name}: skipped, {args.data} is absent", flush=True)
            continue
        load = wait_for_quiet(args.max_load, 0 if args.quick else args.wait)
        runner: dict = {"load_before": round(load, 2), "quick": args.quick}
        record = None
        if load > args.max_load and not args.quick:
            runner["refused"] = f"load {load:.2f} > {args.max_load}"
        else:
            print(f"{bench.name}: running (load {load:.2f})", flush=True)
            record, facts = run_one(bench, args.quick)
            runner.update(facts)
            if record is None:
                failed.append(bench.name)
        goals = [
            {"label": g.label, "goal": f"{g.op} {g.bound:g}", "value": g.value(record or {}),
             "met": None if args.quick else g.met(record or {})}
            for g in bench.goals
        ]  # fmt: skip
        row = {"bench": bench.name, "record": record, "goals": goals, "runner": runner}
        rows.append(row)
        with open(jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        md.write_text(table(rows, args.quick))
        summary = ", ".join(f"{g['label']}: {g['value']} ({g['goal']})" for g in goals)
        print(f"{bench.name}: {runner.get('refused') or summary or 'done'}", flush=True)
    print(f"wrote {jsonl} and {md}")
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
