"""Chaos suite (issue 26): faults injected per layer, each run against a fault-free reference.

One fault-injection helper module per layer (``disk_faults.py``, ...); every test is
``@pytest.mark.slow`` (CI's second job). A test runs the affected steps with the fault, then
without it, and asserts the final outputs are bit-identical to a fault-free run, or that the run
stopped with a clear error and left no output that looks complete.
"""
