"""Dense or MoE: the quickstart recipe trained twice per seed, once with the dense ``debug`` model
and once with ``moe-debug`` (8 experts of half the width, 2 per token: the same active
parameters plus a router), on the same data and tokens, then scored side by side.

Each arm is the recipe itself (``llmflow run --until evaluate`` with the model preset and
``pretrain.train.seed`` set), so the data steps are trained once and found in the store by the
others; the six exports are then evaluated together by ``llmflow evaluate`` (one leaderboard:
the ``llmflow-leaderboard`` table artifact). This script reads each arm's held-out loss after
every curriculum stage and its evaluation scores from the store, and prints one JSON line and a
markdown table (also written as ``ablation.md`` / ``ablation.json`` under the root).

    python benchmarks/ablation_dense_moe.py [--root /tmp/moe-ablation] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script or imported

from benchmarks.common import emit  # noqa: E402

ARMS = {"dense": "debug", "moe": "moe-debug"}
REPO = Path(__file__).resolve().parents[1]


def arm_overrides(preset: str, seed: int) -> list[str]:
    return [f"pretrain.train.model.preset={preset}", f"pretrain.train.seed={seed}"]


def run_arm(config: str, root: Path, preset: str, seed: int) -> float:
    """Train and evaluate one arm through the CLI; its wall seconds."""
    cmd = [sys.executable, "-m", "llmflow.flows.cli", "run", config, "--root", str(root)]
    cmd += ["--until", "evaluate"]
    for item in arm_overrides(preset, seed):
        cmd += ["--set", item]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, timeout=3600)
    return time.perf_counter() - started


def arm_outputs(config: str, root: Path, preset: str, seed: int) -> dict[str, str]:
    """The URIs of one arm's steps (all in the store after `run_arm`), by step name."""
    from llmflow.flows.recipe import planned
    from llmflow.tasks.config import load_config
    from llmflow.tasks.framework.executor import all_cached

    overrides = arm_overrides(preset, seed) + [f"root={root}", "until=evaluate"]
    cfg = load_config(config, overrides)
    outcome = all_cached(planned(cfg), cfg.root)
    if outcome is None:
        raise RuntimeError(f"the {preset} arm of seed {seed} is not in the store under {root}")
    uris: dict[str, list[str]] = {}
    for row in outcome.rows():
        uris.setdefault(row.step, []).append(row.uri)
    return {step: values for step, values in uris.items()}


def arm_result(uris: dict[str, list[str]]) -> dict:
    """Held-out loss after each curriculum stage, the final load balance, evaluation scores."""
    curriculum = [uri for uri in uris["pretrain"] if "-ctx" not in Path(uri).name]
    stages = [json.loads((Path(uri) / "summary.json").read_text()) for uri in curriculum]
    last = stages[-1]
    scores = {}
    for uri in uris.get("evaluate", []):
        if "-base-" in Path(uri).name:  # the pretrained model's scores (not the extended one's)
            scores = _scalars(json.loads((Path(uri) / "results.json").read_text())["metrics"])
    return {
        "val_loss_by_stage": [s.get("val_loss") for s in stages],
        "val_loss": last.get("val_loss"),
        "load_max_mean": last.get("moe_load_max_mean"),
        "tokens_per_s": last.get("tokens_per_s"),
        "scores": scores,
        "export": next((u for u in uris.get("export", []) if "-base-" in Path(u).name), None),
    }


def _scalars(metrics: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, dict):
            out.update(_scalars(value, name + "/"))
    return out


def table(results: dict[str, dict[int, dict]]) -> tuple[list[str], dict]:
    """Markdown rows (metric, dense mean ± sd, moe mean ± sd, difference) and the same as JSON."""
    metrics = ["val_loss"]  # not tokens/s: the arms may share the machine with other work
    metrics += sorted(set.intersection(*(set(r["scores"]) for a in results.values()
                                           for r in a.values())))  # fmt: skip
    lines = ["| metric | dense (mean ± sd over seeds) | MoE | MoE - dense, per seed |",
             "|---|---|---|---|"]  # fmt: skip
    summary = {}
    for metric in metrics:
        values = {arm: [_get(r, metric) for r in per_seed.values()]
                  for arm, per_seed in results.items()}  # fmt: skip
        if any(v is None for vs in values.values() for v in vs):
            continue
        mean = {arm: statistics.mean(vs) for arm, vs in values.items()}
        sd = {arm: statistics.stdev(vs) if len(vs) > 1 else 0.0 for arm, vs in values.items()}
        summary[metric] = {"dense": values["dense"], "moe": values["moe"]}
        paired = ", ".join(f"{m - d:+.4f}" for d, m in zip(values["dense"], values["moe"],
                                                           strict=True))  # fmt: skip
        lines.append(
            f"| {metric} | {mean['dense']:.4f} ± {sd['dense']:.4f} | {mean['moe']:.4f} ± "
            f"{sd['moe']:.4f} | {paired} |"
        )
    return lines, summary


def _get(result: dict, metric: str) -> float | None:
    return result["scores"].get(metric) if metric in result["scores"] else result.get(metric)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/moe-ablation"))
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-only", choices=sorted(ARMS), default=None,
                        help="only train and evaluate this arm (no table)")  # fmt: skip
    args = parser.parse_args()
    root = args.root.resolve()
    results: dict[str, dict[int, dict]] = {arm: {} for arm in ARMS}
    seconds = {}
    for seed in args.seeds:
        for arm, preset in ARMS.items():
            if args.train_only not in (None, arm):
                continue
            seconds[f"{arm}-{seed}"] = round(run_arm(args.config, root, preset, seed), 1)
            if args.train_only is None:
                results[arm][seed] = arm_result(arm_outputs(args.config, root, preset, seed))
    if args.train_only is not None:
        print(json.dumps(seconds))
        return
    lines, summary = table(results)
    (root / "ablation.md").write_text("\n".join(lines) + "\n")
    (root / "ablation.json").write_text(json.dumps(results, indent=2))
    print("\n".join(lines))
    emit({"bench": "ablation_dense_moe", "seeds": args.seeds, "seconds": seconds,
          "metrics": summary})  # fmt: skip


if __name__ == "__main__":
    main()
