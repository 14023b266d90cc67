"""Held-out loss per domain at each validation (``val_loss_by_domain``), against a hand
computation.

The corpus has two domains whose losses differ by far: "easy" documents repeat one token, "hard"
ones are uniform noise over 110 tokens (their loss cannot fall below ln 110). The reference is
dense: full logits of the same weights on the batches the validator reads, cross-entropy per
token, summed per document, the documents grouped by the domain their tokens show (not by the
packed domain index the validator reads), token-weighted. Their token-weighted mean must be the
stage's ``val_loss``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.tasks.dataprep.test_val_domains_pack import HARD, make_two_domain_tokenized
from tests.tasks.pretrain.conftest import SEQ_LEN, read_jsonl, run_trainer, tiny_config
from tests.tasks.pretrain.parallel.ranks import join_ranks

DOMAINS = ("easy", "hard")
SHARPEN = 8.0  # the layout test's factor on every matrix: logits far from uniform at init


@pytest.fixture(scope="module")
def two_domains(tmp_path_factory) -> tuple[Path, Path]:
    """(packed training mixture, validation set packed by domain) of the two-domain corpus."""
    from llmflow.tasks.dataprep.config import StageMixture, ValidationConfig
    from llmflow.tasks.dataprep.mixture import build_mixture, build_validation

    root = tmp_path_factory.mktemp("two_domains")
    tokenized = make_two_domain_tokenized(root / "tokenized", docs=60)
    train, val = root / "train", root / "val"
    train.mkdir()
    val.mkdir()
    mix = StageMixture(weights={"easy": 1, "hard": 1}, num_tokens=6000, seq_len=SEQ_LEN, seed=1)
    build_mixture(mix, tokenized, train)
    build_validation(ValidationConfig(seq_len=SEQ_LEN, seed=2, by_domain=True), tokenized, val)
    return train, val


def hand_losses(model, val: Path, micro_batch_size: int, batches: int, seed: int):
    """(loss by domain, tokens by domain, overall loss): dense logits, per-document sums."""
    from llmflow.tasks.dataprep.loader import IGNORE_INDEX, PackedLoader

    loader = PackedLoader(val, micro_batch_size, 0, 1, seed=seed)
    sums = dict.fromkeys(DOMAINS, 0.0)
    counts = dict.fromkeys(DOMAINS, 0)
    with torch.no_grad():
        for _ in range(batches):
            batch = loader.next_batch()
            logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
            labels = batch["labels"]
            ce = F.cross_entropy(
                logits.double().flatten(0, 1), labels.flatten(), reduction="none",
                ignore_index=IGNORE_INDEX,
            ).view(labels.shape)  # fmt: skip
            # a document is a run of positions from one restart of position_ids to the next
            doc = torch.cumsum(batch["position_ids"] == 0, dim=1)
            for row in range(labels.shape[0]):
                for d in doc[row].unique():
                    mask = (doc[row] == d) & (labels[row] != IGNORE_INDEX)
                    if not mask.any():
                        continue
                    targets = labels[row][mask].numpy()
                    domain = "hard" if (targets >= HARD[0]).any() else "easy"
                    sums[domain] += float(ce[row][mask].sum())
                    counts[domain] += int(mask.sum())
    loader.close()
    by_domain = {d: sums[d] / counts[d] for d in DOMAINS}
    return by_domain, counts, sum(sums.values()) / sum(counts.values())


def test_val_loss_by_domain_equals_the_hand_computation(tmp_path, two_domains):
    from llmflow.model.hf import load_model

    train, val = two_domains
    cfg = tiny_config(max_steps=24, eval_interval=8, log_interval=4, eval_batches=3,
                      optimizer={"lr": 1e-2}, checkpoint={"interval": 100, "keep_last": 1})  # fmt: skip
    out = tmp_path / "run"
    run_trainer(cfg, train, out, val_dir=val)
    rows = read_jsonl(out / "metrics.jsonl")
    validated = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in validated] == [8, 16, 24]
    assert all(sorted(r["val_loss_by_domain"]) == list(DOMAINS) for r in validated)
    assert not any("val_loss_by_domain" in r for r in rows if "val_loss" not in r)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss_by_domain"] == validated[-1]["val_loss_by_domain"]
    # the final validation ran on the final weights: recompute it by hand from final/
    model = load_model(out / "final").float().eval()
    want, counts, overall = hand_losses(model, val, 4, 3, cfg.seed)
    got = summary["val_loss_by_domain"]
    print("by domain", got, "hand", want, "tokens", counts, "val_loss", summary["val_loss"])
    for domain in DOMAINS:
        assert abs(got[domain] - want[domain]) <= 1e-5 * want[domain], (domain, got, want)
    assert want["hard"] - want["easy"] > 1.0  # the domains are told apart
    mean = sum(got[d] * counts[d] for d in DOMAINS) / sum(counts.values())
    assert abs(mean - summary["val_loss"]) <= 1e-6 * summary["val_loss"]
    assert abs(overall - summary["val_loss"]) <= 1e-5 * overall


def test_a_set_without_domains_logs_no_val_loss_by_domain(tmp_path, train_data, val_data):
    cfg = tiny_config(max_steps=4, eval_interval=2, eval_batches=1)
    out = tmp_path / "run"
    run_trainer(cfg, train_data, out, val_dir=val_data)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert not any("val_loss_by_domain" in r for r in rows)
    assert "val_loss_by_domain" not in json.loads((out / "summary.json").read_text())


def test_by_domain_moves_only_the_validation_sets_and_what_reads_them():
    """Off (the default), the flag leaves the hash (so no quickstart address moves: the address
    tests against earlier commits hold); on, exactly the validation sets and the nodes that read
    them, directly or not, move."""
    from llmflow.flows.recipe import recipe
    from llmflow.tasks.config import load_config
    from llmflow.tasks.dataprep.config import ValidationConfig
    from llmflow.tasks.framework.graph import Node
    from llmflow.tasks.framework.hashing import versioned_fields
    from tests.tasks.extend.ruler_addresses import addresses

    assert "by_domain" not in versioned_fields(ValidationConfig())
    off, on = addresses([]), addresses(["validation.by_domain=true"])
    reads: dict[int, bool] = {}
    labels: list[str] = []
    for node in recipe(load_config(None, [])).nodes:  # in order, labelled as addresses() does
        inputs = [v for value in node.inputs.values()
                  for v in (value if isinstance(value, list) else [value])]  # fmt: skip
        upstream = any(reads.get(id(v), False) for v in inputs if isinstance(v, Node))
        reads[id(node)] = node.step.name == "validation" or upstream
        label, count = node.label, 1
        while label in labels:
            count += 1
            label = f"{node.label}#{count}"
        labels.append(label)
        assert (off[label] != on[label]) == reads[id(node)], label
    assert sorted(labels) == sorted(off)
    assert sum(label.startswith("pretrain:") for label in labels if off[label] != on[label]) >= 3


def _layout_worker(rank: int, world: int, cfg_json: str, data: str, val: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from llmflow.tasks.pretrain.callbacks import Validator
    from llmflow.tasks.pretrain.config import TrainConfig
    from llmflow.tasks.pretrain.train import Trainer

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=world)
    trainer = Trainer(TrainConfig.model_validate_json(cfg_json), Path(data), Path(out),
                      val_dir=Path(val))  # fmt: skip
    with torch.no_grad():
        for param in trainer.model.parameters():
            if param.ndim == 2:
                (param.to_local() if isinstance(param, DTensor) else param).mul_(SHARPEN)
    loss, by_domain = Validator(Path(val), 1).measure(trainer)
    dist.destroy_process_group()
    torch.save({"val_loss": loss, "by_domain": by_domain}, f"{out}/rank{rank}.pt")


@pytest.mark.slow  # two spawned trainers at cp=2 (gloo): about 20 s on 2 cores
def test_val_loss_by_domain_at_cp2_equals_the_dense_hand_computation(tmp_path, two_domains):
    from llmflow.model.transformer import Transformer

    train, val = two_domains
    cfg = tiny_config(max_steps=1, eval_batches=3, parallel={"cp": 2},
                      checkpoint={"interval": 100, "keep_last": 1})  # fmt: skip
    out = tmp_path / "cp2"
    out.mkdir()
    ctx = mp.get_context("spawn")
    args = (2, cfg.model_dump_json(), str(train), str(val), str(out))
    join_ranks([ctx.Process(target=_layout_worker, args=(r, *args)) for r in range(2)], 120)
    # the same seeded weights in one process, sharpened the same way
    model = Transformer(cfg.model_config_obj())
    model.init_weights(seed=cfg.seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.mul_(SHARPEN)
    want, counts, overall = hand_losses(model.eval(), val, 4, 3, cfg.seed)
    print("hand", want, counts, overall)
    assert min(counts.values()) > 0
    for rank in range(2):
        got = torch.load(out / f"rank{rank}.pt")
        print(rank, got)
        for domain in DOMAINS:
            assert abs(got["by_domain"][domain] - want[domain]) <= 1e-5 * want[domain], got
        assert abs(got["val_loss"] - overall) <= 1e-5 * overall, got
        mean = sum(got["by_domain"][d] * counts[d] for d in DOMAINS) / sum(counts.values())
        assert abs(mean - got["val_loss"]) <= 1e-6 * got["val_loss"], got
