"""Data stages at scale: one Prefect task per stage (threads, processes, Ray) vs datatrove.

Corpus: real text (WikiText-2 validation and tinyshakespeare from ``--text-dir``) cut into
sentences and recombined into ~1.5 KB documents of random sentences, repeated until ``--gb``
gigabytes, with planted exact copies and near copies (1-3 words replaced) of earlier documents,
written once as ``--shards`` Parquet shards (a committed store output) before any clock starts.

Ways, each in its own driver process (so its peak RSS is its own), 2 workers each, on one
temporary Prefect server (``prefect_test_harness``) started by this script:

- ``stage``: a thread pool, one Prefect task per stage, exact dedup with the Bloom filter, near
  dedup with the single-process union-find (one Prefect task per shard, the old ``shard`` way,
  was removed with ``runner.fan_out``; its figures are in the results of 2026-11-26);
- ``processes`` (opt-in): the same on a pool of 2 spawned processes (``runner.kind=processes``);
- ``default`` (opt-in): the runner's defaults, threads with the size rule (a stage of
  ``runner.processes_from_mb`` or more runs on 2 spawned processes); ``stage`` turns the rule off;
- ``ray``: ``runner.kind=ray`` on a local Ray cluster (127.0.0.1, 2 CPUs), one Prefect task per
  stage, exact and near dedup ``method=partitioned`` (Ray tasks);
- ``datatrove``: datatrove 0.10's ``LocalPipelineExecutor`` (workers=2, one task per shard):
  reader -> GopherRepetition -> GopherQuality -> C4(filter_no_terminal_punct=False) ->
  FineWebQuality -> writer + MinhashDedupSignature, then buckets, cluster, and the filter writing
  the kept documents; ``datatrove_ray`` (opt-in, one Ray actor per task): the same on its ``RayPipelineExecutor``.

Ours runs the curate subgraph (``tasks.curation.recipe.add_curation``: normalize, filter,
exact hashes, MinHash signatures, exact dedup, near dedup, finalize; the filters are datatrove's
FineWeb chain as in ``bench_curation.py``, PII and the quality model off, as datatrove's side has
neither). datatrove has no document-level exact dedup or normalisation here: ours does more work.

Figures per way: wall time (for ``ray`` without the local cluster's start, ``ray_start_s``, a
fixed cost: the cluster starts first and both runs below use it); per-shard orchestration
overhead, twice: (wall - summed step compute / 2 workers) / shards (rough: the global stages
run on one worker), and a no-op stage over ``--noop-shards`` one-row shards
(``tasks.framework.stage_overhead``; datatrove: a reader-only pipeline, one task per shard);
Prefect task runs of the way's flow run (``read_task_runs`` on the server); the driver's peak
RSS (VmHWM) and the peak RSS of the driver plus its worker processes while near dedup ran
(sampled every 0.2 s). Ratios are the peer's wall time over ours (above 1: ours faster), all
ways measured in the same run. Prints one JSON line per comparison, the first the headline.

``--stress``: the no-op mapped stage, one task per stage on threads, over 1,000, 5,000 and
10,000 shards, each in a fresh driver: it must finish, and the driver's VmHWM must be flat.

Ratios need a quiet machine (1-minute load < 2.5); the load at start and end is in every line.

    python benchmarks/bench_data_scale.py --text-dir ../shared/data/text [--gb 0.05]
        [--shards 2000] [--ways stage ray datatrove [processes] [datatrove_ray]] [--stress]
        [--results benchmarks/results/session-20261126.jsonl] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from benchmarks.common import append_results, emit, load_average  # noqa: E402
from llmflow.tasks.curation.config import MinhashConfig  # noqa: E402
from llmflow.tasks.framework.step import Metrics, step  # noqa: E402

WAYS = ("stage", "ray", "datatrove", "processes", "datatrove_ray", "default")
DEFAULT_WAYS = WAYS[:3]
OURS = ("stage", "processes", "ray", "default")
WORKERS = 2
SHARED_TEXT = ROOT.parent / "shared" / "data" / "text"
WORDS = ["alpha", "bravo", "delta", "omega", "zeta"]  # near-copy edits, as the sample plants


class ScaleCorpus(BaseModel):
    """What the benchmark corpus holds (its hash: a changed scale is another corpus)."""

    text_dir: str
    gb: float = Field(0.05, gt=0)
    num_shards: int = Field(2000, ge=1)
    exact_fraction: float = 0.01
    near_fraction: float = 0.01
    seed: int = 0


def detokenize(line: str) -> str:
    """WikiText's tokenized form back to prose (``a @-@ b`` -> ``a-b``, ``x , y`` -> ``x, y``,
    ``<unk>`` dropped): spaced punctuation counts as words and fails Gopher's alpha ratio."""
    line = re.sub(r" @([-,.])@ ", r"\1", line.replace("<unk>", " "))
    line = re.sub(r" +([.,;:!?)\]']|n't)", r"\1", line)
    return re.sub(r"([(\[]) +", r"\1", re.sub(r"  +", " ", line))


