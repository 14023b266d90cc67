"""The bundled lm-eval task suite: data and task YAMLs written into one include directory.

``build_suite`` writes JSONL data and one YAML per task into ``out_dir``; lm-eval reads them with
``TaskManager(include_path=out_dir)``. Tasks:

- ``ppl_<domain>`` (tag ``heldout_ppl``): rolling loglikelihood over held-out documents, reported
  as word_perplexity, byte_perplexity and bits_per_byte.
- ``cf_<set>``: cloze format, the answer text is scored as the continuation.
- ``mcf_<set>``: multiple-choice format, the options are listed and the letters A-D are scored.
- ``gen_<set>``: greedy generation, exact match against the answer.
- ``piqa_local``, ``wikitext2_local``, ``gsm8k_local``: the real sets, when ``data_root`` has them.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from llmflow.tasks.evaluation.config import EvalConfig
from llmflow.tasks.evaluation.synthetic import LETTERS, arithmetic_items, fact_items
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.hashing import digest, versioned_fields

SUITE_VERSION = "1"
MANIFEST = "suite.json"
PPL_TAG = "heldout_ppl"
SYNTHETIC_SETS = {"arith": arithmetic_items, "facts": fact_items}
GSM8K_MAX_GEN_TOKS = 256  # lm-eval's default; the model's context must be longer than this
PROMPT = "Question: {{question}}\nAnswer:"
REAL_SET_FILES = {
    "piqa_local": ["piqa_valid.jsonl", "piqa_valid_labels.lst"],
    "wikitext2_local": ["wikitext2_test.txt"],
    "gsm8k_local": ["gsm8k_test.jsonl"],
}
# A WikiText article starts with a top-level heading line " = Title = " (sections use " = = ").
WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")


def _data_hashes(out_dir: Path) -> dict[str, str]:
    """SHA-256 of each file under ``out_dir/data``, keyed by its path relative to ``out_dir``."""
    return {
        p.relative_to(out_dir).as_posix(): _sha256(p) for p in sorted((out_dir / "data").iterdir())
    }


def build_suite(cfg: EvalConfig, heldout_dir: Path | None, out_dir: Path) -> Path:
    """Write the bundled task YAMLs and their data into ``out_dir``.

    Args:
        cfg: The evaluation config (item counts, seed, ``data_root``).
        heldout_dir: Held-out documents (``**/*.parquet`` with id, text, domain), or None to
            build no perplexity tasks.
        out_dir: An existing local directory; receives ``*.yaml``, ``data/`` and ``suite.json``.

    Returns:
        ``out_dir``, the path to pass as lm-eval's ``include_path``.
    """
    out_dir = Path(out_dir).resolve()
    (out_dir / "data").mkdir(parents=True, exist_ok=True)
    names = _write_synthetic(cfg, out_dir)
    if heldout_dir is not None:
        names += _write_heldout_ppl(cfg, Path(heldout_dir), out_dir)
    if cfg.data_root is not None:
        names += _write_real_sets(Path(cfg.data_root), out_dir)
    data_hashes = _data_hashes(out_dir)
    key = digest({"version": SUITE_VERSION, "config": versioned_fields(cfg), "data": data_hashes})
    manifest = {"suite_key": key, "tasks": sorted(names), "data": data_hashes}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out_dir


def read_manifest(suite_dir: Path) -> dict[str, Any]:
    """The manifest ``build_suite`` wrote: ``suite_key``, ``tasks`` and data hashes."""
    return json.loads((Path(suite_dir) / MANIFEST).read_text())


def missing_data_reason(name: str, cfg: EvalConfig, heldout_dir: Path | None) -> str | None:
    """Why a bundled task name was not built (its data is absent), or None if not bundled."""
    if name == PPL_TAG or name.startswith("ppl_"):
        if heldout_dir is None:
            return "perplexity tasks need held-out documents, but heldout_dir is None"
        return f"no held-out documents of that domain under {heldout_dir}"
    if name in REAL_SET_FILES:
        files = ", ".join(REAL_SET_FILES[name])
        if cfg.data_root is None:
            return f"needs data_root (a folder holding {files}); data_root is None"
        return f"needs {files} under data_root={cfg.data_root}"
    return None


# -- synthetic ------------------------------------------------------------------------------
def _write_synthetic(cfg: EvalConfig, out_dir: Path) -> list[str]:
    names = []
    for set_name, make in SYNTHETIC_SETS.items():
        data = _write_jsonl(out_dir / "data" / f"{set_name}.jsonl", make(cfg.num_items, cfg.seed))
        names += [f"cf_{set_name}", f"mcf_{set_name}", f"gen_{set_name}"]
        base = _base_task(data, "test", out_dir)
        _write_yaml(out_dir, {**base, **_cloze(f"cf_{set_name}")})
        _write_yaml(out_dir, {**base, **_multiple_choice_letters(f"mcf_{set_name}")})
        _write_yaml(out_dir, {**base, **_generation(f"gen_{set_name}", cfg.max_gen_toks)})
    return names


def _cloze(name: str) -> dict[str, Any]:
    return {
        "task": name,
        "output_type": "multiple_choice",
        "doc_to_text": PROMPT,
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "metric_list": _metrics("acc", "acc_norm"),
    }


def _multiple_choice_letters(name: str) -> dict[str, Any]:
    options = "".join(f"\n{letter}. {{{{choices[{i}]}}}}" for i, letter in enumerate(LETTERS))
    return {
        "task": name,
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}" + options + "\nAnswer:",
        "doc_to_choice": LETTERS,
        "doc_to_target": "label",
        "metric_list": _metrics("acc"),
    }


def _generation(name: str, max_gen_toks: int) -> dict[str, Any]:
    return {
        "task": name,
        "output_type": "generate_until",
        "doc_to_text": PROMPT,
        "doc_to_target": "answer",
        "generation_kwargs": {
            "until": ["\n", "Question:"],
            "do_sample": False,
            "max_gen_toks": max_gen_toks,
        },
        "metric_list": [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "ignore_case": True,
                # NOTE: the model answers " 7" after "Answer:"; strip before comparing.
                "regexes_to_ignore": ["^\\s+", "\\s+$"],
            }
        ],
    }


# -- held-out perplexity ----------------------------------------------------------------------
def _write_heldout_ppl(cfg: EvalConfig, heldout_dir: Path, out_dir: Path) -> list[str]:
    by_domain = heldout_documents(heldout_dir, cfg.num_ppl_docs, cfg.max_doc_chars)
    names = []
    for domain, docs in sorted(by_domain.items()):
        name = f"ppl_{domain}"
        data = _write_jsonl(out_dir / "data" / f"{name}.jsonl", docs)
        _write_yaml(out_dir, {**_base_task(data, "test", out_dir), **_rolling(name)})
        names.append(name)
    return names


def heldout_documents(heldout_dir: Path, num_docs: int, max_chars: int) -> dict[str, list[dict]]:
    """Pick up to ``num_docs`` documents per domain, deterministically (by a hash of their id).

    Returns:
        ``{domain_slug: [{"id", "text", "domain"}, ...]}``; texts are cut to ``max_chars``.
    """
    files = sorted(Path(heldout_dir).glob("**/*.parquet"))
    if not files:
        raise FileNotFoundError(f"heldout_dir={heldout_dir} holds no **/*.parquet shards")
    rows: dict[str, list[dict]] = {}
    for path in files:
        table = pq.read_table(path, columns=["id", "text", "domain"]).to_pylist()
        for row in table:
            if row["text"] and row["text"].strip():
                rows.setdefault(_slug(row["domain"]), []).append(row)
    picked = {}
    for domain, docs in rows.items():
        docs = sorted(docs, key=lambda r: hashlib.sha256(str(r["id"]).encode()).hexdigest())
        picked[domain] = [
            {"id": str(r["id"]), "text": r["text"][:max_chars], "domain": r["domain"]}
            for r in docs[:num_docs]
        ]
    return picked


def _slug(domain: Any) -> str:
    return re.sub(r"[^a-z0-9]+", "_", str(domain or "unknown").lower()).strip("_") or "unknown"


def _rolling(name: str) -> dict[str, Any]:
    return {
        "task": name,
        "tag": [PPL_TAG],
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        # NOTE: a bare field name, not "{{text}}": Jinja would drop a trailing newline.
        "doc_to_target": "text",
        "metric_list": _metrics("word_perplexity", "byte_perplexity", "bits_per_byte"),
    }


# -- real sets under data_root ----------------------------------------------------------------
def _write_real_sets(data_root: Path, out_dir: Path) -> list[str]:
    writers = {
        "piqa_local": _write_piqa,
        "wikitext2_local": _write_wikitext2,
        "gsm8k_local": _write_gsm8k,
    }
    names = []
    for name, files in REAL_SET_FILES.items():
        if all((data_root / f).is_file() for f in files):
            writers[name](data_root, out_dir)
            names.append(name)
    return names


def _write_piqa(data_root: Path, out_dir: Path) -> None:
    questions = [json.loads(line) for line in _lines(data_root / "piqa_valid.jsonl")]
    labels = [int(line) for line in _lines(data_root / "piqa_valid_labels.lst")]
    if len(questions) != len(labels):
        raise BadInputError(
            f"{data_root}: {len(questions)} PIQA questions but {len(labels)} labels"
        )
    docs = [{**q, "label": label} for q, label in zip(questions, labels, strict=True)]
    data = _write_jsonl(out_dir / "data" / "piqa_local.jsonl", docs)
    task = {
        "task": "piqa_local",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{goal}}\nAnswer:",
        "doc_to_target": "label",
        "doc_to_choice": "{{[sol1, sol2]}}",
        "metric_list": _metrics("acc", "acc_norm"),
    }
    _write_yaml(out_dir, {**_base_task(data, "validation", out_dir), **task})


