"""Checkpoint evaluation with lm-eval, the leaderboard and task signal quality (issue 6).

Plain, Prefect-free modules:

- ``config``: ``EvalConfig``, the step's one config.
- ``suite``: ``build_suite`` writes the bundled lm-eval task YAMLs and their data (held-out
  perplexity per domain, synthetic CF/MCF/generation items, local copies of real sets).
- ``harness``: ``evaluate`` runs ``lm_eval.simple_evaluate`` (``hf`` backend) on one exported
  model and writes ``results.json``; ``table_rows`` turns it into rows for a table artifact.
- ``checkpoints``: ``find_unevaluated`` / ``evaluate_checkpoints`` for scheduled evaluation of
  committed checkpoints under a local or fsspec root, each evaluated once per suite.
- ``leaderboard``: ``update_leaderboard`` writes the checkpoint x task table, plots against
  tokens seen, and per-task monotonicity and seed spread.
"""
