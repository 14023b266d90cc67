"""The ``external-model`` step: a causal LM made elsewhere, as a model output of the store.

A model named ``hf://models/OWNER/NAME[@REVISION]`` or by a local folder is pinned when the
graph is built (``tasks/ingest/models.py``): on the Hub to a commit, in the offline mirror
(``LLMFLOW_HUB_MIRROR``) or a local folder to the fingerprint of its files. A folder's files
enter the step as raw files, so each one's sha256 is in the step's hash and its lineage; a Hub
model's commit, in the config, names its content. The output is an ordinary model output (its
``hf/`` holds the model and tokenizer), so ``evaluate``, ``safety``, ``card``, ``sft``, ``dpo``
and ``merge`` take it as they take an export. ``source.json`` records where it came from; the
card's ``base_model`` names it.

What is not a causal LM with weights and a tokenizer (a sequence classifier, a folder without
weights, a repo or revision that does not exist) fails when the graph is built, before anything
runs or is written.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmflow.tasks.evaluation.models import hf_dir, write_progress
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.hashing import UNVERSIONED
from llmflow.tasks.framework.step import Metrics, RawFiles, step
from llmflow.tasks.ingest import models
from llmflow.tasks.summaries import ModelSize, MoeModelSize

SOURCE_FILE = "source.json"
STEP_NAME = "external-model"


class ExternalModelConfig(BaseModel):
    """Which model, pinned: the commit (Hub) or fingerprint (folder) is part of the hash."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        description="As given: hf://models/OWNER/NAME[@REVISION] or a folder (a label: the pin "
        "is what is hashed, so @main and @<its commit> are one output).",
        json_schema_extra=UNVERSIONED,
    )
    pinned: str = Field(
        description="hf://models/OWNER/NAME@<commit or local-fingerprint>, or FOLDER@local-..."
    )
    repo: str | None = Field(None, description="OWNER/NAME on the Hub; None for a local folder.")
    revision: str = Field(description="The pinned commit (Hub) or fingerprint (folder).")
    commit: str | None = Field(
        None, description="The Hub commit a mirror folder records (a --local-dir download)."
    )


def check_causal_lm(folder: Path, uri: str, field: str = "model") -> dict[str, Any]:
    """The folder's config.json, checked to be a causal LM with weights and a tokenizer.

    Raises:
        BadInputError: no config.json, no weights, no tokenizer, or another head (a sequence
            classifier, say), naming the field, the value and what is wrong.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = models.read_config(folder, uri, field)
    models.check_files(folder, uri, field)
    architectures = config.get("architectures") or []
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if architectures and not any(a in causal or a.endswith("ForCausalLM") for a in architectures):
        raise BadInputError(
            f"{field}={uri!r}: config.json architectures={architectures} is not a causal "
            "language model (a *ForCausalLM head); evaluation and post-training need one"
        )
    if not architectures and config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise BadInputError(
            f"{field}={uri!r}: config.json model_type={config.get('model_type')!r} has no "
            "causal LM class in transformers"
        )
    return config


def pin_model(uri: str, field: str = "model") -> tuple[ExternalModelConfig, tuple[str, ...]]:
    """The step config of ``uri`` (pinned) and its raw files (none for a Hub model).

    Raises:
        BadInputError: see ``tasks/ingest/models.resolve`` and ``check_causal_lm``.
    """
    source = models.resolve(uri, field, lambda folder, u: check_causal_lm(folder, u, field))
    commits = sorted(models.recorded_commits(source.folder)) if source.folder else []
    commit = commits[0] if len(commits) == 1 else None
    if source.repo is None:
        pinned = f"{source.folder}@{source.revision}"
    else:
        pinned = f"{models.MODEL_PREFIX}{source.repo}@{commit or source.revision}"
    config = ExternalModelConfig(
        source=uri, pinned=pinned, repo=source.repo, revision=source.revision, commit=commit
    )
    return config, models.model_files(source)


def store_output(ref: str) -> str | None:
    """``ref`` when it is a committed model output of a local store (``runs/export/NAME-HASH``:
    its ``hf/`` folder and lineage), else None. Such a model is evaluated as it stands in the
    store, so its lineage (and its corpus's decontamination) still follows it."""
    from llmflow.tasks.framework.store import Store

    folder = Path(ref).expanduser()
    if "://" in ref or not (hf_dir(folder) / "config.json").is_file():
        return None
    uri = str(folder.resolve())
    return uri if Store(folder.resolve().parent.parent).is_complete(uri) else None


def display_name(config: ExternalModelConfig) -> str:
    """A label for the leaderboard and output names: the repo's NAME or the folder's name."""
    name = config.repo.split("/")[-1] if config.repo else Path(config.source).name
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name) or "model"