def _write_wikitext2(data_root: Path, out_dir: Path) -> None:
    pages: list[list[str]] = []
    for line in (data_root / "wikitext2_test.txt").read_text(encoding="utf-8").splitlines(True):
        if WIKITEXT_TITLE.match(line.rstrip("\n")) or not pages:
            pages.append([])
        pages[-1].append(line)
    docs = [{"page": "".join(p)} for p in pages if "".join(p).strip()]
    data = _write_jsonl(out_dir / "data" / "wikitext2_local.jsonl", docs)
    module = "lm_eval.tasks.wikitext.preprocess_wikitext"
    task = {"task": "wikitext2_local", **_rolling("wikitext2_local")}
    task.pop("tag")
    task.pop("doc_to_target")
    # NOTE: same scoring as lm-eval's own `wikitext` (detokenized text is scored, words are
    # counted on the raw page), so numbers compare with published ones.
    extra = (
        f"doc_to_target: !function {module}.wikitext_detokenizer\n"
        f"process_results: !function {module}.process_results\n"
    )
    _write_yaml(out_dir, {**_base_task(data, "test", out_dir), **task}, extra)


def _write_gsm8k(data_root: Path, out_dir: Path) -> None:
    docs = [json.loads(line) for line in _lines(data_root / "gsm8k_test.jsonl")]
    data = _write_jsonl(out_dir / "data" / "gsm8k_local.jsonl", docs)
    # Same prompt, stop strings, filters and metric as lm-eval's gsm8k.yaml (version 3.0).
    task = {
        "task": "gsm8k_local",
        "output_type": "generate_until",
        "fewshot_split": "test",
        "doc_to_text": PROMPT,
        "doc_to_target": "{{answer}}",
        "metric_list": [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "ignore_case": True,
                "ignore_punctuation": False,
                "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"],
            }
        ],
        "generation_kwargs": {
            "until": ["Question:", "</s>", "<|im_end|>"],
            "do_sample": False,
            "temperature": 0.0,
            "max_gen_toks": GSM8K_MAX_GEN_TOKS,
        },
        "filter_list": [
            {
                "name": "strict-match",
                "filter": [
                    {"function": "regex", "regex_pattern": "#### (\\-?[0-9\\.\\,]+)"},
                    {"function": "take_first"},
                ],
            },
            {
                "name": "flexible-extract",
                "filter": [
                    {
                        "function": "regex",
                        "group_select": -1,
                        "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)",
                    },
                    {"function": "take_first"},
                ],
            },
        ],
    }
    _write_yaml(out_dir, {**_base_task(data, "test", out_dir), **task})


