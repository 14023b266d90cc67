"""RULER's prompts (each task checked by hand on a fixed seed), lm-eval's scoring of them, and
the ruler step on tiny models."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from lm_eval.api.model import LM
from pydantic import BaseModel

from llmflow.model.config import preset
from llmflow.model.hf import save_model
from llmflow.model.transformer import Transformer
from llmflow.tasks.evaluation.card import long_context_report, render_card
from llmflow.tasks.evaluation.leaderboard import add_labelled_metrics
from llmflow.tasks.extend.config import RulerConfig
from llmflow.tasks.extend.ruler import (
    RulerEval,
    ruler,
    score,
    task_manager,
    write_prompts,
)
from llmflow.tasks.extend.ruler_tasks.utils import NIAH, TextTokens, samples
from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph
from llmflow.tasks.framework.step import Metrics, step

HAYSTACK = "Rivers carry water to the sea. Mountains rise above the clouds. " * 30
TRAINING_TEXT = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards. What are all the special magic numbers "
    "for mentioned in the provided text? The grass is green. The sky is blue. The sun is "
    "yellow. Here we go. There and back again. Memorize and track the chain(s) of variable "
    "assignment hidden in the following text. Question: Find all variables that are assigned "
    "the value in the text above. Answer: According to the chain(s) of variable assignment in "
    "the text above, variables are assgined the value, they are: Below is a numbered list of "
    "words. Read the following coded text and track the frequency of each coded word. "
    + HAYSTACK
    + "0123456789"
)
NEEDLE = re.compile(r"One of the special magic (?:numbers|uuids) for (\S+) is: (\S+)\.")
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
WORD_KEY = re.compile(r"^[a-z]+(?:-[a-z]+)+$")


def make_tokenizer(folder: Path) -> Path:
    """A small byte-level BPE (a few hundred tokens) trained on RULER's own phrases."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    tok.train_from_iterator([TRAINING_TEXT] * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokens(tokenizer_dir) -> TextTokens:
    return TextTokens(tokenizer_dir)


def _count(tokens, text: str) -> int:
    return len(tokens(text).input_ids)


# ------------------------------------------------------------------------------ prompts by hand
EXPECTED_NIAH = {  # task: (keys in the text, values per key, keys queried, haystack)
    "niah_single_1": (1, 1, 1, "repeat"),
    "niah_single_2": (1, 1, 1, "essay"),
    "niah_single_3": (1, 1, 1, "essay"),
    "niah_multikey_1": (4, 1, 1, "essay"),
    "niah_multikey_2": (1, 1, 1, "needle"),
    "niah_multikey_3": (1, 1, 1, "needle"),
    "niah_multivalue": (1, 4, 1, "essay"),
    "niah_multiquery": (4, 1, 4, "essay"),
}


@pytest.mark.parametrize("task", sorted(NIAH))
def test_niah_prompt_holds_its_needles_and_asks_for_the_queried_values(task, tokens):
    num_keys, num_values, num_queries, haystack = EXPECTED_NIAH[task]
    rows = samples(task, tokens, 512, 2, HAYSTACK, seed=0)
    assert len(rows) == 2
    for row in rows:
        text, prefix = row["input"], row["gen_prefix"]
        assert row["max_length"] == 512
        assert row["length"] == _count(tokens, text) + 128 <= 512  # 128: RULER's NIAH budget
        single = num_values * num_queries == 1
        kind = "uuid" if task in ("niah_single_3", "niah_multikey_3") else "number"
        opening = f"A special magic {kind} is" if single else f"Some special magic {kind}s are"
        assert text.startswith(f"{opening} hidden within the following text.")
        # The queried keys, read back from the answer prefix lm-eval writes after the prompt.
        verb = "is" if single else "are"
        noun = kind if single else f"{kind}s"
        match = re.fullmatch(
            rf"The special magic {noun} for (.+) mentioned in the provided text {verb}", prefix
        )
        queried = re.split(r", and |, ", match.group(1))
        assert len(queried) == num_queries
        question = "What is the" if single else "What are all the"
        assert text.endswith(f"{question} special magic {noun} for {match.group(1)} mentioned in "
                             "the provided text?")  # fmt: skip
        needles = NEEDLE.findall(text)
        by_key: dict[str, list[str]] = {}
        for key, value in needles:
            by_key.setdefault(key, []).append(value)
        expected = [v for key in queried for v in by_key[key]]
        assert sorted(row["outputs"]) == sorted(expected)
        assert len(row["outputs"]) == num_queries * num_values
        for key in queried:
            assert len(by_key[key]) == num_values
        if haystack == "needle":  # the haystack is made of other keys' needles
            assert len(by_key) > num_keys
        else:
            assert len(by_key) == num_keys
            filler = "The grass is green." if haystack == "repeat" else "Rivers carry water"
            assert filler in text
        key_format = UUID if task == "niah_multikey_3" else WORD_KEY
        assert all(key_format.match(k) for k in queried)
        for value in row["outputs"]:
            assert UUID.match(value) if kind == "uuid" else re.fullmatch(r"\d{7}", value)
    assert samples(task, tokens, 512, 2, HAYSTACK, seed=0) == rows  # the seed fixes them
    assert samples(task, tokens, 512, 2, HAYSTACK, seed=1) != rows


