"""Train a byte-level BPE tokenizer on a streamed sample and save it for `transformers`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.framework.step import Metrics, report_table, step
from llmflow.tasks.tokenizer.config import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TokenizerConfig,
)
from llmflow.tasks.tokenizer.corpus import (
    RejectLog,
    corpus_files,
    holdout_mask,
    iter_batches,
    valid_rows,
)
from llmflow.tasks.tokenizer.evaluate import evaluate_tokenizer, write_report

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# ChatML. The assistant turn (its content and closing <|im_end|>) sits inside
# {% generation %} so that TRL's assistant_only_loss can mask everything else.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def new_bpe_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE: no normalizer, so decoding restores the exact text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def fit_bpe(texts: Iterator[list[str]], vocab_size: int, min_frequency: int) -> Tokenizer:
    """Train a byte-level BPE from an iterator of text batches."""
    tokenizer = new_bpe_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


class _Sample:
    """Streams the training sample (capped bytes) and collects evaluation documents beside it."""

    def __init__(self, cfg: TokenizerConfig, files: list[Path], rejects: RejectLog | None):
        self.cfg, self.files, self.rejects = cfg, files, rejects
        self.eval_docs: dict[str, list[str]] = {}
        self.num_docs = self.num_bytes = 0

    def __iter__(self) -> Iterator[list[str]]:
        for batch in iter_batches(self.files, self.cfg.read_batch_rows):
            cols, rejected = valid_rows(batch)
            if self.rejects is not None:
                self.rejects.write(rejected)
            held = holdout_mask(cols["id"], self.cfg.eval_fraction)
            train = []
            for text, domain, is_eval in zip(cols["text"], cols["domain"], held, strict=True):
                if is_eval:
                    docs = self.eval_docs.setdefault(domain, [])
                    if len(docs) < self.cfg.max_eval_docs_per_domain:
                        docs.append(text)
                elif self.num_bytes < self.cfg.max_sample_bytes:
                    train.append(text)
                    self.num_bytes += len(text.encode("utf-8"))
            self.num_docs += len(train)
            if train:
                yield train
            if self.num_bytes >= self.cfg.max_sample_bytes:
                return  # evaluation documents come from the same streamed prefix


def save_for_transformers(tokenizer: Tokenizer, out_dir: Path) -> PreTrainedTokenizerFast:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and friends."""
    from transformers import PreTrainedTokenizerFast  # NOTE: loaded when the step runs

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # NOTE: True would turn " ." into "." on decode
    )
    fast.save_pretrained(out_dir)
    _chat_template_into_config(Path(out_dir))
    return fast


def _chat_template_into_config(out_dir: Path) -> None:
    """Keep the chat template in tokenizer_config.json too, where older readers look for it."""
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    # NOTE: transformers 5 writes "TokenizersBackend", which transformers 4 cannot resolve;
    # both resolve PreTrainedTokenizerFast.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


@step("tokenizer", execution=("read_batch_rows",))
def train_tokenizer(cfg: TokenizerConfig, corpus: Path, out: Path) -> Metrics:
    """Train the BPE tokenizer, save it loadable by `AutoTokenizer`, report its fertility.

    Args:
        cfg: The step's config.
        corpus: Curated corpus (``shards/**/*.parquet`` with id, text, domain, source).
        out: Existing directory; receives tokenizer files, ``tokenizer_eval.json``,
            ``tokenizer_eval.png`` and ``rejects.jsonl``.

    Returns:
        Headline metrics: vocabulary size, sample size, training time and the overall
        fertility, continued-word rate and bytes per token on the evaluation documents.
    """
    out_dir = Path(out)
    files = corpus_files(corpus)
    rejects = RejectLog(out_dir / "rejects.jsonl")
    sample = _Sample(cfg, files, rejects)
    start = time.perf_counter()
    tokenizer = fit_bpe(iter(sample), cfg.vocab_size, cfg.min_frequency)
    train_seconds = time.perf_counter() - start
    if sample.num_docs == 0:
        raise BadInputError(
            f"empty corpus: no usable training text in {corpus} ({rejects.count} rejected "
            f"records, see {rejects.path}); lower eval_fraction or fix the corpus"
        )
    save_for_transformers(tokenizer, out_dir)
    eval_docs = sample.eval_docs or _fallback_eval_docs(cfg, files)
    rows = evaluate_tokenizer(tokenizer, eval_docs)
    for size in cfg.sweep_vocab_sizes:
        if size != cfg.vocab_size:
            swept = fit_bpe(iter(_Sample(cfg, files, None)), size, cfg.min_frequency)
            rows += evaluate_tokenizer(swept, eval_docs)
    write_report(rows, out_dir, chosen_vocab_size=cfg.vocab_size)
    report_table("tokenizer-eval", rows, "Fertility, continued-word rate, bytes/token per domain")
    size = tokenizer.get_vocab_size()  # below cfg.vocab_size when the sample runs out of pairs
    overall = next(r for r in rows if r["domain"] == "all" and r["vocab_size"] == size)
    return {
        "vocab_size": size,
        "num_sample_docs": sample.num_docs,
        "num_sample_bytes": sample.num_bytes,
        "train_seconds": round(train_seconds, 3),
        "num_rejected": rejects.count,
        "fertility": overall["fertility"],
        "continued_word_rate": overall["continued_word_rate"],
        "bytes_per_token": overall["bytes_per_token"],
    }


def _fallback_eval_docs(cfg: TokenizerConfig, files: list[Path]) -> dict[str, list[str]]:
    """With eval_fraction=0 (or a tiny corpus), evaluate on the first training documents."""
    docs: dict[str, list[str]] = {}
    for batch in iter_batches(files, cfg.read_batch_rows):
        cols, _ = valid_rows(batch)
        for text, domain in zip(cols["text"], cols["domain"], strict=True):
            if len(docs.setdefault(domain, [])) < cfg.max_eval_docs_per_domain:
                docs[domain].append(text)
        return docs
    return docs