# -- helpers --------------------------------------------------------------------------------
def _base_task(data_file: Path, split: str, out_dir: Path) -> dict[str, Any]:
    """Dataset fields shared by every bundled task: one local JSONL file as one split."""
    return {
        "dataset_path": "json",
        # NOTE: data_files must be absolute: lm-eval resolves relative ones against the CWD.
        "dataset_kwargs": {
            "data_files": {split: str(data_file.resolve())},
            "cache_dir": str(out_dir / ".hf_datasets_cache"),
        },
        f"{split}_split": split,
        "metadata": {"version": float(SUITE_VERSION)},
    }


METRIC_DEFAULTS = {  # lm-eval's own defaults, spelled out so it does not warn about each
    "acc": ("mean", True),
    "acc_norm": ("mean", True),
    "word_perplexity": ("weighted_perplexity", False),
    "byte_perplexity": ("weighted_perplexity", False),
    "bits_per_byte": ("bits_per_byte", False),
}


def _metrics(*names: str) -> list[dict[str, Any]]:
    return [
        {
            "metric": n,
            "aggregation": METRIC_DEFAULTS[n][0],
            "higher_is_better": METRIC_DEFAULTS[n][1],
        }
        for n in names
    ]


def _write_yaml(out_dir: Path, task: dict[str, Any], extra: str = "") -> Path:
    path = out_dir / f"{task['task']}.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False, allow_unicode=True) + extra)
    return path


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
