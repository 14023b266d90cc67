"""Per-stage mixtures: plan tokens per domain, select documents, pack a shuffled dataset.

`build_mixture` reads the output of `tokenize_corpus` and never re-tokenizes, so changing a
stage's weights only re-runs this cheap step.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from llmflow.tasks.dataprep.config import StageMixture, ValidationConfig
from llmflow.tasks.dataprep.pack import write_packed_units
from llmflow.tasks.framework import s3config
from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, step

logger = logging.getLogger(__name__)

CHINCHILLA_TOKENS_PER_PARAM = 20


def _read_tokenized_meta(tokenized_dir: Path) -> dict:
    path = Path(tokenized_dir) / "meta.json"
    if not path.is_file():
        raise BadInputError(f"no meta.json in {tokenized_dir}; run tokenize_corpus first")
    return json.loads(path.read_text())


def _check_seq_len(seq_len: int, max_seq_len: int | None) -> None:
    if max_seq_len is not None and seq_len > max_seq_len:
        raise BadInputError(
            f"seq_len={seq_len} is above the model's max_seq_len={max_seq_len}; lower seq_len "
            "or train a model with a longer context"
        )


def plan_mixture(cfg: StageMixture, available: dict[str, int]) -> tuple[dict[str, int], list[str]]:
    """Tokens to draw per domain for the stage, honouring max_epochs.

    Args:
        cfg: The stage's mixture.
        available: Tokens per domain in one epoch (each document's eos included).

    Returns:
        Target tokens per domain and a list of notes on domains whose weight was lowered.

    Raises:
        BadInputError: A weighted domain is missing, or would need more than max_epochs and
            on_overflow is "fail" (or no domain is left to take the excess).
    """
    weights = cfg.normalized_weights() or _data_weights(available)
    missing = sorted(set(weights) - {d for d, n in available.items() if n > 0})
    if missing:
        raise BadInputError(
            f"weights name domains {missing} with no training tokens; available domains: "
            f"{sorted(d for d, n in available.items() if n > 0)}"
        )
    targets = {d: w * cfg.num_tokens for d, w in weights.items()}
    capped: dict[str, float] = {}
    notes: list[str] = []
    while True:
        over = {d: t for d, t in targets.items() if t > cfg.max_epochs * available[d] + 1e-6}
        if not over:
            break
        domain = max(over, key=lambda d: over[d] / available[d])
        epochs = over[domain] / available[domain]
        message = (
            f"domain {domain!r} would need {epochs:.2f} epochs ({over[domain]:.0f} tokens from "
            f"{available[domain]} available) but max_epochs={cfg.max_epochs}"
        )
        if cfg.on_overflow == "fail":
            raise BadInputError(
                f"{message}; lower its weight, raise max_epochs, lower num_tokens, or set "
                "on_overflow='reweight'"
            )
        capped[domain] = cfg.max_epochs * available[domain]
        free = {d: weights[d] for d in targets if d not in capped}
        if not free:
            raise BadInputError(f"{message}, and every domain is capped; lower num_tokens")
        rest = cfg.num_tokens - sum(capped.values())
        targets = {**capped, **{d: rest * w / sum(free.values()) for d, w in free.items()}}
        note = f"{message}: capped at {capped[domain]:.0f} tokens, excess moved to {sorted(free)}"
        logger.warning(note)
        notes.append(note)
    return {d: int(round(t)) for d, t in targets.items()}, notes


def _data_weights(available: dict[str, int]) -> dict[str, float]:
    """Weights for a mixture that names no domain: each domain of the data in proportion to its
    tokens (said in one log line)."""
    present = {d: n for d, n in sorted(available.items()) if n > 0}
    if not present:
        raise BadInputError("the mixture names no domain, and no domain has training tokens")
    total = sum(present.values())
    weights = {d: n / total for d, n in present.items()}
    logger.info(
        "mixture: the weights name no domain, so the stage trains on the data's domains in "
        "proportion to their tokens: %s",
        ", ".join(f"{d} {w:.1%}" for d, w in weights.items()),
    )
    return weights


def mixture_weights(config: Any) -> dict[str, dict[str, float]]:
    """The weights of every mixture a pipeline config runs (up to ``until``), by config path."""
    from llmflow.tasks.config import PHASES

    reach = PHASES.index(config.until) if config.until else len(PHASES)
    weights = {}
    if reach >= PHASES.index("mixture"):
        weights = {f"pretrain.stages.{s.name}": s.mixture.weights for s in config.pretrain.stages}
    if config.extend.stages and reach >= PHASES.index("extend"):
        weights["extend.weights"] = config.extend.weights
    return weights


def check_data_domains(config: Any, files: list[str], hub: list[str]) -> set[str] | None:
    """Every domain a mixture of ``config`` weighs must be in its ``--data``, before any step runs.

    ``files`` are the local or remote data files, ``hub`` the Hub URIs. The files are read only
    until every weighed domain is seen; Hub sources count by the domain their URI names (one
    that names none leaves the check to the mixture step, after ingest).

    Returns:
        The domains found, or None when nothing was checked (no mixture weighs a domain, or a
        Hub source names none).

    Raises:
        BadInputError: naming the mixture, its missing domains and the domains the data has.
    """
    from llmflow.tasks.ingest.hub import parse_uri

    named = {
        label: sorted(d for d, w in weights.items() if w > 0)
        for label, weights in mixture_weights(config).items()
    }
    wanted = set().union(*named.values())
    sources = [parse_uri(uri) for uri in hub]
    if not wanted or not all(source.domain for source in sources):
        return None
    provided = {source.domain for source in sources}
    if files:
        provided |= _file_domains(files, config.ingest, wanted - provided)
    for label, domains in named.items():
        missing = [d for d in domains if d not in provided]
        if missing:
            shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            shown = f"files: {shown}; " if files else ""
            raise BadInputError(
                f"{label} weighs domain(s) {missing} that the --data sources lack: they give "
                f"{sorted(provided)} ({shown}a record's {config.ingest.domain_field!r} "
                f"field, else ingest.domain_map by file name, else ingest.default_domain="
                f"{config.ingest.default_domain!r}). Weigh those domains, or leave the weights "
                "empty ({}) to train on every domain in proportion to its tokens"
            )
    return provided


def _file_domains(files: list[str], ingest_cfg, wanted: set[str]) -> set[str]:
    """``file_domains``, remembered per files' sizes and times, ingest settings and ``wanted``."""
    # NOTE: the CLI builds the recipe three times (its checks, run_pipeline, the flow), and a
    # rare domain can sit at the end of a large file: read it once.
    from llmflow.tasks.ingest.ingest import file_domains

    stats = []
    for uri in files:
        fs, path = s3config.filesystem(uri)
        info = fs.info(path)
        stats.append((uri, info.get("size"), info.get("mtime") or info.get("LastModified")))
    key = (tuple(stats), ingest_cfg.model_dump_json(), frozenset(wanted))
    if key not in _FOUND:
        _FOUND.clear()  # one data set at a time
        _FOUND[key] = frozenset(file_domains(files, ingest_cfg, wanted))
    return set(_FOUND[key])


_FOUND: dict[tuple, frozenset[str]] = {}


def select_documents(doc_lengths: np.ndarray, target: int, rng: np.random.Generator) -> np.ndarray:
    """How many times each document is used so that their tokens reach ``target``.

    Every document is used ``target // total`` times; the remainder is filled with whole
    documents in a seeded random order until it is reached (overshooting by under one document).
    """
    total = int(doc_lengths.sum())
    counts = np.full(len(doc_lengths), target // total, np.int64)
    remainder = target - int(counts[0]) * total if len(counts) else 0
    if remainder > 0:
        order = rng.permutation(len(doc_lengths))
        take = int(np.searchsorted(np.cumsum(doc_lengths[order]), remainder)) + 1
        counts[order[:take]] += 1
    return counts


class _DomainTokens:
    """One tokenized domain: a memory map of its tokens and its document offsets."""

    def __init__(self, tokenized_dir: Path, info: dict, dtype: str):
        folder = Path(tokenized_dir) / info["dir"]
        self.offsets = np.load(folder / "offsets.npy")
        self.tokens = (
            np.memmap(folder / "tokens.bin", dtype=dtype, mode="r")
            if info["num_tokens"]
            else np.zeros(0, dtype)
        )


def _lengths_with_eos(tokenized_dir: Path, info: dict) -> np.ndarray:
    """Tokens of each document of a tokenized domain, its eos included (its offsets only: the
    driver never maps the tokens, which the pack units read)."""
    return np.diff(np.load(Path(tokenized_dir) / info["dir"] / "offsets.npy")) + 1


def _read_docs(domains: list[_DomainTokens], docs: np.ndarray, eos: np.ndarray) -> np.ndarray:
    """Tokens of documents ``docs`` (rows of (domain, doc)) back to back, eos appended to each."""
    pieces = []
    for domain_idx, doc in docs:
        source = domains[domain_idx]
        pieces += [source.tokens[source.offsets[doc] : source.offsets[doc + 1]], eos]
    return np.concatenate(pieces) if pieces else eos[:0]


@dataclass(frozen=True)
class _DomainSource:
    """The tokenized domains a pack unit reads by path (`pack.DocumentSource`)."""

    tokenized_dir: str
    infos: tuple[dict, ...]
    dtype: str
    eos_id: int

    def open(self):
        domains = [_DomainTokens(Path(self.tokenized_dir), i, self.dtype) for i in self.infos]
        eos = np.array([self.eos_id], self.dtype)
        return partial(_read_docs, domains, eos=eos)


def _selection_order(seed: int, counts: list[np.ndarray]) -> np.ndarray:
    """Every selected document instance as a (domain, doc) row, shuffled with ``seed``."""
    order = np.concatenate(
        [
            np.stack([np.full(int(c.sum()), k), np.repeat(np.arange(len(c)), c)], axis=1)
            for k, c in enumerate(counts)
        ]
    )
    return order[np.random.default_rng([seed, 1]).permutation(len(order))]


def _selection_lengths(tokenized_dir: Path, infos: tuple[dict, ...], order: np.ndarray):
    """Tokens (eos included) of each (domain, doc) row of ``order``; domain k is ``infos[k]``."""
    lengths = np.empty(len(order), np.int64)
    for k, info in enumerate(infos):
        of_domain = order[:, 0] == k
        domain_lengths = _lengths_with_eos(tokenized_dir, info)
        lengths[of_domain] = domain_lengths[order[of_domain, 1]]
    return lengths


def _pack_selection(
    cfg, tokenized_dir, meta, split, counts_by_domain, out_dir, extra_meta, by_domain=False
):
    """Shuffle the selected document instances and pack them into ``out_dir`` (units that read
    the domains by path, see `tasks.dataprep.pack`); ``by_domain`` also records each
    document's domain (``meta["domains"]`` and ``segment_domains.bin``)."""
    names = sorted(counts_by_domain)
    infos = tuple(meta[split][d] for d in names)
    order = _selection_order(cfg.seed, [counts_by_domain[d] for d in names])
    return write_packed_units(
        _DomainSource(str(tokenized_dir), infos, meta["dtype"], meta["eos_id"]),
        order,
        _selection_lengths(tokenized_dir, infos, order),
        out_dir,
        seq_len=cfg.seq_len,
        vocab_size=meta["vocab_size"],
        eos_id=meta["eos_id"],
        pad_id=meta["pad_id"],
        seed=cfg.seed,
        rows_per_shard=cfg.rows_per_shard,
        extra_meta={**extra_meta, "domains": names} if by_domain else extra_meta,
        doc_domains=order[:, 0] if by_domain else None,
    )


def _save_counts(out_dir: Path, counts_by_domain: dict[str, np.ndarray], meta, split) -> dict:
    """Write per-domain document use counts (aligned with the tokenized docs.parquet)."""
    folder = Path(out_dir) / "doc_counts"
    folder.mkdir(exist_ok=True)
    files = {}
    for domain, counts in counts_by_domain.items():
        name = Path(meta[split][domain]["dir"]).name + ".npy"
        np.save(folder / name, counts.astype(np.int32))
        files[domain] = f"doc_counts/{name}"
    return files


def build_mixture(
    cfg: StageMixture, tokenized_dir: Path, out_dir: Path, max_seq_len: int | None = None
) -> dict:
    """Build one stage's packed, shuffled dataset from the tokenized domains.

    Args:
        cfg: The stage's mixture (weights, budget, max_epochs, seq_len, seed).
        tokenized_dir: Output of `tokenize_corpus`.
        out_dir: Existing directory; receives the packed dataset (see `tasks.dataprep.pack`)
            plus ``doc_counts/{domain}.npy`` (uses of each training document).
        max_seq_len: The model's longest context, if known; a longer seq_len fails early.

    Returns:
        Headline metrics: sequences, tokens, and per domain the realised share and epochs.
    """
    _check_seq_len(cfg.seq_len, max_seq_len)
    meta = _read_tokenized_meta(tokenized_dir)
    available = {d: info["num_tokens"] + info["num_docs"] for d, info in meta["train"].items()}
    targets, notes = plan_mixture(cfg, available)
    counts = _select_counts(cfg, tokenized_dir, meta, targets)
    report = _mixture_report(tokenized_dir, meta, counts, available)
    packed = _pack_mixture(cfg, tokenized_dir, meta, counts, out_dir, report, notes)
    return _mixture_metrics(packed, notes, report)


def _select_counts(cfg: StageMixture, tokenized_dir: Path, meta: dict, targets: dict) -> dict:
    """Uses of each training document per domain, reaching the domain's target tokens."""
    rng = np.random.default_rng([cfg.seed, 0])
    counts = {}
    for domain in sorted(targets):
        lengths = _lengths_with_eos(tokenized_dir, meta["train"][domain])
        counts[domain] = select_documents(lengths, targets[domain], rng)
    return counts


def _pack_mixture(cfg, tokenized_dir, meta, counts, out_dir, report, notes) -> dict:
    """Pack the selected training documents; ``meta.json`` also holds the stage, the report,
    the reweighting notes and where the document counts are (written here)."""
    extra = {
        "stage": cfg.model_dump(),
        "mixture": report,
        "notes": notes,
        "doc_counts": _save_counts(out_dir, counts, meta, "train"),
    }
    return _pack_selection(cfg, tokenized_dir, meta, "train", counts, out_dir, extra)


def _mixture_metrics(packed: dict, notes: list[str], report: dict) -> dict:
    """`build_mixture`'s metrics: sequences, tokens, reweighted domains, per-domain share and
    epochs."""
    metrics = {"num_sequences": packed["num_sequences"], "num_tokens": packed["num_tokens"]}
    metrics["num_reweighted"] = len(notes)
    for domain, row in report.items():
        metrics[f"share/{domain}"] = row["share"]
        metrics[f"epochs/{domain}"] = row["epochs"]
    return metrics


def _mixture_report(tokenized_dir, meta, counts, available) -> dict:
    used = {}
    for domain, c in counts.items():
        lengths = _lengths_with_eos(tokenized_dir, meta["train"][domain])
        used[domain] = int((c * lengths).sum())
    total = sum(used.values())
    return {
        d: {
            "tokens": used[d],
            "share": round(used[d] / total, 6),
            "epochs": round(used[d] / available[d], 4),
            "num_doc_uses": int(counts[d].sum()),
        }
        for d in sorted(used)
    }


def build_validation(
    cfg: ValidationConfig, tokenized_dir: Path, out_dir: Path, max_seq_len: int | None = None
) -> dict:
    """Pack every held-out validation document exactly once (for in-training validation loss;
    with ``cfg.by_domain``, each document's domain too, for the loss per domain).

    The held-out documents as text are in ``{tokenized_dir}/validation_docs`` (a corpus
    directory), for the evaluation step's per-domain perplexity.
    """
    _check_seq_len(cfg.seq_len, max_seq_len)
    meta = _read_tokenized_meta(tokenized_dir)
    domains = _validation_domains(meta, tokenized_dir)
    counts = {d: np.ones(info["num_docs"], np.int64) for d, info in domains.items()}
    extra = {
        "validation": {
            d: {"num_docs": i["num_docs"], "num_tokens": i["num_tokens"]}
            for d, i in domains.items()
        }
    }
    packed = _pack_selection(
        cfg, tokenized_dir, meta, "validation", counts, out_dir, extra, cfg.by_domain
    )
    return {k: packed[k] for k in ("num_sequences", "num_tokens", "num_documents")}


def _validation_domains(meta: dict, tokenized_dir: Path) -> dict[str, dict]:
    """The domains holding validation documents, with their ``meta.json`` entries."""
    domains = {d: info for d, info in meta["validation"].items() if info["num_docs"] > 0}
    if not domains:
        raise BadInputError(
            f"{tokenized_dir} holds no validation documents; re-run tokenize_corpus with "
            "validation_fraction > 0"
        )
    return domains


def chinchilla_report(num_params: int, num_tokens: int) -> dict:
    """Compare a token budget with the compute-optimal one (Hoffmann et al. 2022: ~20 tokens/param).

    Returns:
        ``optimal_tokens``, ``tokens_per_param``, ``ratio_to_optimal`` (above 1 over-trains,
        below 1 under-trains) and a one-line ``verdict``.
    """
    if num_params < 1 or num_tokens < 1:
        raise BadInputError(f"num_params={num_params} and num_tokens={num_tokens} must be >= 1")
    optimal = CHINCHILLA_TOKENS_PER_PARAM * num_params
    ratio = num_tokens / optimal
    return {
        "num_params": num_params,
        "num_tokens": num_tokens,
        "optimal_tokens": optimal,
        "tokens_per_param": round(num_tokens / num_params, 3),
        "ratio_to_optimal": round(ratio, 4),
        "verdict": _verdict(ratio),
    }


def _verdict(ratio: float) -> str:
    """`chinchilla_report`'s one line for a budget ``ratio`` times the compute-optimal one."""
    if abs(ratio - 1) < 0.05:
        return "about compute-optimal"
    if ratio > 1:
        return f"over-trains: {ratio:.2f}x the compute-optimal tokens"
    return f"under-trains: {ratio:.2f}x the compute-optimal tokens ({1 / ratio:.1f}x too few)"


def _headline(metrics: dict) -> Metrics:
    return {k: v for k, v in metrics.items() if not isinstance(v, (dict, list))}


# version 2: meta.json records where the padding is (the loader masks it by position)
@step("mixture", version=2, data_engine=True)
def mixture(cfg: StageMixture, tokenized: Path, out: Path) -> Metrics:
    """Pack one stage's mixture: domain weights, token budget, offline sequence shuffle."""
    return _headline(build_mixture(cfg, tokenized, out))


# version 2: meta.json records where the padding is (the loader masks it by position)
@step("validation", version=2, data_engine=True)
def validation(cfg: ValidationConfig, tokenized: Path, out: Path) -> Metrics:
    """Pack the held-out documents for in-training validation loss."""
    return _headline(build_validation(cfg, tokenized, out))
