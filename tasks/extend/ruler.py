"""The ``ruler`` step: RULER's synthetic tasks on the model of every context-extension stage.

Prompts come from lm-eval's own RULER generators (``ruler_tasks/utils.py``) with the run's
tokenizer and held-out text, at any length; they are written as JSONL beside task YAMLs of our
own, and lm-eval renders, runs and scores them (its RULER metric, one metric per length) on our
own ``Transformer``: each stage's checkpoint is scored, not only the exported last one. RULER's
QA tasks are left out: they need SQuAD and HotpotQA from the network.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from lm_eval.api.model import LM
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from llmflow.model.rope import apply_rotary
from llmflow.tasks.evaluation.card import LONG_CONTEXT_REPORT as REPORT
from llmflow.tasks.evaluation.leaderboard import MODEL_METRICS, markdown_table
from llmflow.tasks.extend.config import RulerConfig
from llmflow.tasks.extend.longctx import _TextTokenizer, long_documents
from llmflow.tasks.extend.ruler_tasks.utils import TOKENS_TO_GENERATE, TextTokens, samples
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, report_markdown, report_table, step
from llmflow.tasks.tokenizer.config import EOS_TOKEN

RESULTS = "ruler.json"

SCORER = "llmflow.tasks.extend.ruler_tasks.utils.process_results"
log = logging.getLogger("llmflow.ruler")


class RulerEval(BaseModel):
    """RULER's settings, the models' labels and the lengths they are scored at."""

    model_config = ConfigDict(extra="forbid")

    ruler: RulerConfig
    labels: list[str] = Field(description="One label per model, in input order (ctx512, ...).")
    lengths: list[int] = Field(description="Context lengths every model is scored at.")
    board_label: str = Field(
        "extended", description="The leaderboard's label of the last model (its export's)."
    )


@step("ruler", version=1, gpu=True)
def ruler(
    cfg: RulerEval,
    models: list[Path],
    tokenizer: Path,
    tokenized: Path,
    out: Path,
    longctx: Path | None = None,
) -> Metrics:
    """RULER by task and length for each extension stage's model, beside the passkey and
    position-loss results of ``longctx`` when given."""
    from llmflow.model.hf import load_model

    if len(cfg.labels) != len(models):
        raise BadInputError(f"ruler: {len(cfg.labels)} labels for {len(models)} models")
    haystack = held_out_text(tokenized, max(cfg.lengths), tokenizer)
    data, skipped = write_prompts(cfg, TextTokens(tokenizer), haystack, out / "data")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scores = {}
    with tempfile.TemporaryDirectory(prefix="llmflow-ruler-") as tmp:
        manager = task_manager(data, cfg.lengths, Path(tmp))
        for label, model in zip(cfg.labels, models, strict=True):
            lm = TransformerLM(load_model(model / "final", device).eval(), tokenizer)
            scores[label] = score(lm, manager, list(data))
    passkey = json.loads((longctx / "longctx.json").read_text()) if longctx else None
    report = {"lengths": cfg.lengths, "scores": scores, "skipped": skipped}
    (out / RESULTS).write_text(json.dumps(report, indent=1))
    (out / MODEL_METRICS).write_text(json.dumps(board_scores(cfg, scores[cfg.labels[-1]])))
    rows = summary_rows(scores, cfg.lengths, cfg.labels[-1], passkey)
    markdown = report_text(scores, cfg.lengths, skipped, rows)
    (out / REPORT).write_text(markdown)
    report_table("ruler", table_rows(scores, cfg.lengths), "RULER by model, task and length")
    report_markdown("long-context", markdown, "RULER beside passkey and loss by position")
    return flat_metrics(scores) | {"num_skipped": len(skipped)}


# ------------------------------------------------------------------------------ prompts
def held_out_text(tokenized: Path, max_length: int, tokenizer: Path) -> str:
    """The essay haystack: held-out documents (training ones if none is held out), decoded,
    until they hold twice ``max_length`` words or run out."""
    docs, _ = long_documents(tokenized, 0)
    text = _TextTokenizer(tokenizer)
    parts, words = [], 0
    for doc in docs:
        parts.append(text.decode(doc.tolist()))
        words += len(parts[-1].split())
        if words >= 2 * max_length:
            break
    return "\n".join(parts)


def write_prompts(
    cfg: RulerEval, tokens: TextTokens, haystack: str, folder: Path
) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    """One JSONL file of prompts per task (every length); the (task, length) pairs whose
    prompts cannot fit, with the reason, are skipped and listed."""
    folder.mkdir(parents=True, exist_ok=True)
    data, skipped = {}, []
    for task in cfg.ruler.tasks:
        rows = []
        for length in cfg.lengths:
            try:
                rows += samples(task, tokens, length, cfg.ruler.samples, haystack, cfg.ruler.seed)
            except BadInputError as exc:
                log.warning("skipped: %s", exc)
                skipped.append({"task": task, "length": length, "reason": str(exc)})
        if rows:
            data[task] = folder / f"{task}.jsonl"
            data[task].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return data, skipped


def task_yaml(task: str, data_file: Path, lengths: list[int], cache: Path) -> str:
    """An lm-eval task over the prompts in ``data_file``: lm-eval's RULER fields (prompt, answer
    prefix, greedy generation of its length) and one metric per length (the mean score)."""
    config = {
        "task": f"ruler_{task}",
        "dataset_path": "json",
        # NOTE: data_files must be absolute: lm-eval resolves relative ones against the CWD.
        "dataset_kwargs": {
            "data_files": {"test": str(data_file.resolve())},
            "cache_dir": str(cache),
        },
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{input}}",
        "doc_to_target": "{{outputs}}",
        "gen_prefix": "{{gen_prefix}}",
        "target_delimiter": "\n\n" if task == "cwe" else " ",
        "generation_kwargs": {
            "do_sample": False,
            "temperature": 0.0,
            "max_gen_toks": TOKENS_TO_GENERATE[task],
            "until": [],
        },
        "metric_list": [
            {"metric": str(n), "aggregation": "mean", "higher_is_better": True} for n in lengths
        ],
        "repeats": 1,
        "metadata": {"version": 1.0},
    }
    return yaml.safe_dump(config, sort_keys=False) + f"process_results: !function {SCORER}\n"


def task_manager(data: dict[str, Path], lengths: list[int], folder: Path):
    """lm-eval's TaskManager over one YAML per task (lm-eval's own tasks are not indexed)."""
    from lm_eval.tasks import TaskManager

    folder.mkdir(parents=True, exist_ok=True)
    for task, path in data.items():
        text = task_yaml(task, path, lengths, folder / ".hf_datasets_cache")
        (folder / f"ruler_{task}.yaml").write_text(text)
    return TaskManager(include_path=str(folder), include_defaults=False)


# ------------------------------------------------------------------------------ scoring
def score(lm, manager, tasks: list[str]) -> dict[str, dict[str, float]]:
    """``{task: {length: score}}`` of ``lm`` (an lm-eval model) on RULER tasks, by lm-eval."""
    from lm_eval import simple_evaluate

    from llmflow.tasks.evaluation.harness import _our_git_hash

    if not tasks:
        return {}
    with _our_git_hash():
        raw = simple_evaluate(
            model=lm,
            tasks=[f"ruler_{t}" for t in tasks],
            task_manager=manager,
            bootstrap_iters=0,
            log_samples=False,
        )
    return {
        task.removeprefix("ruler_"): {
            key.split(",")[0]: float(value)
            for key, value in sorted(values.items())
            if "," in key and "_stderr" not in key and not isinstance(value, str)
        }
        for task, values in raw["results"].items()
    }


class TransformerLM(LM):
    """lm-eval's model interface over our own ``Transformer``: greedy generation with the
    run's tokenizer; RULER asks for nothing else."""

    def __init__(self, model, tokenizer: Path):
        super().__init__()
        self.model = model
        self.text = _TextTokenizer(tokenizer)
        self.eos = self.text.tok.token_to_id(EOS_TOKEN)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [self._generate(*request.args) for request in requests]

    def _generate(self, context: str, gen_kwargs: dict[str, Any]) -> str:
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else until
        ids = greedy(self.model, self.text.encode(context), gen_kwargs["max_gen_toks"], self.eos)
        text = self.text.decode(ids)
        for stop in until:
            text = text.split(stop)[0]
        return text

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("RULER's tasks only generate")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("RULER's tasks only generate")


