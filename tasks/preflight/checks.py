"""Preflight's checks before any training: (1) the recipe resolves; (2) every data source yields
documents; (3) the plan on the declared GPUs; (4) the model at full shape on the meta device."""

from __future__ import annotations

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.preflight.report import Report, timed


def check_config(report: Report, config_path: str | None, overrides: list[str]):
    """(1) Resolve and validate the recipe."""
    from llmflow.tasks.config import load_config
    from llmflow.tasks.ingest.import_model import init_config

    with timed(report, "config") as row:
        config = load_config(config_path, overrides)
        config, _ = init_config(config)  # init: its architecture, pinned and checked
        report.recipe = config.name
        if not config.pretrain.stages:  # the init model as it is: no architecture of ours
            from llmflow.tasks.pretrain.planner import NO_STAGE

            row["detail"] = f"{config.name}: {NO_STAGE}, init {config.init}"
            return config
        model = config.pretrain.train.model_config_obj()
        row["detail"] = (
            f"{config.name}: {model.num_layers} layers x {model.hidden_size}, {len(config.pretrain.stages)} stages"
        )
        return config
    return None


def check_sources(report: Report, config, docs: int) -> None:
    """(2) Every data source is reachable and yields documents; every weighed domain has one."""
    from llmflow.tasks.dataprep.mixture import check_data_domains
    from llmflow.tasks.ingest import hub
    from llmflow.tasks.ingest.ingest import list_files

    local, sources = hub.split_sources(config.data)
    if not config.data:
        with timed(report, "data: generated sample") as row:
            row["detail"] = "the quickstart sample (made on this machine)"
    for source in sources:
        with timed(report, f"data: {source.dataset}") as row:
            texts = hub.sample_documents(source, config.ingest.text_field, docs)
            row["detail"] = (
                f"{len(texts)} docs, first {len(texts[0])} chars ({source.split}, domain {source.domain})"
            )
    if local:
        with timed(report, "data: local files") as row:
            row["detail"] = _check_local(local, config.ingest, docs)
    if config.data:
        with timed(report, "data: domains") as row:
            files = list_files(local) if local else []
            found = check_data_domains(config, files, [s.uri for s in sources])
            row["detail"] = (
                "not checked before ingest (no mixture weighs a domain, or a Hub source names none)"
                if found is None
                else f"every weighed domain has a source (the data gives {sorted(found)})"
            )


def _check_local(paths: list[str], ingest_cfg, docs: int) -> str:
    from llmflow.tasks.ingest.ingest import first_documents, list_files

    files = list_files(paths)
    for uri in files:
        if not first_documents(uri, ingest_cfg, docs):
            raise BadInputError(f"data file {uri} yields no usable document")
    return f"{len(files)} files, each yields documents"


def check_plan(report: Report, config):
    """(3) The plan on the declared hardware: a recipe that does not fit is a no-go with fixes."""
    from llmflow.tasks.pretrain.planner import NO_STAGE, recipe_plan

    with timed(report, "plan") as row:
        if not config.pretrain.stages:
            row["detail"] = f"{NO_STAGE}: nothing to pretrain, so no steps, time or memory to plan"
            return None
        plan = recipe_plan(config.pretrain, config.hardware)
        m, hw = plan.memory, config.hardware
        report.numbers["plan"] = {"num_parameters": plan.num_parameters, "memory_gb": m.total_gb,
                                  "steps": plan.num_steps, "hours": plan.estimated_hours}  # fmt: skip
        row["detail"] = (
            f"{m.total_gb:.1f} GB per GPU of {hw.gpu_mem_gb:g}, {plan.num_steps:,} steps, {plan.estimated_hours:,.1f} h on {hw.gpus} GPUs"
        )
        if not plan.fits:
            row.update(go=False, detail="does not fit: " + "; ".join(plan.warnings))
        return plan
    return None


def check_extension_plan(report: Report, config) -> None:
    """(3b) Each context-extension stage's memory on the declared GPUs."""
    from llmflow.tasks.pretrain.planner import extension_memory

    if not config.extend.stages:
        return
    with timed(report, "plan: extension") as row:
        lines = extension_memory(config.pretrain, config.extend, config.hardware)
        row.update(go=not any("NOT fit" in line for line in lines), detail="; ".join(lines))


def meta_parameter_count(model_cfg) -> int:
    """Parameters of the model built at full shape on the meta device (no memory allocated)."""
    import torch

    from llmflow.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(model_cfg)
    return sum(p.numel() for p in model.parameters())


def check_meta_build(report: Report, config, plan) -> None:
    """(4) The model at full shape on the meta device has the plan's parameter count."""
    with timed(report, "meta build") as row:
        count = meta_parameter_count(config.pretrain.train.model_config_obj())
        report.numbers["meta_parameters"] = count
        row["go"] = plan is not None and count == plan.num_parameters
        planned = plan.num_parameters if plan is not None else "?"
        row["detail"] = (
            f"{count:,} parameters built, plan counts {planned:,}"
            if plan
            else f"{count:,} parameters"
        )
