"""An existing model as the start of the graph (``init:``): its weights and its tokenizer.

``init: hf://models/OWNER/NAME[@REVISION]`` (or a folder) is pinned when the recipe is built
(``models.py``); ``inspect_init`` then reads only config.json, the weights' headers and the
tokenizer, so an architecture we cannot map, a folder without weights, a sequence classifier or
a tokenizer with more ids than the embedding has rows fails before any step runs, naming it.

Two steps follow:

- ``import-model`` converts the transformers folder (``model/hf.py:import_hf``) into a
  weights-only checkpoint, ``final/`` (``model.safetensors`` under our names,
  ``model_config.json``, ``COMPLETE``), which a pretraining stage starts from as stage 2 starts
  from stage 1 (without optimizer state: the trainer loads the weights only) and which ``export``
  turns back into the same transformers class. The folder's files enter its hash and lineage as
  raw files (a Hub model: its pinned commit names its content). ``tokenizer/`` holds the model's
  tokenizer files.
- ``import-tokenizer`` stands where ``train_tokenizer`` stands: the model's tokenizer, plus
  ``vocab_meta.json`` (the embedding's rows as the vocabulary size, the eos, pad and bos ids)
  that ``tokenize`` reads instead of our special-token names.

When no stage trains (``pretrain.stages: []`` and ``extend.stages: []``) nothing is imported:
the pinned folder becomes an ``external-model`` output (``tasks/evaluation/external.py``, its
files copied as they are), which post-training, merging, evaluation and the card take as
transformers loads it, so a model our trainer cannot express (a mixture of experts, sliding-window
attention, any ``*ForCausalLM``) is still post-trained and evaluated; ``import-tokenizer`` reads
its ``hf/`` folder for the held-out documents' tokenizer.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmflow.model.config import ModelConfig
from llmflow.model.hf import import_hf, save_model
from llmflow.model.hf_arch import config_from_hf
from llmflow.tasks.dataprep.tokenize import VOCAB_META
from llmflow.tasks.evaluation import external
from llmflow.tasks.evaluation.models import hf_dir
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.graph import Graph, Node, Raw
from llmflow.tasks.framework.step import Metrics, RawFiles, step
from llmflow.tasks.ingest import models
from llmflow.tasks.pretrain.curriculum import PretrainConfig

if TYPE_CHECKING:
    from llmflow.tasks.config import PipelineConfig

log = logging.getLogger("llmflow.init")

FIELD = "init"
COMPLETE = "COMPLETE"  # NOTE: the trainer's checkpoint marker (tasks/pretrain/checkpoint.py)
_TOKENIZER_EXTRA = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
_TOKENIZER_FILES = (*models.TOKENIZER_FILES, "merges.txt", "tokenizer.model", *_TOKENIZER_EXTRA)


class ImportModelConfig(BaseModel):
    """Which model to start from: its pinned reference (``models.pin``)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        description="hf://models/OWNER/NAME@<commit or local- fingerprint>, or a local folder."
    )


class ImportTokenizerConfig(BaseModel):
    """The imported model's tokenizer (nothing to choose: the model fixes it)."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class InitModel:
    """What ``init`` names, checked: its pinned source, its architecture, its vocabulary."""

    source: models.ModelSource
    config: ModelConfig
    tokenizer_size: int


def check_causal_lm(folder: Path, uri: str) -> dict:
    """The folder's config.json once it holds a causal LM we can map, its weights (names and
    shapes from the headers) and a tokenizer; otherwise a BadInputError naming what is wrong."""
    config = models.read_config(folder, uri, FIELD)
    models.check_files(folder, uri, FIELD)
    where = f"{FIELD}={uri!r}: {folder / 'config.json'}"
    cfg = config_from_hf(config, source=where)
    from llmflow.model import hf

    files = hf._weight_files(folder)
    hf._check_shapes(hf._saved_shapes(files), hf._expected_shapes(cfg), cfg, folder)
    return config


def inspect_init(uri: str) -> InitModel:
    """``init`` pinned and checked, without reading any weight (see the module docstring)."""
    source = models.resolve(uri, FIELD, check_causal_lm)
    folder = _config_folder(source)
    where = f"{FIELD}={uri!r}: {folder / 'config.json'}"
    cfg = config_from_hf(models.read_config(folder, uri, FIELD), source=where)
    size = tokenizer_size(folder) if source.folder is not None else cfg.vocab_size
    if size > cfg.vocab_size:
        raise BadInputError(
            f"{FIELD}={uri!r}: the tokenizer has {size} ids but the model's embedding has "
            f"vocab_size={cfg.vocab_size} rows; the tokenizer does not belong to this model"
        )
    return InitModel(source, cfg, size)


def _config_folder(source: models.ModelSource) -> Path:
    """A folder holding the model's config.json (a Hub model: that one file, downloaded)."""
    if source.folder is not None:
        return source.folder
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(source.repo, "config.json", revision=source.revision)
    except Exception as err:  # noqa: BLE001
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise BadInputError(f"{FIELD}={source.uri!r}: config.json unreadable: {first}") from None
    return Path(path).parent


