"""Task runners chosen in config, and folding a subflow's step results into one summary row."""

from __future__ import annotations

from dataclasses import replace

from llmflow.tasks.framework.store import StepResult


def task_runner(cfg):
    """A Prefect task runner for ``cfg.kind`` (threads, processes, dask, ray)."""
    from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

    if cfg.kind == "threads":
        return ThreadPoolTaskRunner(max_workers=cfg.max_workers)
    if cfg.kind == "processes":
        return ProcessPoolTaskRunner(max_workers=cfg.max_workers)
    try:
        if cfg.kind == "dask":
            from prefect_dask import DaskTaskRunner

            return DaskTaskRunner(
                cluster_kwargs={"n_workers": cfg.max_workers} if cfg.max_workers else None
            )
        from prefect_ray import RayTaskRunner

        return RayTaskRunner()
    except ImportError as err:
        raise RuntimeError(
            f"runner.kind={cfg.kind!r} needs the optional extra: pip install 'llmflow[{cfg.kind}]'"
        ) from err


def combined(step: str, results: list[StepResult]) -> StepResult:
    """One summary row for a subflow: its last output, cached only if every stage was."""
    last = results[-1]
    return replace(
        last,
        step=f"{step} ({len(results)} stages)",
        cached=all(r.cached for r in results),
        seconds=sum(r.seconds for r in results),
    )