@torch.no_grad()
def greedy(model, ids: list[int], max_new_tokens: int, stop: int | None = None) -> list[int]:
    """Greedy decoding with a key/value cache (the prompt once, then a token a step), until
    ``stop`` (not returned) or the budget: the tokens ``model(row)[0, -1].argmax()`` picks."""
    device = next(model.parameters()).device
    cache: list[tuple[Tensor, Tensor] | None] = [None] * len(model.layers)
    row, start, new = torch.tensor([ids], device=device), 0, []  # (1, T)
    for _ in range(max_new_tokens):
        token = int(cached_forward(model, row, start, cache)[0, -1].argmax())
        if token == stop:
            break
        new.append(token)
        start += row.shape[1]
        row = torch.tensor([[token]], device=device)  # (1, 1)
    return new


def cached_forward(
    model, ids: Tensor, start: int, cache: list[tuple[Tensor, Tensor] | None]
) -> Tensor:
    """Logits (1, T, V) of ``ids`` (1, T) at positions ``start``.., whose earlier keys and values
    ``cache`` holds (one entry per layer, extended here): ``Transformer.forward``'s blocks on
    one unpacked row.

    NOTE: the model has no cache of its own; without one a prompt of n tokens costs n forward
    tokens per generated token (8 s for 128 tokens after 1k on a 1M-parameter model on CPU).
    """
    x = model.embed(ids)  # (1, T, C)
    length = ids.shape[1]
    rope = model.rope(torch.arange(start, start + length, device=ids.device)[None], x.dtype)
    for index, layer in enumerate(model.layers):
        attn = layer.attn
        qkv = attn.qkv_proj(layer.attn_norm(x)).view(1, length, -1, attn.head_dim)
        q, k, v = qkv.split([attn.num_heads, attn.num_kv_heads, attn.num_kv_heads], dim=2)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        if attn.use_rope:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache[index] is not None:
            k, v = torch.cat([cache[index][0], k], dim=1), torch.cat([cache[index][1], v], dim=1)
        cache[index] = (k, v)  # (1, start + T, KV, D) each
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=start == 0 and length > 1,
            enable_gqa=attn.num_heads != attn.num_kv_heads,
        ).transpose(1, 2)  # (1, T, H, D); one new token sees every cached one
        h = x + attn.o_proj(out.reshape(1, length, -1))
        x = h + layer.mlp(layer.mlp_norm(h))
    return F.linear(model.norm(x), model.output_weight())  # (1, T, V)