def _root_of(files: RawFiles) -> Path:
    """The model folder: the one holding the shallowest config.json among the raw files."""
    configs = sorted((Path(f) for f in files if Path(f).name == "config.json"), key=_depth)
    if not configs:
        raise BadInputError(f"no config.json among the model's files: {list(files)[:5]}")
    return configs[0].parent


def _depth(path: Path) -> int:
    return len(path.parts)


@step(STEP_NAME)
def external_model(cfg: ExternalModelConfig, out: Path, files: RawFiles | None = None) -> Metrics:
    """Copy the pinned model's files into ``hf/`` (a Hub model is downloaded at its commit),
    check it loads as a causal LM, record its source."""
    folder = hf_dir(out)
    if files:
        root = _root_of(files)
        for name in files:
            target = folder / Path(name).relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            # NOTE: copied, not hard-linked: an edit in place of the user's file would
            # otherwise change a committed output.
            shutil.copyfile(name, target)
    else:
        source = models.ModelSource(cfg.pinned, cfg.revision, None, cfg.repo)
        snapshot = models.local_folder(source, "model", lambda f, u: check_causal_lm(f, u))
        shutil.copytree(snapshot, folder, ignore=shutil.ignore_patterns(".cache"))
    config = check_causal_lm(folder, cfg.pinned)
    record = cfg.model_dump(mode="json", exclude={"source"})
    (out / SOURCE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    write_progress(out, tokens_seen=None, step=None)
    size = {
        "source": cfg.pinned,
        "architecture": (config.get("architectures") or [config.get("model_type")])[0],
        "num_parameters": num_parameters(folder),
        "num_files": sum(1 for p in folder.rglob("*") if p.is_file()),
    }
    active = active_parameters(config)
    if active is not None:  # a mixture of experts: also what one token goes through
        return MoeModelSize.written({**size, "active_parameters": active})
    return ModelSize.written(size)


def active_parameters(config: dict) -> int | None:
    """Parameters one token goes through, for a mixture of experts whose ``config.json`` maps
    onto ``ModelConfig`` (Qwen3-MoE, Mixtral); None for a dense model or one that does not map."""
    from llmflow.model.hf_arch import MOE_FIELDS, config_from_hf

    if not any(isinstance(config.get(name), int) and config[name] > 1 for name in MOE_FIELDS):
        return None
    try:
        model = config_from_hf(config)
    except (BadInputError, ValueError):
        return None
    return model.active_parameters() if model.num_experts else None


def num_parameters(folder: Path) -> int | None:
    """Parameters in the folder's safetensors files, from their headers (no tensor is read);
    None for ``pytorch_model.bin`` weights."""
    from safetensors import safe_open

    total, found = 0, False
    for path in sorted(Path(folder).glob("*.safetensors")):
        found = True
        with safe_open(str(path), framework="pt") as weights:
            for key in weights.keys():  # noqa: SIM118  (safe_open has no __iter__)
                total += math.prod(weights.get_slice(key).get_shape())
    return total if found else None
