"""The pretrain steps' addresses of a few recipes and launch settings, as JSON on stdout.

Run by test_launch_addresses.py in this tree and in a checkout of an earlier commit (whose
``llmflow`` it imports through ``PYTHONPATH``): equal output means no launch refactor moved an
output. The address's own part is used (step, version, versioned config): the inputs' hashes come
from upstream steps, which launching does not touch.
"""

from __future__ import annotations

import json

VARIANTS = {
    "quickstart": (None, []),
    "torchrun-2": (None, ["pretrain.num_processes=2"]),
    "ray-1": (None, ["pretrain.launcher=ray", "pretrain.ray.workers=1"]),
    "ray-4": (None, ["pretrain.launcher=ray", "pretrain.ray.workers=4"]),
    "ray-4-with-processes-3": (
        None,
        ["pretrain.launcher=ray", "pretrain.ray.workers=4", "pretrain.num_processes=3"],
    ),
    "accelerate-8": (
        None,
        [
            "pretrain.accelerate_config=deployments/accelerate/multi_gpu_fsdp2.yaml",
            "pretrain.num_processes=8",
        ],
    ),
    "accelerate-cpu": (None, ["pretrain.accelerate_config=deployments/accelerate/cpu.yaml"]),
}
# Hub recipes cannot build their graph offline: their stage runs are built from the config alone.
OFFLINE = {"smollm3-3b": "smollm3-3b.yaml", "smollm3-1.7b": "smollm3-1.7b.yaml"}


def addresses() -> dict[str, list[list]]:
    """By variant: [name, world size, address part] of every pretrain and extension stage."""
    from llmflow.flows.recipe import recipe
    from llmflow.tasks.config import CONFIGS, load_config
    from llmflow.tasks.framework.hashing import step_hash
    from llmflow.tasks.pretrain.step import StageRun

    out = {}
    for label, (preset, overrides) in VARIANTS.items():
        config = load_config(str(CONFIGS / preset) if preset else None, overrides)
        nodes = recipe(config).find(step="pretrain")
        out[label] = [
            [n.name, n.config.world_size, step_hash(n.step.name, str(n.step.version), n.config, {})]
            for n in nodes
        ]
    for label, preset in OFFLINE.items():
        pretrain = load_config(str(CONFIGS / preset)).pretrain
        run = StageRun(**pretrain.launch_settings(), train=pretrain.train)
        out[label] = [["train", run.world_size, step_hash("pretrain", "2", run, {})]]
    return out


if __name__ == "__main__":
    print(json.dumps(addresses(), indent=1))
