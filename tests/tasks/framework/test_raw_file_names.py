"""A raw input's address holds each file's path (relative to the files' common folder) with its
bytes: a step that reads a label from a file's name (ToxiGen's hate/neutral and target group)
is never served an output made under the old names; where the folder lies does not matter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pydantic import BaseModel

from llmflow.tasks.framework.executor import Executor
from llmflow.tasks.framework.graph import Graph, Raw
from llmflow.tasks.framework.hashing import relative_names
from llmflow.tasks.framework.step import Metrics, RawFiles, step
from llmflow.tasks.framework.store import Store
from llmflow.tasks.safety.config import TOXIGEN_DIR, ToxicityClassifierConfig
from llmflow.tasks.safety.data import packaged_root, safety_files


class LabelConfig(BaseModel):
    suffix: str = ".txt"


@step("toy-labels")
def labels(cfg: LabelConfig, data: RawFiles, out: Path) -> Metrics:
    """Each file's label from its name (as ToxiGen's are), with its line count."""
    found = {Path(f).name.removesuffix(cfg.suffix): len(Path(f).read_text().split()) for f in data}
    (out / "labels.json").write_text(json.dumps(found, sort_keys=True))
    return found


def folder(root: Path, names: dict[str, str]) -> list[str]:
    root.mkdir(parents=True)
    for name, text in names.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return sorted(str(root / name) for name in names)


def address(store: Store, files: list[str]) -> str:
    return labels.address(store, LabelConfig(), "toy", {"data": RawFiles(files)})[1]


def test_same_bytes_under_other_names_is_another_address(tmp_path):
    store = Store(tmp_path / "store")
    # one label fixed by renaming: the files' bytes, in the same order, under other names
    hate = {"hate_x.txt": "a b\n", "neutral_y.txt": "c\n"}
    fixed = {"neutral_x.txt": "a b\n", "neutral_y.txt": "c\n"}
    a = address(store, folder(tmp_path / "a", hate))
    assert address(store, folder(tmp_path / "b", fixed)) != a
    # the same names and bytes anywhere else: the same address
    assert address(store, folder(tmp_path / "elsewhere" / "c", hate)) == a
    nested = {"data/hate_x.txt": "a b\n", "data/neutral_x.txt": "c\n", "top.txt": ""}
    moved = {"data/hate_x.txt": "a b\n", "more/neutral_x.txt": "c\n", "top.txt": ""}
    assert address(store, folder(tmp_path / "d", nested)) != address(
        store, folder(tmp_path / "e", moved)
    )


def test_a_renamed_file_reruns_the_step(tmp_path):
    folder(tmp_path / "data", {"hate_x.txt": "a b\n", "neutral_y.txt": "c\n"})

    def run() -> tuple[bool, dict]:
        graph = Graph()
        files = sorted(str(p) for p in (tmp_path / "data").iterdir())
        graph.add(labels, LabelConfig(), "toy", data=Raw(tuple(files)))
        result = next(iter(Executor(str(tmp_path / "store")).run(graph).rows()))
        return result.cached, json.loads((Path(result.uri) / "labels.json").read_text())

    assert run() == (False, {"hate_x": 2, "neutral_y": 1})
    assert run()[0] is True
    (tmp_path / "data" / "hate_x.txt").rename(tmp_path / "data" / "neutral_x.txt")
    assert run() == (False, {"neutral_x": 2, "neutral_y": 1})


def test_a_relabelled_toxigen_file_is_another_classifier(tmp_path):
    from llmflow.tasks.safety.classifier import toxicity_classifier

    store = Store(tmp_path / "store")

    def copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(packaged_root(), target)
        return target

    def classifier(root: Path) -> str:
        inputs = {"data": RawFiles(safety_files(root))}
        return toxicity_classifier.address(store, ToxicityClassifierConfig(), "c", inputs)[1]

    same, relabelled = copy("same"), copy("relabelled")
    demos = relabelled / TOXIGEN_DIR
    # a target group renamed; the files keep their order, so only the names differ
    old = demos / "nationality__hate_middle_east_sentences.txt"
    old.rename(demos / "nationality__hate_mideast_sentences.txt")
    assert [Path(f).read_bytes() for f in safety_files(relabelled)] == [
        Path(f).read_bytes() for f in safety_files(same)
    ]
    assert classifier(same) == classifier(packaged_root())
    assert classifier(relabelled) != classifier(same)


def test_relative_names_drop_the_common_folder_only():
    assert relative_names(["/data/x/a.txt"]) == ["a.txt"]
    assert relative_names(["/d/crows.csv", "/d/demos/h.txt", "/d/demos/n.txt"]) == [
        "crows.csv",
        "demos/h.txt",
        "demos/n.txt",
    ]
    assert relative_names(["s3://b/p/a.txt", "s3://b/q/a.txt"]) == ["p/a.txt", "q/a.txt"]
    assert relative_names(["/a.txt", "/b/./c.txt"]) == ["a.txt", "b/c.txt"]
    assert relative_names(["my.jsonl"]) == ["my.jsonl"] and relative_names([]) == []
