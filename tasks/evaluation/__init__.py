"""Export, checkpoint evaluation with lm-eval, the leaderboard and task signal quality.

- ``export``: the ``export`` step (``ExportConfig``): a trainer checkpoint as ``<output>/hf/``.
- ``harness``: the ``evaluate`` step; ``evaluate_hf`` runs ``lm_eval.simple_evaluate`` (``hf``
  backend) on one Hugging Face folder and writes ``results.json``.
- ``leaderboard``: the ``leaderboard`` step (``LeaderboardConfig``); ``build_leaderboard`` writes
  the model x task table, plots against tokens seen, and per-task monotonicity and seed spread.
- ``models``: where a model output keeps its Hugging Face folder (``hf/``) and progress, and the
  one model loader and one tokenizer loader.
- ``config``: ``EvalConfig``.
- ``suite``: ``build_suite`` writes the bundled lm-eval task YAMLs and their data (held-out
  perplexity per domain, synthetic CF/MCF/generation items, local copies of real sets).

Scheduled evaluation (``flows/evaluate_scheduled.py``) is a graph of these steps over the
model outputs already in the store.
"""