def tokenizer_size(folder: Path) -> int:
    """Ids the folder's tokenizer can produce (added tokens included)."""
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(True)
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))


@step("import-model", version=2)  # 2: model_config.json keeps a bf16/fp16 dtype (hf_dtype)
def import_model(cfg: ImportModelConfig, out: Path, files: RawFiles | None = None) -> Metrics:
    """Convert the pinned transformers model into a weights-only checkpoint (``final/``) and
    keep its tokenizer (``tokenizer/``); ``files`` are its folder's files, hashed."""
    source = models.resolve(cfg.model, FIELD, check_causal_lm)
    folder = models.local_folder(source, FIELD, check_causal_lm)
    model_cfg, state_dict = import_hf(folder)
    final = out / "final"
    save_model(state_dict, model_cfg, final)
    (final / "source.json").write_text(
        json.dumps({"model": source.pinned_uri, "revision": source.revision}, indent=1)
    )
    (final / COMPLETE).write_text("")
    copy_tokenizer(folder, out / "tokenizer")
    dtype = str(next(iter(state_dict.values())).dtype).removeprefix("torch.")
    metrics = {
        "source": source.name,
        "architecture": model_cfg.hf_model_type,
        "num_parameters": model_cfg.num_parameters(),
        "vocab_size": model_cfg.vocab_size,
        "dtype": dtype,
    }
    if model_cfg.num_experts:  # a mixture of experts: also what one token goes through
        metrics["active_parameters"] = model_cfg.active_parameters()
    return metrics


def copy_tokenizer(folder: Path, out: Path) -> None:
    """The tokenizer files of a model folder, with a ``tokenizer.json`` (converted by
    transformers when the folder has only a slow tokenizer's files)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copy2(folder / name, out / name)
    if not (out / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(folder), local_files_only=True).save_pretrained(out)
    if not (out / "tokenizer.json").is_file():
        raise BadInputError(f"{FIELD}: the tokenizer of {folder} has no fast (tokenizers) form")


@step("import-tokenizer", version=1)
def import_tokenizer(cfg: ImportTokenizerConfig, model: Path, out: Path) -> Metrics:
    """The model's tokenizer, with the ids tokenize needs (``vocab_meta.json``); ``model`` is an
    ``import-model`` output, or an ``external-model`` one when no stage trains."""
    from tokenizers import Tokenizer

    if (hf_dir(model) / "config.json").is_file():  # the pinned folder as it is
        copy_tokenizer(hf_dir(model), out)
        fields = hf_fields(hf_dir(model))
    else:
        shutil.copytree(model / "tokenizer", out, dirs_exist_ok=True)
        fields = json.loads((model / "final" / "model_config.json").read_text())
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    size, rows = tokenizer.get_vocab_size(True), fields["vocab_size"]
    if size > rows:
        raise BadInputError(
            f"{FIELD}: the tokenizer has {size} ids but the model's embedding has "
            f"vocab_size={rows} rows"
        )
    meta = {"vocab_size": rows, "tokenizer_vocab_size": size, **special_ids(out, fields)}
    (out / VOCAB_META).write_text(json.dumps(meta, indent=1))
    return meta


def hf_fields(folder: Path) -> dict:
    """``vocab_size`` and the special ids of a transformers config.json (a multimodal model's
    language model keeps them in ``text_config``)."""
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or {}
    names = ("vocab_size", "eos_token_id", "pad_token_id", "bos_token_id")
    fields = {k: config[k] if config.get(k) is not None else text.get(k) for k in names}
    if not isinstance(fields["vocab_size"], int):
        raise BadInputError(f"{FIELD}: {folder / 'config.json'} has no vocab_size")
    return fields


def special_ids(folder: Path, fields: dict) -> dict[str, int | None]:
    """eos (the model's first eos id, else the tokenizer's eos token), pad (else eos) and bos."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}

    def token_id(name: str) -> int | None:
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        return tokenizer.token_to_id(token) if token else None

    eos = fields.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    eos = eos if eos is not None else token_id("eos_token")
    if eos is None:
        raise BadInputError(
            f"{FIELD}: neither config.json (eos_token_id) nor the tokenizer (eos_token) names an "
            "end-of-text token, which separates documents when packing"
        )
    pad = fields.get("pad_token_id")
    pad = pad if pad is not None else token_id("pad_token")
    if pad is None:  # NOTE: the loader ignores labels at pad; eos as pad would hide every eos
        size = tokenizer.get_vocab_size(True)
        pad = size if size < fields["vocab_size"] else eos  # a spare embedding row, if any
    return {"eos_id": eos, "pad_id": pad, "bos_id": fields.get("bos_token_id")}


