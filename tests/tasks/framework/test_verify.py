"""`llmflow verify`: checksums recorded at commit, and every committed output checked against them."""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
from pathlib import Path

import pytest
from pydantic import BaseModel

from llmflow.flows.cli import main
from llmflow.tasks.framework.lineage import FILES_KEY, LINEAGE_FILE
from llmflow.tasks.framework.step import Metrics, step
from llmflow.tasks.framework.store import Store
from llmflow.tasks.framework.verify import verify_root


class Spec(BaseModel):
    size: int = 3000


@step("blob")
def blob(cfg: Spec, out: Path) -> Metrics:
    """A committed output with a top-level file and one in a sub-folder."""
    (out / "shards").mkdir()
    (out / "shards" / "part-0.bin").write_bytes(bytes(range(256)) * (cfg.size // 256 + 1))
    (out / "meta.json").write_text(json.dumps({"size": cfg.size}))
    return {"size": cfg.size}


def _commit(root, size: int = 3000) -> str:
    return blob.run(Store(root), Spec(size=size), "test").uri


def test_commit_records_each_file_size_and_sha256(tmp_path):
    uri = Path(_commit(tmp_path))
    files = json.loads((uri / LINEAGE_FILE).read_text())[FILES_KEY]
    assert sorted(files) == ["meta.json", "shards/part-0.bin"]  # not lineage.json, not _COMMITTED
    data = (uri / "shards" / "part-0.bin").read_bytes()
    assert files["shards/part-0.bin"] == {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def test_verify_reports_truncated_flipped_and_missing_files_with_path_and_reason(tmp_path, capsys):
    good, truncated, flipped, missing = (Path(_commit(tmp_path, n)) for n in (100, 200, 300, 400))
    legacy = Path(_commit(tmp_path, 500))
    record = json.loads((legacy / LINEAGE_FILE).read_text())
    del record[FILES_KEY]  # as committed before checksums existed
    (legacy / LINEAGE_FILE).write_text(json.dumps(record))
    (tmp_path / "blob" / ".partial").mkdir(exist_ok=True)  # never taken for an output

    shard = "shards/part-0.bin"
    size = (truncated / shard).stat().st_size
    with open(truncated / shard, "r+b") as f:
        f.truncate(size - 7)
    data = bytearray((flipped / shard).read_bytes())
    data[123] ^= 0x01
    (flipped / shard).write_bytes(bytes(data))
    (missing / "meta.json").unlink()

    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"{truncated}/{shard}: truncated: {size - 7} of {size} bytes" in out
    assert f"{flipped}/{shard}: content changed: sha256" in out
    assert f"{missing}/meta.json: missing (recorded" in out
    assert f"unchecked  {legacy}" in out
    assert f"ok         {good}" in out
    assert "5 committed outputs: 1 ok, 3 corrupt, 1 unchecked" in out

    (missing / "meta.json").write_text(json.dumps({"size": 400}))  # the same bytes again
    status = {c.uri: c.status for c in verify_root(str(tmp_path))}
    assert status[str(missing)] == "ok"


def test_verify_of_a_clean_root_exits_zero(tmp_path, capsys):
    _commit(tmp_path)
    assert main(["verify", str(tmp_path)]) == 0
    assert "1 committed outputs: 1 ok, 0 corrupt, 0 unchecked" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "nothing-here")]) == 0


@pytest.mark.integration
def test_verify_on_s3_finds_a_truncated_object(tmp_path, monkeypatch, capsys):
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA" + secrets.token_hex(8).upper())
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secrets.token_hex(12))
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("LLMFLOW_CACHE", str(tmp_path / "cache"))
        import boto3

        client = boto3.client("s3")
        client.create_bucket(Bucket="verify")
        root = "s3://verify/runs"
        good, bad = _commit(root, 100), _commit(root, 200)
        assert main(["verify", root]) == 0
        key = bad.removeprefix("s3://verify/") + "/shards/part-0.bin"
        body = client.get_object(Bucket="verify", Key=key)["Body"].read()
        client.put_object(Bucket="verify", Key=key, Body=body[:100])
        capsys.readouterr()
        assert main(["verify", root]) == 1
        out = capsys.readouterr().out
        assert f"{bad}/shards/part-0.bin: truncated: 100 of {len(body)} bytes" in out
        assert f"ok         {good}" in out
    finally:
        server.stop()
