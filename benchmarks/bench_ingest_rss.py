"""Peak memory of ingest (and of the surviving-id set exact dedup builds) as the corpus grows.

The corpus is the quickstart sample repeated k times (each copy's ids suffixed, so every id is
new). Each (scale, implementation) runs in a fresh process that reports its peak RSS. "ours" keeps
seen ids in the on-disk ``IdSet``; the peer "set" is the same code with a Python set instead (what
ingest and exact dedup did before). The slope is the RSS added per extra document between the two
largest scales: bounded memory means a slope near 0. Prints one JSON line.

    python benchmarks/bench_ingest_rss.py [--scales 1 10 100]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_corpus(root: Path, scale: int, sample_files: list[Path]) -> Path:
    """``scale`` copies of the sample's JSONL files, each record's id suffixed by its copy."""
    folder = root / f"x{scale}"
    folder.mkdir()
    for path in sample_files:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for copy in range(scale):
            with open(folder / f"c{copy:04d}-{path.name}", "w") as f:
                for record in records:
                    f.write(json.dumps({**record, "id": f"{record['id']}-c{copy}"}) + "\n")
    return folder


class SetIds(set):
    """The peer: every id in a Python set (IdSet's interface)."""

    def __init__(self, directory=None) -> None:
        super().__init__()

    def add(self, key: str) -> bool:
        new = key not in self
        super().add(key)
        return new

    def close(self) -> None:
        self.clear()

    def __enter__(self) -> SetIds:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def child(corpus: Path, out: Path, impl: str) -> None:
    """Ingest ``corpus`` and build the surviving-id set; print peak RSS and counts as JSON."""
    from llmflow.tasks.curation import exact_dedup
    from llmflow.tasks.ingest import ingest as ingest_module
    from llmflow.tasks.ingest.ingest import IngestConfig, ingest, list_files

    if impl == "set":
        ingest_module.IdSet = SetIds
        exact_dedup.IdSet = SetIds
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    metrics = ingest(IngestConfig(docs_per_shard=2000), list_files([str(corpus)]), out)
    alive = exact_dedup.surviving_ids([out])
    num_alive = len(alive)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    row = {"documents": metrics["documents"], "alive": num_alive, "seconds": round(seconds, 2)}
    print(json.dumps({**row, "rss_mb": peak / 1024, "rss_after_imports_mb": before / 1024}))


def run_child(corpus: Path, out: Path, impl: str) -> dict:
    command = [sys.executable, __file__, "--child", str(corpus), str(out), impl]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument(
        "--child", nargs=3, metavar=("CORPUS", "OUT", "IMPL"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        corpus, out, impl = args.child
        return child(Path(corpus), Path(out), impl)
    from llmflow.tasks.ingest.sample import SampleConfig, make_sample

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_sample(SampleConfig(), root / "sample")
        files = sorted((root / "sample").glob("*.jsonl"))
        results: dict[str, dict[int, dict]] = {"ours": {}, "set": {}}
        for scale in args.scales:
            corpus = make_corpus(root, scale, files)
            for impl in ("ours", "set"):  # alternate per scale: load hits both alike
                results[impl][scale] = run_child(corpus, root / f"out-{impl}-{scale}", impl)
        lo, hi = sorted(args.scales)[-2:]
        slopes = {
            impl: (r[hi]["rss_mb"] - r[lo]["rss_mb"])
            * 2**20
            / (r[hi]["documents"] - r[lo]["documents"])
            for impl, r in results.items()
        }
        same = all(
            results["ours"][s]["documents"] == results["set"][s]["documents"] for s in args.scales
        )
        print(json.dumps({
            "benchmark": "ingest_peak_rss",
            "slope_bytes_per_doc": {k: round(v, 1) for k, v in slopes.items()},
            "slope_between_scales": [lo, hi],
            "peak_rss_mb": {i: {s: round(r["rss_mb"], 1) for s, r in v.items()} for i, v in results.items()},
            "documents": {s: results["ours"][s]["documents"] for s in args.scales},
            "seconds": {i: {s: r["seconds"] for s, r in v.items()} for i, v in results.items()},
            "ratio_wall_set_over_ours": round(
                results["set"][hi]["seconds"] / max(results["ours"][hi]["seconds"], 1e-9), 3
            ),
            "identical_work": same,
            "loadavg": os.getloadavg(),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