def test_vt_prompt_follows_one_chain_after_one_worked_example(tokens):
    rows = samples("vt", tokens, 512, 2, HAYSTACK, seed=0)
    for row in rows:
        text = row["input"]
        assert row["length"] <= 512 and row["max_length"] == 512
        # The worked example comes first, with its answer; the prompt is the last template.
        start = text.rfind("Memorize and track the chain(s) of variable assignment")
        assert start > 0 and text[:start].count("Answer: According to the chain(s)") == 1
        prompt = text[start:]
        value = re.search(r"assigned the value (\d+) in the text above\.$", prompt).group(1)
        assert row["gen_prefix"] == (
            "Answer: According to the chain(s) of variable assignment in the text above, "
            f"5 variables are assgined the value {value}, they are:"
        )
        # Follow the chain by hand: VAR A = value, VAR B = VAR A, ...
        assigned = dict(re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", prompt))
        chain, current = [], value
        while True:
            nxt = [var for var, source in assigned.items() if source in (current, f"VAR {current}")]
            if not nxt:
                break
            chain.append(nxt[0])
            current = nxt[0]
        assert chain == row["outputs"] and len(chain) == 5
    assert samples("vt", tokens, 512, 2, HAYSTACK, seed=0) == rows


def test_cwe_answer_is_the_ten_most_common_words_of_the_list(tokens):
    rows = samples("cwe", tokens, 2048, 1, HAYSTACK, seed=0)
    (row,) = rows
    assert row["length"] <= 2048 and row["gen_prefix"] == (
        "Answer: The top 10 words that appear most often in the list are:"
    )
    listed = re.findall(r"(?:^|\s)\d+\. (\S+)", row["input"].split("\n")[1])
    counts = Counter(listed)
    assert sorted(row["outputs"]) == sorted(w for w, c in counts.items() if c == 6)
    assert len(row["outputs"]) == 10 and max(c for w, c in counts.items() if c != 6) == 1
    assert row["input"].endswith("Question: What are the 10 most common words in the above list?")


def test_fwe_answer_is_the_three_most_frequent_coded_words(tokens):
    (row,) = samples("fwe", tokens, 512, 1, HAYSTACK, seed=0)
    coded = row["input"].split("coded words. ", 1)[1].split("\nQuestion:")[0].split()
    counts = Counter(w for w in coded if w != "...")
    assert row["outputs"] == [w for w, _ in counts.most_common(3)]
    assert counts.most_common(4)[2][1] > counts.most_common(4)[3][1]  # no tie for third
    assert row["gen_prefix"].startswith("Answer: According to the coded text above")


def test_a_task_that_cannot_fit_a_length_is_skipped_with_its_reason(tmp_path, tokens):
    cfg = RulerEval(ruler=RulerConfig(tasks=["vt", "fwe"], samples=1), labels=["m"],
                    lengths=[160, 512])  # fmt: skip
    data, skipped = write_prompts(cfg, tokens, HAYSTACK, tmp_path)
    assert set(data) == {"vt", "fwe"}
    assert [(s["task"], s["length"]) for s in skipped] == [("vt", 160)]
    assert "example does not fit" in skipped[0]["reason"]
    lengths = [json.loads(line)["max_length"] for line in data["vt"].read_text().splitlines()]
    assert lengths == [512]


# ------------------------------------------------------------------------------ lm-eval scoring
class FakeLM(LM):
    """Answers from the document itself: all of its answers, the first one, or nothing."""

    def __init__(self, answer: str):
        super().__init__()
        self.answer, self.contexts = answer, []

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        self.contexts += [(r.args[0], r.doc) for r in requests]
        outputs = [r.doc["outputs"] for r in requests]
        if self.answer == "all":
            return [" " + ", ".join(o) + "." for o in outputs]
        if self.answer == "first":
            return [" " + o[0] for o in outputs]
        return [" I do not know." for _ in outputs]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


@pytest.fixture(scope="module")
def manager(tmp_path_factory, tokens):
    folder = tmp_path_factory.mktemp("ruler")
    tasks = ["niah_single_1", "niah_multivalue", "vt", "cwe", "fwe"]
    cfg = RulerEval(ruler=RulerConfig(tasks=tasks, samples=2), labels=["m"],
                    lengths=[384, 2048])  # fmt: skip
    data, skipped = write_prompts(cfg, tokens, HAYSTACK, folder / "data")
    assert {(s["task"], s["length"]) for s in skipped} == {("vt", 384), ("cwe", 384)}
    return task_manager(data, cfg.lengths, folder / "yaml"), list(data), folder / "data"


def test_lm_eval_scores_right_answers_1_and_wrong_ones_0_at_each_length(manager):
    tasks_manager, tasks, _ = manager
    right = score(FakeLM("all"), tasks_manager, tasks)
    wrong = score(FakeLM("none"), tasks_manager, tasks)
    expected_lengths = {"niah_single_1": ["2048", "384"], "niah_multivalue": ["2048", "384"],
                        "vt": ["2048"], "cwe": ["2048"], "fwe": ["2048", "384"]}  # fmt: skip
    assert {t: sorted(v) for t, v in right.items()} == expected_lengths
    assert all(v == 1.0 for values in right.values() for v in values.values())
    assert all(v == 0.0 for values in wrong.values() for v in values.values())
    # RULER's metric is the share of a prompt's answers found: 1 of multivalue's 4 is 0.25.
    first = score(FakeLM("first"), tasks_manager, ["niah_multivalue", "niah_single_1"])
    assert first == {
        "niah_multivalue": {"2048": 0.25, "384": 0.25},
        "niah_single_1": {"2048": 1.0, "384": 1.0},
    }


def test_lm_eval_renders_the_prompt_then_its_answer_prefix(manager):
    tasks_manager, tasks, data = manager
    lm = FakeLM("all")
    score(lm, tasks_manager, tasks)
    assert len(lm.contexts) == sum(len((data / f"{t}.jsonl").read_text().splitlines())
                                   for t in tasks)  # fmt: skip
    for context, doc in lm.contexts:
        delimiter = "\n\n" if doc["input"].startswith("Below is a numbered list") else " "
        assert context == doc["input"] + delimiter + doc["gen_prefix"]


# ------------------------------------------------------------------------------ the step
class FixtureSpec(BaseModel):
    kind: str


@step("test-ruler-input")
def fixture_output(cfg: FixtureSpec, out: Path) -> Metrics:
    """Tiny stage models, the BPE tokenizer, held-out documents and a longctx report."""
    if cfg.kind.startswith("ctx"):
        mc = preset("debug", vocab_size=1024, hidden_size=32, num_layers=2,
                    max_seq_len=int(cfg.kind[3:]))  # fmt: skip
        model = Transformer(mc)
        model.init_weights(seed=0)
        save_model(model, mc, out / "final")
    elif cfg.kind == "tokenizer":
        make_tokenizer(out)
    elif cfg.kind == "tokenized":
        tokens = TextTokens(make_tokenizer(out / "tok"))
        docs = [np.array(tokens(HAYSTACK[i * 300 :]).input_ids, dtype=np.uint16) for i in (0, 1)]
        folder = out / "validation" / "prose"
        folder.mkdir(parents=True)
        np.concatenate(docs).tofile(folder / "tokens.bin")
        np.save(folder / "offsets.npy", np.cumsum([0, *map(len, docs)]))
        meta = {
            "dtype": "uint16",
            "train": {},
            "validation": {"prose": {"dir": "validation/prose"}},
        }
        (out / "meta.json").write_text(json.dumps(meta))
    else:
        curve = {"bucket_start": [0, 128, 256], "loss": [2.0, 3.0, 5.0], "num_docs": 1}
        report = {
            "original_len": 256,
            "position_loss": dict.fromkeys(("before", "after", "after+yarn"), curve),
            "passkey": {k: {"accuracy": [[a, a]]}
                        for k, a in (("before", 0.0), ("after", 0.5), ("after+yarn", 1.0))},
        }  # fmt: skip
        (out / "longctx.json").write_text(json.dumps(report))
    return {}


def test_ruler_step_scores_every_stage_beside_passkey_and_feeds_the_board_and_card(tmp_path):
    graph = Graph()
    made = {k: graph.add(fixture_output, FixtureSpec(kind=k), k)
            for k in ("ctx256", "ctx512", "tokenizer", "tokenized", "longctx")}  # fmt: skip
    cfg = RulerEval(ruler=RulerConfig(tasks=["niah_single_1", "vt", "fwe"], samples=1),
                    labels=["ctx256", "ctx512"], lengths=[256, 512])  # fmt: skip
    node = graph.add(ruler, cfg, "test", models=[made["ctx256"], made["ctx512"]],
                     tokenizer=made["tokenizer"], tokenized=made["tokenized"],
                     longctx=made["longctx"])  # fmt: skip
    executor = Executor(str(tmp_path), audit=True)
    result = executor.run(graph)[node]
    assert executor.unhashed_reads(graph) == {}

    out = Path(result.uri)
    report = json.loads((out / "ruler.json").read_text())
    assert set(report["scores"]) == {"ctx256", "ctx512"}
    for by_task in report["scores"].values():
        assert sorted(by_task) == ["fwe", "niah_single_1", "vt"]
        assert sorted(by_task["vt"]) == ["512"]  # vt's example does not fit 256 tokens
        assert all(0 <= v <= 1 for values in by_task.values() for v in values.values())
    assert report["skipped"][0]["task"] == "vt" and result.metrics["num_skipped"] == 1
    key = "ctx512/niah_single_1/256"
    assert result.metrics[key] == report["scores"]["ctx512"]["niah_single_1"]["256"]
    # The prompts scored are kept, and the held-out text is their essay haystack.
    assert (out / "data" / "fwe.jsonl").exists()

    markdown = (out / "ruler.md").read_text()
    assert "passkey" in markdown and "RULER@256" in markdown and "RULER@512" in markdown
    assert "after+yarn (longctx)" in markdown
    table = [a for a in result.artifacts if a["kind"] == "table"][0]["rows"]
    assert {(r["model"], r["task"]) for r in table} == {
        (m, t) for m in ("ctx256", "ctx512") for t in ("fwe", "niah_single_1", "vt")
    }
    # The last stage's scores join the leaderboard row of its export, "extended".
    records = [{"metrics": {"ppl": {"x": 1.0}}}, {"metrics": {}}]
    add_labelled_metrics(records, ["base", "extended"], out)
    assert records[1]["metrics"]["ruler_vt"] == report["scores"]["ctx512"]["vt"]
    assert records[1]["higher_is_better"]["ruler_vt"] == {"512": True}
    # ... and the card's long-context section is the step's report.
    section = long_context_report(out)
    assert section == markdown
    facts = {"sources": [], "curation": [], "decontamination": {}, "stages": [],
             "posttraining": [], "parameters": None, "base_model": None}  # fmt: skip
    from llmflow.tasks.evaluation.card import CardConfig

    card = render_card(CardConfig(model_name="m"), facts, {}, None, long_context=section)
    assert "## Long context\n\n" + markdown in card
    assert "## Long context" not in render_card(CardConfig(model_name="m"), facts, {}, None)


# ------------------------------------------------------------------------------ generation
@pytest.mark.parametrize(
    "overrides",
    [{}, {"qk_norm": True, "nope_layers": [1], "tie_embeddings": False}],
    ids=["debug", "qk-norm-nope-untied"],
)
def test_cached_greedy_matches_the_full_forward_each_step(overrides):
    from llmflow.tasks.extend.longctx import greedy_generate
    from llmflow.tasks.extend.ruler import cached_forward, greedy

    torch.manual_seed(0)
    cfg = preset("debug", vocab_size=300, hidden_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, **overrides)  # fmt: skip
    model = Transformer(cfg).eval()
    ids = torch.randint(0, 300, (1, 40))
    cache = [None] * cfg.num_layers
    with torch.no_grad():
        full = model(ids)
        prefill = cached_forward(model, ids[:, :30], 0, cache)
        torch.testing.assert_close(prefill, full[:, :30], rtol=1e-5, atol=1e-5)
        for position in range(30, 40):  # one token at a time against the whole row
            step_logits = cached_forward(model, ids[:, position : position + 1], position, cache)
            torch.testing.assert_close(step_logits[0, 0], full[0, position], rtol=1e-5, atol=1e-5)
    prompt = ids[0, :25].tolist()
    reference = greedy_generate(model, prompt, 12)  # the whole row every step
    assert greedy(model, prompt, 12) == reference
    stop = reference[5]
    assert greedy(model, prompt, 12, stop=stop) == reference[: reference.index(stop)]
