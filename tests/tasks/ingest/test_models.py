"""Model references (``hf://models/...`` or a folder) resolve to a pinned source, offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmflow.tasks.framework.errors import BadInputError
from llmflow.tasks.ingest import models
from llmflow.tasks.ingest.hub import MIRROR_ENV, file_sha256

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _repo(folder: Path, weights: bytes = b"\0" * 64) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    monkeypatch.setenv(MIRROR_ENV, str(tmp_path / "mirror"))
    _repo(tmp_path / "mirror" / "org" / "tiny")
    return tmp_path / "mirror"


def test_a_mirrored_model_pins_to_its_fingerprint_and_the_pin_follows_the_weights(mirror):
    source = models.resolve("hf://models/org/tiny", "init")
    assert source.revision.startswith("local-") and source.folder == mirror / "org" / "tiny"
    assert source.pinned_uri == f"hf://models/org/tiny@{source.revision}"
    assert models.pin(source.pinned_uri, "init") == source.pinned_uri  # a pin resolves to itself

    (mirror / "org" / "tiny" / "model.safetensors").write_bytes(b"\1" + b"\0" * 63)  # same size
    changed = models.resolve("hf://models/org/tiny", "init")
    assert changed.revision != source.revision
    with pytest.raises(BadInputError, match=f"init=.*not the pinned {source.revision}"):
        models.resolve(source.pinned_uri, "init")  # a pin is never silently replaced


def test_model_files_are_the_whole_folder_less_the_download_cache(mirror):
    folder = mirror / "org" / "tiny"
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "x.lock").write_text("")
    files = models.model_files(models.resolve("hf://models/org/tiny", "init"))
    assert [Path(f).name for f in files] == ["config.json", "model.safetensors", "tokenizer.json"]
    assert file_sha256(Path(files[1])) == file_sha256(folder / "model.safetensors")


def test_a_named_revision_must_be_the_commit_the_mirror_folder_records(mirror):
    folder = mirror / "org" / "tiny"
    with pytest.raises(BadInputError, match=f"revision '{COMMIT}' is not in the mirror.*none"):
        models.resolve(f"hf://models/org/tiny@{COMMIT}", "init")
    meta = folder / ".cache" / "huggingface" / "download" / "model.safetensors.metadata"
    meta.parent.mkdir(parents=True)
    meta.write_text(f"{COMMIT}\netag\n1.0\n")
    source = models.resolve(f"hf://models/org/tiny@{COMMIT}", "init")
    assert source.revision == models.resolve("hf://models/org/tiny", "init").revision
    other = "f" * 40
    with pytest.raises(BadInputError, match=f"revision '{other}'.*records commit {COMMIT}"):
        models.resolve(f"hf://models/org/tiny@{other}", "init")
    assert models.resolve("hf://models/org/tiny@main", "init").folder == folder


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("hf://models/org/missing", r"init='hf://models/org/missing': no repo org/missing"),
        ("hf://models/org", r"init='hf://models/org' is not a Hub model URI"),
        ("", "init is empty"),
        ("/no/such/folder", r"init='/no/such/folder': no such folder"),
    ],
)
def test_a_missing_or_malformed_reference_is_named(mirror, uri, message):
    with pytest.raises(BadInputError, match=message):
        models.resolve(uri, "init")


def test_a_local_folder_pins_to_its_fingerprint_and_is_checked(tmp_path, monkeypatch):
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    folder = _repo(tmp_path / "model")
    seen = []
    source = models.resolve(str(folder), "init", lambda f, uri: seen.append((f, uri)))
    assert seen == [(folder, str(folder))]
    assert source.pinned_uri == str(folder.resolve()) and source.revision.startswith("local-")
    (folder / "model.safetensors").unlink()
    with pytest.raises(BadInputError, match="holds no weights"):
        models.check_files(folder, str(folder), "init")


def test_a_mirror_pin_without_the_mirror_fails(tmp_path, monkeypatch):
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    with pytest.raises(BadInputError, match=f"{MIRROR_ENV} is not set"):
        models.resolve("hf://models/org/tiny@local-0123456789abcdef", "init")
