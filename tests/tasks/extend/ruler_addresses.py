"""Every node address of the quickstart graph, as JSON on stdout (``--ruler-off``: with
``extend.ruler.enabled=false``).

Run by test_ruler_recipe.py in this tree and in a checkout of an earlier commit (whose ``llmflow``
it imports through ``PYTHONPATH``): an input's hash is its upstream node's address, so the
addresses are computed as the store would, without running anything.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def addresses(overrides: list[str]) -> dict[str, str]:
    """By node label (``step:name``, numbered when repeated): its address."""
    from llmflow.flows.recipe import recipe
    from llmflow.tasks.config import load_config
    from llmflow.tasks.framework.graph import Node, Raw
    from llmflow.tasks.framework.hashing import relative_names, step_hash

    known: dict[int, str] = {}

    def symbol(value):
        if isinstance(value, Node):
            return known[id(value)]
        if isinstance(value, list):
            return [symbol(v) for v in value]
        if isinstance(value, Raw):  # as the store hashes raw files: names and bytes
            names = relative_names(value.files)
            return [[n, hashlib.sha256(Path(f).read_bytes()).hexdigest()]
                    for n, f in zip(names, value.files, strict=True)]  # fmt: skip
        return str(value)

    out: dict[str, str] = {}
    for node in recipe(load_config(None, overrides)).nodes:
        inputs = {key: symbol(value) for key, value in node.inputs.items()}
        known[id(node)] = step_hash(node.step.name, str(node.step.version), node.config, inputs)
        label, count = node.label, 1
        while label in out:
            count += 1
            label = f"{node.label}#{count}"
        out[label] = known[id(node)]
    return out


if __name__ == "__main__":
    off = ["extend.ruler.enabled=false"] if "--ruler-off" in sys.argv else []
    print(json.dumps(addresses(off), indent=1))