# ------------------------------------------------------------------------------ reports
def board_scores(cfg: RulerEval, scores: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The last model's scores as its leaderboard row's extra tasks (``ruler_<task>``, a metric
    per length), in the leaderboard's ``leaderboard_metrics.json`` format with the row's label."""
    return {
        "label": cfg.board_label,
        "metrics": {f"ruler_{task}": values for task, values in scores.items()},
        "higher_is_better": {
            f"ruler_{task}": dict.fromkeys(values, True) for task, values in scores.items()
        },
    }


def table_rows(scores: dict[str, dict[str, dict[str, float]]], lengths: list[int]) -> list[dict]:
    """One row per model and task, a column per length (None: not scored there)."""
    return [
        {"model": label, "task": task, **{str(n): values.get(str(n)) for n in lengths}}
        for label, by_task in scores.items()
        for task, values in by_task.items()
    ]


def mean_by_length(by_task: dict[str, dict[str, float]], lengths: list[int]) -> dict[str, Any]:
    """The mean over tasks at each length (None where no task was scored)."""
    out = {}
    for n in lengths:
        values = [v[str(n)] for v in by_task.values() if str(n) in v]
        out[str(n)] = float(np.mean(values)) if values else None
    return out


def summary_rows(
    scores: dict[str, dict[str, dict[str, float]]],
    lengths: list[int],
    last: str,
    longctx: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """RULER's mean by length for each model beside longctx's passkey accuracy and loss past
    the original context (its "after" model is the last stage's)."""
    rows = []
    for label, by_task in scores.items():
        row = {"model": label}
        if longctx is not None:
            row |= _passkey_and_loss(longctx, "after") if label == last else _blank(longctx)
        rows.append(row | {f"RULER@{n}": v for n, v in mean_by_length(by_task, lengths).items()})
    if longctx is not None:
        for name in ("before", "after+yarn"):
            if name in longctx.get("passkey", {}):
                rows.append({"model": f"{name} (longctx)", **_passkey_and_loss(longctx, name)})
    return rows


def _passkey_and_loss(longctx: dict[str, Any], name: str) -> dict[str, Any]:
    grid = longctx["passkey"][name]["accuracy"]
    curve = longctx["position_loss"][name]
    beyond = [
        loss
        for start, loss in zip(curve["bucket_start"], curve["loss"], strict=True)
        if start >= longctx["original_len"]
    ]
    return {
        "passkey": float(np.mean(grid)),
        f"loss past {longctx['original_len']}": float(np.mean(beyond)) if beyond else None,
    }


def _blank(longctx: dict[str, Any]) -> dict[str, Any]:
    return {"passkey": None, f"loss past {longctx['original_len']}": None}


def report_text(
    scores: dict[str, dict[str, dict[str, float]]],
    lengths: list[int],
    skipped: list[dict[str, Any]],
    summary: list[dict[str, Any]],
) -> str:
    """The markdown report: the summary beside passkey and loss, then every task and length."""
    text = (
        "RULER (lm-eval's synthetic tasks and scoring; the QA tasks need the network and are "
        "left out), mean over tasks by context length, beside passkey retrieval and the loss "
        "past the original context:\n\n"
        + markdown_table(summary)
        + "\nBy task:\n\n"
        + markdown_table(table_rows(scores, lengths))
    )
    if skipped:
        text += "\nNot scored (the prompt does not fit):\n\n" + markdown_table(skipped)
    return text


def flat_metrics(scores: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """``<model>/<task>/<length>`` scores for the lineage and Prefect."""
    return {
        f"{label}/{task}/{n}": value
        for label, by_task in scores.items()
        for task, values in by_task.items()
        for n, value in values.items()
    }