def sentence_pool(text_dir: Path) -> list[str]:
    """The sentences of WikiText-2 validation (detokenized) and tinyshakespeare's lines in groups
    of four."""
    wiki = detokenize((text_dir / "wikitext2_valid.txt").read_text(encoding="utf-8"))
    pool = [
        s.strip()
        for line in wiki.splitlines()
        if line.strip() and not line.strip().startswith("=")
        for s in re.split(r"(?<=[.!?])\s+", line)
        if len(s.split()) >= 6
    ]
    lines = [x for x in (text_dir / "tinyshakespeare.txt").read_text().splitlines() if x.strip()]
    pool += [" ".join(lines[i : i + 4]) for i in range(0, len(lines) - 3, 4)]
    return pool


def _near_copy(rng: random.Random, text: str) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), min(len(words), rng.randint(1, 3))):
        words[i] = rng.choice(WORDS)
    return " ".join(words)


@step("bench-scale-corpus")
def scale_corpus(cfg: ScaleCorpus, out: Path) -> Metrics:
    """Documents of 10-20 random real sentences in paragraphs of five, to ``cfg.gb`` GB, with
    planted exact and near copies of earlier documents, dealt round-robin into the shards."""
    rng = random.Random(cfg.seed)
    pool = sentence_pool(Path(cfg.text_dir))
    target, size = int(cfg.gb * 1e9), 0
    shards: list[list[dict]] = [[] for _ in range(cfg.num_shards)]
    recent: list[str] = []
    counts = {"documents": 0, "exact_copies": 0, "near_copies": 0}
    while size < target:
        i, roll = counts["documents"], rng.random()
        if recent and roll < cfg.exact_fraction:
            text, kind = rng.choice(recent), "exact"
        elif recent and roll < cfg.exact_fraction + cfg.near_fraction:
            text, kind = _near_copy(rng, rng.choice(recent)), "near"
        else:
            sents = rng.sample(pool, rng.randint(10, 20))
            text = "\n".join(" ".join(sents[j : j + 5]) for j in range(0, len(sents), 5))
            kind = "doc"
            recent = (recent + [text])[-2000:]
        if kind != "doc":
            counts[f"{kind}_copies"] += 1
        shards[i % cfg.num_shards].append(
            {"id": f"{kind}-{i:09d}", "text": text, "domain": "web", "source": "bench"}
        )
        counts["documents"] += 1
        size += len(text.encode())
    (out / "shards").mkdir()
    for s, rows in enumerate(shards):
        table = pa.table({k: [r[k] for r in rows] for k in ("id", "text", "domain", "source")})
        pq.write_table(table, out / "shards" / f"part-{s:06d}.parquet")
    return {**counts, "bytes": size, "num_shards": cfg.num_shards}


def build_corpus(store_root: Path, cfg: ScaleCorpus) -> tuple[str, dict]:
    """The corpus as a committed output (its URI) and its counts."""
    from llmflow.tasks.framework.executor import Executor
    from llmflow.tasks.framework.graph import Graph

    graph = Graph()
    node = graph.add(scale_corpus, cfg, "bench")
    result = Executor(str(store_root)).run(graph)[node]
    return result.uri, dict(result.metrics)


# ---------------------------------------------------------------- memory sampling (every way)