def _external_node(graph: Graph, config: PipelineConfig) -> Node:
    """The ``external-model`` node of the pinned ``init`` folder, taken as it is."""
    pinned, files = external.pin_model(config.init, FIELD)
    return graph.add(
        external.external_model, pinned, config.name, phase="tokenizer",
        files=Raw(files) if files else None,
    )  # fmt: skip


def add_init(graph: Graph, config: PipelineConfig) -> tuple[PipelineConfig, Node | None]:
    """With ``init`` set: the config with ``init`` pinned and pretraining on the imported model's
    architecture, and the ``import-model`` node; when no stage trains, the config with ``init``
    pinned and an ``external-model`` node (the folder as it is); without ``init``, the config as
    it is and None."""
    config, found = init_config(config)
    if config.init is None:
        return config, None
    if found is None:  # nothing trains: post-training and evaluation take the folder itself
        return config, _external_node(graph, config)
    pinned = found.source.pinned_uri
    files = models.model_files(found.source)
    node = graph.add(
        import_model,
        ImportModelConfig(model=pinned),
        config.name,
        phase="tokenizer",
        files=Raw(files) if files else None,
    )
    return config, node


def init_config(config: PipelineConfig) -> tuple[PipelineConfig, InitModel | None]:
    """The config as the recipe runs it: ``init`` pinned and checked (``inspect_init``),
    ``pretrain`` on its architecture; unchanged (and None) without ``init``. Plans and
    preflight checks read this, so they size the model that will train. When no stage trains,
    ``init`` is pinned and checked as a causal LM only (no architecture of ours), and None."""
    if config.init is None:
        return config, None
    if not trains(config):
        source = models.resolve(config.init, FIELD, _causal_lm)
        return config.model_copy(update={"init": source.pinned_uri}), None
    found = inspect_init(config.init)
    update = {"init": found.source.pinned_uri, "pretrain": _on_model(config, found)}
    return config.model_copy(update=update), found


def _causal_lm(folder: Path, uri: str) -> dict:
    """Any transformers causal LM with weights and a tokenizer (``external.check_causal_lm``)."""
    return external.check_causal_lm(folder, uri, FIELD)


def trains(config: PipelineConfig) -> bool:
    """Whether any pretraining or context-extension stage runs (only then is ``init`` imported
    into our trainer's format)."""
    return bool(config.pretrain.stages or config.extend.stages)


def _on_model(config: PipelineConfig, found: InitModel) -> PretrainConfig:
    """``pretrain`` with its model replaced by the imported architecture (said in the log)."""
    fields = {k: v for k, v in found.config.to_dict().items() if v is not None}
    data = config.pretrain.model_dump()
    data["train"]["model"] = {"preset": "debug", "overrides": fields}  # debug: all defaults
    try:
        pretrain = PretrainConfig.model_validate(data)
    except ValidationError as err:
        raise BadInputError(
            f"{FIELD}={config.init!r}: pretrain does not fit the model: {err}"
        ) from None
    if pretrain.train.model_config_obj() != found.config:
        raise BadInputError(f"{FIELD}={config.init!r}: its architecture does not map to a preset")
    spec = config.pretrain.train.model
    cfg = found.config
    log.info(
        "init: pretraining continues %s (%s, %d layers, hidden %d, vocab %d); "
        "pretrain.train.model (preset %r) is replaced by its architecture, and the tokenizer "
        "step imports its tokenizer instead of training one",
        found.source.name, cfg.hf_model_type, cfg.num_layers, cfg.hidden_size, cfg.vocab_size,
        spec.preset,
    )  # fmt: skip
    return pretrain
