"""Every output address of the quickstart's graph (step, label, the address's own part: step,
version and versioned config), as JSON on stdout.

Run by test_graph_addresses.py in this tree and in a checkout of an earlier commit (whose
``llmflow`` it imports through ``PYTHONPATH``). The inputs' part of an address is the upstream
outputs' addresses (or the raw files' content, unchanged), so equal own parts for every node
mean equal addresses for the whole graph.
"""

from __future__ import annotations

import json

if __name__ == "__main__":
    from llmflow.flows.recipe import recipe
    from llmflow.tasks.config import load_config
    from llmflow.tasks.framework.hashing import step_hash

    graph = recipe(load_config(None, []))
    print(json.dumps(sorted(
        [n.step.name, n.name, step_hash(n.step.name, str(n.step.version), n.config, {})]
        for n in graph.nodes
    )))  # fmt: skip