class RssSampler:
    """This process's RSS and that of its descendants, every ``every_s`` (psutil), as
    (unix time, own bytes, descendants' bytes). A Prefect server process is left out."""

    def __init__(self, every_s: float = 0.2):
        import psutil

        self.me, self.every_s = psutil.Process(), every_s
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            kids = 0
            for child in self.me.children(recursive=True):
                try:
                    if "prefect" in " ".join(child.cmdline()[:4]):
                        continue
                    kids += child.memory_info().rss
                except psutil.Error:
                    continue
            self.samples.append((time.time(), self.me.memory_info().rss, kids))
            self._stop.wait(self.every_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak_mib(self, start: float, end: float) -> dict:
        inside = [s for s in self.samples if start - self.every_s <= s[0] <= end + self.every_s]
        if not inside:
            return {"driver": None, "driver_plus_workers": None, "samples": 0}
        return {
            "driver": round(max(s[1] for s in inside) / 2**20, 1),
            "driver_plus_workers": round(max(s[1] + s[2] for s in inside) / 2**20, 1),
            "samples": len(inside),
        }


def vmhwm_mib() -> float:
    """This process's peak resident set (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


# ---------------------------------------------------------------- our ways (one driver each)


def curate_config(way: str, partitions: int | None = None):
    """Ours: datatrove's FineWeb chain, PII and the quality model off; ``ray``: both dedups
    partitioned (``partitions`` each; None: the config's default)."""
    from benchmarks.bench_curation import bench_config
    from llmflow.tasks.curation.config import CurateConfig

    dedup = {"method": "partitioned"} if way == "ray" else {}
    if dedup and partitions:
        dedup["partitions"] = partitions
    return CurateConfig.model_validate(
        {
            "filters": bench_config().model_dump(),
            "pii": {"enabled": False},
            "quality_model": {"enabled": False},
            "exact_dedup": dedup,
            "minhash": dedup,
        }
    )


def task_runs(flow_run_id: str, at_least: int, timeout_s: float = 120) -> int:
    """The flow run's task runs on the server, once at least ``at_least`` and settled (the
    server records them from events, after the flow ends)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    def count() -> int:
        runs = 0
        with get_client(sync_client=True) as client:
            mine = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            while True:
                page = client.read_task_runs(flow_run_filter=mine, limit=200, offset=runs)
                runs += len(page)
                if len(page) < 200:
                    return runs

    deadline, last = time.monotonic() + timeout_s, count()
    while time.monotonic() < deadline:
        time.sleep(2)
        now = count()
        if now >= at_least and now == last:
            return now
        last = now
    return last


def run_ours(
    way: str, corpus: str, root: Path, noop_shards: int, partitions: int | None = None
) -> dict:
    """One of our ways: the curate subgraph on Prefect, then the no-op stage's overhead."""
    from prefect import flow
    from prefect.runtime import flow_run
    from prefect.task_runners import ThreadPoolTaskRunner

    from llmflow.tasks.config import RunnerConfig
    from llmflow.tasks.curation.recipe import add_curation
    from llmflow.tasks.framework.executor import Mapped, PrefectExecutor
    from llmflow.tasks.framework.graph import Existing, Graph
    from llmflow.tasks.framework.stage_overhead import measure

    kind = way if way in ("ray", "processes") else "threads"
    size_rule = {} if way == "default" else {"processes_from_mb": None}
    runner = RunnerConfig(kind=kind, max_workers=WORKERS, ray={"address": "local"}, **size_rule)
    graph = Graph()
    num_shards = len(list(Path(corpus, "shards").glob("*.parquet")))
    final = add_curation(graph, curate_config(way, partitions), Existing(corpus), "bench")
    ids: dict = {}
    ray_start = _start_ray() if way == "ray" else 0.0

    @flow(name=f"bench-data-scale-{way}", task_runner=ThreadPoolTaskRunner(max_workers=WORKERS))
    def curate():
        ids["flow_run"] = flow_run.get_id()
        return PrefectExecutor(str(root / "store"), runner=runner).run(graph)

    with RssSampler() as sampler:
        started = time.perf_counter()
        outcome = curate()
        wall = time.perf_counter() - started
    stages, compute = {}, 0.0
    for node in graph.nodes:
        result = outcome[node]
        if isinstance(result, Mapped):
            compute += sum(r.seconds for r in result.results)
        else:
            compute += result.seconds
        stages[node.step.name] = (
            round(result.summary(node.name).seconds, 2)
            if isinstance(result, Mapped)
            else round(result.seconds, 2)
        )
    near = next(n for n in graph.nodes if n.step.name == "curate-near-dedup")
    lineage = json.loads(Path(outcome[near].uri, "lineage.json").read_text())
    window = [datetime.fromisoformat(lineage[k]).timestamp() for k in ("started_at", "ended_at")]
    near_peak = sampler.peak_mib(*window)
    runs = task_runs(ids["flow_run"], len(graph.nodes))
    kept = _kept_ids(Path(outcome[final].uri) / "shards")
    noop = measure(str(root / "noop"), noop_shards, "stage", kind)
    return {
        "way": way,
        "wall_s": round(wall, 2),
        "ray_start_s": round(ray_start, 2),
        "compute_s": round(compute, 2),
        "overhead_ms_per_shard": round(1000 * (wall - compute / WORKERS) / num_shards, 2),
        "noop_ms_per_shard": noop["ms_per_shard"],
        "noop_shards": noop_shards,
        "prefect_task_runs": runs,
        "driver_peak_rss_mib": vmhwm_mib(),
        "near_dedup_peak_rss_mib": near_peak,
        "stages_s": stages,
        "kept": len(kept),
        "kept_digest": _digest(kept),
    }


def _start_ray() -> float:
    """Start the local Ray cluster the engine and the no-op stage then share (loopback only, 2
    CPUs, as ``runner.ray.address=local`` starts it); its start-up seconds, reported apart: a
    fixed cost, not a per-shard one."""
    import ray

    from llmflow.tasks.framework.ray_cluster import init_ray

    started = time.perf_counter()
    init_ray("local", num_cpus=WORKERS)
    ray.get([ray.remote(lambda: 0).remote() for _ in range(WORKERS)])  # both workers up
    return time.perf_counter() - started


def _kept_ids(folder: Path) -> list[str]:
    return sorted(
        i for p in folder.rglob("*.parquet") for i in pq.read_table(p).column("id").to_pylist()
    )


def _digest(ids: list[str]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- datatrove


def run_datatrove(way: str, corpus: str, root: Path, noop_shards: int) -> dict:
    """datatrove's filters + MinHash over the same shards, one task per shard, 2 workers."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )
    from datatrove.pipeline.readers import ParquetReader
    from datatrove.pipeline.writers import ParquetWriter
    from datatrove.utils.text import split_into_words

    split_into_words("warm up spaCy.")  # the model's load is not part of the timing
    shards = str(Path(corpus, "shards"))
    num_shards = len(list(Path(shards).glob("*.parquet")))
    cfg = MinhashConfig()
    work = root / "datatrove"
    folders = {n: str(work / n) for n in ("filtered", "sigs", "buckets", "remove", "kept")}
    if way == "datatrove_ray":
        from datatrove.executor.ray import RayPipelineExecutor

        ray_start = _start_ray()

        def run(name, pipeline, tasks):
            RayPipelineExecutor(
                pipeline=pipeline,
                tasks=tasks,
                workers=WORKERS,
                logging_dir=str(work / "logs" / name),
            ).run()
    else:
        ray_start = 0.0

        def run(name, pipeline, tasks):
            LocalPipelineExecutor(
                pipeline=pipeline,
                tasks=tasks,
                workers=WORKERS,
                logging_dir=str(work / "logs" / name),
            ).run()

    window = [0.0, 0.0]
    with RssSampler() as sampler:
        started = time.perf_counter()
        run(
            "filter-sig",
            [
                ParquetReader(shards),
                GopherRepetitionFilter(),
                GopherQualityFilter(),
                C4QualityFilter(filter_no_terminal_punct=False),
                FineWebQualityFilter(),
                ParquetWriter(folders["filtered"]),
                MinhashDedupSignature(folders["sigs"], config=cfg),
            ],
            num_shards,
        )
        _fill_empty_ranks(Path(folders["filtered"]), num_shards)
        window[0] = time.time()
        run("buckets", [MinhashDedupBuckets(folders["sigs"], folders["buckets"], config=cfg)],
            cfg.num_buckets)  # fmt: skip
        run("cluster", [MinhashDedupCluster(folders["buckets"], folders["remove"], config=cfg)], 1)
        window[1] = time.time()
        run(
            "dedup-filter",
            [
                ParquetReader(folders["filtered"]),
                MinhashDedupFilter(folders["remove"]),
                ParquetWriter(folders["kept"]),
            ],
            num_shards,
        )
        wall = time.perf_counter() - started
    kept = _kept_ids(Path(folders["kept"]))
    noop_dir = root / "noop" / "shards"
    noop_dir.mkdir(parents=True)
    for i in range(noop_shards):
        pq.write_table(pa.table({"id": [str(i)], "text": ["x"]}), noop_dir / f"{i:06d}.parquet")
    noop_start = time.perf_counter()
    run("noop", [ParquetReader(str(noop_dir))], noop_shards)
    noop = time.perf_counter() - noop_start
    return {
        "way": way,
        "wall_s": round(wall, 2),
        "ray_start_s": round(ray_start, 2),
        "noop_ms_per_shard": round(1000 * noop / noop_shards, 2),
        "noop_shards": noop_shards,
        "prefect_task_runs": 0,
        "datatrove_tasks": 2 * num_shards + cfg.num_buckets + 1,
        "driver_peak_rss_mib": vmhwm_mib(),
        "near_dedup_peak_rss_mib": sampler.peak_mib(*window),
        "kept": len(kept),
        "kept_digest": _digest(kept),
    }


def _fill_empty_ranks(folder: Path, num_ranks: int) -> None:
    """An empty Parquet file for each rank whose documents were all filtered out, so rank r of
    the dedup filter reads rank r's documents (the removal ids are per signature rank)."""
    files = sorted(folder.glob("*.parquet"))
    if len(files) == num_ranks or not files:
        return
    schema = pq.read_schema(files[0])
    for rank in range(num_ranks):
        path = folder / f"{rank:05d}.parquet"
        if not path.exists():
            pq.write_table(schema.empty_table(), path)


# ---------------------------------------------------------------- the driver side


def worker_main(args) -> None:
    root = Path(args.root)
    if args.worker.startswith("datatrove"):
        record = run_datatrove(args.worker, args.corpus, root, args.noop_shards)
    else:
        record = run_ours(args.worker, args.corpus, root, args.noop_shards, args.partitions)
    Path(args.out).write_text(json.dumps(record))


def stress_main(args) -> None:
    """One no-op mapped stage, one task per stage on threads, over ``args.stress_worker`` shards."""
    from llmflow.tasks.framework.stage_overhead import measure

    with RssSampler() as sampler:
        record = measure(args.root, args.stress_worker, "stage", "threads")
    record["driver_peak_rss_mib"] = vmhwm_mib()
    record["driver_sampled_peak_mib"] = round(max(s[1] for s in sampler.samples) / 2**20, 1)
    Path(args.out).write_text(json.dumps(record))


def spawn(extra: list[str], env: dict, timeout_s: float, out: Path) -> dict:
    """Run this script as a fresh driver; its JSON record (or the failure's tail)."""
    command = [sys.executable, str(Path(__file__).resolve()), *extra, "--out", str(out)]
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if done.returncode != 0 or not out.exists():
        return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    return json.loads(out.read_text())


def prefect_env() -> tuple[object, dict]:
    """A temporary Prefect server for every driver (entered by the caller) and their env."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    # NOTE: the server's telemetry service races the harness's start on SQLite ("database is
    # locked", a harmless traceback) and cannot reach the network here anyway
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    harness = prefect_test_harness(server_startup_timeout=120)
    harness.__enter__()
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return harness, env


def ratio(peer: dict, ours: dict) -> float | None:
    if "wall_s" not in peer or "wall_s" not in ours:
        return None
    return round(peer["wall_s"] / ours["wall_s"], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text-dir", type=Path, default=SHARED_TEXT)
    parser.add_argument("--gb", type=float, default=0.05, help="corpus size, GB of text")
    parser.add_argument("--shards", type=int, default=2000)
    parser.add_argument("--noop-shards", type=int, default=500)
    parser.add_argument(
        "--ways",
        nargs="*",
        choices=WAYS,
        default=list(DEFAULT_WAYS),
        help="datatrove_ray is opt-in: it starts one Ray actor per task, seconds each here; "
        "none given (with --stress): the stress run alone",
    )
    parser.add_argument(
        "--partitions", type=int, help="ray way: exact and near dedup partitions (default 64)"
    )
    parser.add_argument("--stress", action="store_true", help="10,000-shard no-op stage (slow)")
    parser.add_argument("--stress-scales", type=int, nargs="+", default=[1000, 5000, 10000])
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per way")
    parser.add_argument("--results", type=Path, help="also append the JSON lines to this file")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: tiny, not a result")
    parser.add_argument("--work", type=Path, help="keep the work here (default: a temp folder)")
    # a driver's own arguments (this script re-run as one way)
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--stress-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args)
    if args.stress_worker:
        return stress_main(args)
    if args.quick:
        args.gb, args.shards, args.noop_shards = 0.0003, 8, 8
        args.stress_scales = [50, 100]
        if args.ways == list(DEFAULT_WAYS):
            args.ways = ["stage", "datatrove"]
    if any(w.startswith("datatrove") for w in args.ways):
        try:
            import datatrove  # noqa: F401
        except ImportError:
            sys.exit('datatrove is not installed: pip install -e ".[bench]"')
    load_start = load_average()
    print(
        f"data scale: {args.gb:g} GB in {args.shards} shards, ways {args.ways}, {WORKERS} "
        f"workers, load {load_start}" + (" (quick: smoke run, not a result)" if args.quick else ""),
        flush=True,
    )
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-data-scale-"))
    records: list[dict] = []
    harness, env = prefect_env()
    try:
        corpus_cfg = ScaleCorpus(text_dir=str(args.text_dir), gb=args.gb, num_shards=args.shards)
        started, corpus, counts = time.perf_counter(), "", {}
        if args.ways:
            corpus, counts = build_corpus(work / "corpus", corpus_cfg)
            from llmflow.tasks.framework.store import Store

            # what runner.processes_from_mb compares: the first stage's mapped input (Parquet)
            counts["stage_input_bytes"] = Store(str(work / "corpus")).output_bytes(corpus)
            print(f"corpus: {counts} in {time.perf_counter() - started:.1f} s", flush=True)
        ways: dict[str, dict] = {}
        for way in args.ways:
            root = work / way
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            load = load_average()
            ways[way] = spawn(
                ["--worker", way, "--corpus", corpus, "--root", str(root),
                 "--noop-shards", str(args.noop_shards),
                 *(["--partitions", str(args.partitions)] if args.partitions else [])],
                env, args.timeout, root / "record.json",
            )  # fmt: skip
            ways[way]["load_before"] = load
            print(f"{way}: {json.dumps(ways[way])}", flush=True)
        stress = []
        if args.stress:
            for n in args.stress_scales:
                root = work / f"stress-{n}"
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir(parents=True)
                stress.append(
                    spawn(
                        ["--stress-worker", str(n), "--root", str(root)],
                        env,
                        args.timeout,
                        work / f"stress-{n}.json",
                    )  # fmt: skip
                )
                print(f"stress {n}: {json.dumps(stress[-1])}", flush=True)
    finally:
        harness.__exit__(None, None, None)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    common = {
        "quick": args.quick,
        "scale": {"gb": args.gb, "shards": args.shards, **counts},
        "workers": WORKERS,
        "ray_dedup_partitions": args.partitions or MinhashConfig().partitions,
        "load_start": load_start,
    }
    ours_kept = {ways[w].get("kept_digest") for w in OURS if w in ways}
    pairs = [
        (o, p)
        for o, peers in (
            ("stage", ("datatrove", "datatrove_ray")),
            ("processes", ("stage", "datatrove")),
            ("default", ("stage", "processes")),
            ("ray", ("stage", "processes", "datatrove", "datatrove_ray")),
        )
        for p in peers
        if o in ways and p in ways
    ]
    if ways:
        records.append(
            emit(
                "data_scale",
                **common,
                ratio={f"{o}_vs_{p}": ratio(ways[p], ways[o]) for o, p in pairs},
                ratio_means="peer wall s / ours wall s, same run (above 1: ours faster)",
                same_kept_ours=len(ours_kept - {None}) == 1,
                ways=ways,
            )
        )
    for ours, peer in pairs:
        records.append(
            emit(
                f"data_scale.{ours}_vs_{peer}",
                **common,
                ratio=ratio(ways[peer], ways[ours]),
                ours=ways[ours],
                peer=ways[peer],
            )
        )
    if stress:
        peaks = [s.get("driver_peak_rss_mib") for s in stress]
        records.append(
            emit(
                "data_scale.stress",
                **common,
                scales=args.stress_scales,
                runs=stress,
                driver_peak_rss_mib=peaks,
                flat=(None if None in peaks else round(max(peaks) / min(peaks), 3)),
                flat_means="largest / smallest driver VmHWM over the scales",
            )
        )
    append_results(args.results, records)


if __name__ == "__main__":
    main()
