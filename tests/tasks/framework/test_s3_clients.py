"""Every ``s3://`` access goes through ``s3config.filesystem``, which applies the retry settings.

The integration test reads real objects from moto's S3 server through each module that touches
S3 (ingest, lineage source records, decontamination inputs and lineage walks, post-training's
reader, the store) and asserts on the botocore client each one actually used. The grep-style
test keeps any other module from building an S3 filesystem or client of its own.
"""

from __future__ import annotations

import ast
import hashlib
import json
from collections.abc import Callable, Iterator

import pytest

from llmflow.tasks.framework import s3config
from tests.integration.servers import REPO, S3, moto_server

BUCKET = "llmflow-clients"
CONFIGURED = {"mode": s3config.RETRY_MODE, "total_max_attempts": s3config.MAX_ATTEMPTS}
DOCS = [{"text": f"document number {i} about s3 clients", "domain": "prose"} for i in range(7)]


@pytest.fixture(scope="module")
def moto() -> Iterator[S3]:
    """moto's S3 server on 127.0.0.1 with one bucket."""
    with moto_server(BUCKET, secret_prefix="clients-") as s3:
        yield s3


@pytest.fixture()
def s3(moto: S3, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    """moto's credentials and endpoint in this process; botocore's own defaults otherwise."""
    from s3fs import S3FileSystem

    for key, value in moto.env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(key, raising=False)
    S3FileSystem.clear_instance_cache()
    yield moto
    S3FileSystem.clear_instance_cache()


def put(s3: S3, key: str, body: bytes) -> str:
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=body)
    return f"s3://{s3.bucket}/{key}"


def retries_used(call: Callable[[], object]) -> tuple[object, list]:
    """``call()``'s result and the retry config of each S3 client it used (built afresh)."""
    from s3fs import S3FileSystem

    S3FileSystem.clear_instance_cache()
    result = call()
    return result, [fs.s3.meta.config.retries for fs in S3FileSystem._cache.values()]


@pytest.mark.integration
def test_ingest_lineage_decontam_posttrain_and_store_use_the_configured_client(s3, tmp_path):
    from llmflow.tasks.decontam import lineage as decontam_lineage
    from llmflow.tasks.decontam.step import _local_files
    from llmflow.tasks.framework import lineage
    from llmflow.tasks.framework.store import Store
    from llmflow.tasks.ingest.ingest import IngestConfig, ingest, list_files
    from llmflow.tasks.posttrain.common import local_data

    body = "".join(json.dumps(d) + "\n" for d in DOCS).encode()
    docs = put(s3, "data/docs.jsonl", body)
    record = {"step": "decontaminate", "inputs": []}
    out = put(s3, "runs/out/lineage.json", json.dumps(record).encode())
    evalset = put(s3, "evalsets/arc.jsonl", b'{"question": "q", "answer": "a"}\n')
    chats = put(s3, "sft/chats.jsonl", b'{"messages": []}\n')
    lineage._source_record.cache_clear()

    calls = {
        "ingest: list": lambda: list_files([f"s3://{s3.bucket}/data/"]),
        "ingest: read": lambda: ingest(IngestConfig(), [docs], tmp_path / "ingest")["documents"],
        "lineage: source record": lambda: lineage.source_record(docs)["sha256"],
        "decontam: eval set": lambda: _local_files([evalset], tmp_path)[0].read_bytes(),
        "decontam: lineage walk": lambda: decontam_lineage.read_json(out),
        "posttrain: data": lambda: local_data((chats,), tmp_path / "post").read_bytes(),
        "store": lambda: Store(f"s3://{s3.bucket}/runs").read_lineage(out.rsplit("/", 1)[0]),
    }
    expected = {
        "ingest: list": [docs],
        "ingest: read": len(DOCS),
        "lineage: source record": hashlib.sha256(body).hexdigest(),
        "decontam: eval set": b'{"question": "q", "answer": "a"}\n',
        "decontam: lineage walk": record,
        "posttrain: data": b'{"messages": []}\n',
        "store": record,
    }
    used = {}
    for name, call in calls.items():
        result, used[name] = retries_used(call)
        assert result == expected[name], name  # the real objects were read
    assert used == {name: [CONFIGURED] for name in calls}


def test_s3config_filesystem_applies_the_retry_settings_to_s3_only(monkeypatch):
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    fs, path = s3config.filesystem("s3://bucket/a/b.jsonl")
    assert path == "bucket/a/b.jsonl"
    assert fs.config_kwargs == {"retries": {"mode": "standard", "total_max_attempts": 4}}
    local, path = s3config.filesystem(str(REPO / "README.md"))
    assert type(local).__name__ == "LocalFileSystem" and path == str(REPO / "README.md")


BUILDERS = {"url_to_fs", "open_files", "get_filesystem_class", "S3FileSystem"}
FSSPEC_NAMES = BUILDERS | {"open", "filesystem"}  # fsspec.open(...) and fsspec.filesystem(...)
CLIENT_PACKAGES = ("s3fs", "boto3", "botocore", "aiobotocore")


def _builds_a_filesystem(tree: ast.AST) -> list[str]:
    """Lines of a module that build an fsspec filesystem or an S3 client themselves."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            fsspec_call = name.startswith("fsspec.") and name.rsplit(".", 1)[-1] in FSSPEC_NAMES
            if (
                fsspec_call
                or name.rsplit(".", 1)[-1] in BUILDERS
                or name.startswith(CLIENT_PACKAGES)
            ):
                found.append(f"{node.lineno}: {name}(...)")
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith(CLIENT_PACKAGES)]
            found += [f"{node.lineno}: import {name}" for name in names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(CLIENT_PACKAGES):
            found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsspec"):
            names = sorted({a.name for a in node.names} & FSSPEC_NAMES)
            found += [f"{node.lineno}: from {node.module} import {name}" for name in names]
    return found


def test_no_module_but_s3config_builds_an_s3_filesystem():
    offenders = {}
    for folder in ("tasks", "flows", "model"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == REPO / "tasks" / "framework" / "s3config.py":
                continue
            found = _builds_a_filesystem(ast.parse(path.read_text(encoding="utf-8")))
            if found:
                offenders[str(path.relative_to(REPO))] = found
    assert offenders == {}, "use s3config.filesystem(url) instead"


def test_the_scan_finds_each_way_of_building_one():
    source = (
        "import fsspec\nimport boto3\nfrom s3fs import S3FileSystem\n"
        "from fsspec.core import url_to_fs\nfsspec.core.url_to_fs(u)\nfsspec.open(u)\n"
        "fsspec.filesystem('s3')\nS3FileSystem()\nfs.open(p)\nPath(p).open()\n"
        "s3config.filesystem(u)\nfrom fsspec import filesystem\n"
    )
    found = _builds_a_filesystem(ast.parse(source))
    assert sorted(found, key=lambda line: int(line.split(":")[0])) == [
        "2: import boto3",
        "3: from s3fs import ...",
        "4: from fsspec.core import url_to_fs",
        "5: fsspec.core.url_to_fs(...)",
        "6: fsspec.open(...)",
        "7: fsspec.filesystem(...)",
        "8: S3FileSystem(...)",
        "12: from fsspec import filesystem",
    ]  # fs.open, Path.open and s3config.filesystem build nothing of their own
