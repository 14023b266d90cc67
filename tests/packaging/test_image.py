"""The CPU image, built for real (deployments/image/build.sh) and run (smoke.sh), without a daemon.

Marked ``image``: run by neither CI job (it builds for minutes and needs buildah, podman and
mmdebstrap on the host): ``pytest -m image tests/packaging/test_image.py``. The build reuses
buildah's layer cache, so a second run only rebuilds what changed. ``LLMFLOW_IMAGE=TAG`` tests an
image already built instead of building one.

The references: the host's own code computes the addresses the quickstart's steps must have (the
image's run is checked with the host's ``all_cached``, so the image ran the same recipe with the
same presets), the Dockerfile's extras (tests/packaging/test_dockerfile.py), the distro's own
CA certificates, and the host's pip settings and secrets, which must not be found in the image.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "deployments" / "image" / "build.sh"
SMOKE = REPO / "deployments" / "image" / "smoke.sh"
TAG = "localhost/llmflow:cpu"
# The quickstart's pretraining shrunk to a few steps per stage (the full preset takes ~40 min on 2
# shared cores); every other step runs as packaged.
SHRINK = [
    "pretrain.stages.0.mixture.num_tokens=16384",
    "pretrain.stages.1.mixture.num_tokens=8192",
    "pretrain.stages.2.mixture.num_tokens=8192",
    "pretrain.train.schedule.warmup_steps=2",
]
CANARY = "llmflow-image-test-canary-secret"  # an AWS secret in the build's environment
PY = "usr/local/lib/python3.11/dist-packages"  # where Debian's pip installs as root

pytestmark = [
    pytest.mark.image,
    pytest.mark.timeout(7200),  # the first build (the module's fixture) takes many minutes
    pytest.mark.skipif(
        not all(shutil.which(t) for t in ("buildah", "podman")),
        reason="needs buildah and podman (apt-get install buildah podman mmdebstrap)",
    ),
]


def sh(*argv: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def image() -> str:
    """The image's tag, built now (buildah's layer cache reused) unless LLMFLOW_IMAGE names one."""
    if os.environ.get("LLMFLOW_IMAGE"):
        return os.environ["LLMFLOW_IMAGE"]
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY=CANARY, AWS_ACCESS_KEY_ID=CANARY + "-id")
    out = sh(str(BUILD), "--base-from-debian", "--tag", TAG, timeout=3600, env=env, cwd=REPO)
    for line in (out.stderr + out.stdout).splitlines():  # the commands and their times (-s)
        if line.startswith(("== ", "+ ", "image:", "build.sh:", "base:")):
            print(line)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return TAG


@pytest.fixture(scope="module")
def smoke(image):
    """(output, the kept container's root file system) of smoke.sh."""
    overrides = [a for o in SHRINK for a in ("--set", o)]
    out = sh(str(SMOKE), image, *overrides, timeout=3600, env=dict(os.environ, SMOKE_KEEP="1"))
    print(out.stdout[-6000:])
    kept = re.search(r"container kept: (\S+)", out.stderr)
    assert kept, out.stderr[-3000:]
    container = kept.group(1)
    try:
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        mount = sh("buildah", "mount", container)
        assert mount.returncode == 0, mount.stderr
        yield out.stdout, Path(mount.stdout.strip())
    finally:
        sh("buildah", "umount", container)
        sh("buildah", "rm", container)


@pytest.fixture(scope="module")
def rootfs(image):
    """The image's file system, as built (a fresh working container, mounted read-only here)."""
    container = sh("buildah", "from", "--pull-never", image).stdout.strip()
    try:
        yield Path(sh("buildah", "mount", container).stdout.strip())
    finally:
        sh("buildah", "umount", container)
        sh("buildah", "rm", container)


@pytest.fixture(scope="module")
def inspected(image) -> dict:
    out = sh("buildah", "inspect", "--type", "image", image)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def inside(image: str, *argv: str) -> subprocess.CompletedProcess:
    """A command in a fresh container of the image (removed after)."""
    container = sh("buildah", "from", "--pull-never", image).stdout.strip()
    try:
        return sh("buildah", "run", "--isolation", "chroot", container, "--", *argv)
    finally:
        sh("buildah", "rm", container)


# --- the smoke run ------------------------------------------------------------------------------


def test_the_quickstart_runs_until_pretrain_with_the_packaged_presets(smoke):
    from llmflow.flows.recipe import recipe
    from llmflow.tasks.config import load_config
    from llmflow.tasks.framework.executor import all_cached

    output, root = smoke
    assert "usage: llmflow" in output and "(exit 0)" in output
    assert "== llmflow run --until pretrain (packaged quickstart)" in output
    runs = root / "tmp" / "smoke" / "runs"
    # The host's code computes every address of the quickstart until pretrain; the image's run
    # must have committed each one: the same recipe, the same presets, the same step code.
    graph = recipe(load_config(None, ["until=pretrain", *SHRINK])).until("pretrain")
    outcome = all_cached(graph, str(runs))
    assert outcome is not None, sorted(p.name for p in runs.glob("*/*"))
    pretrained = sorted((runs / "pretrain").glob("quickstart-stage*"))
    assert [p.name.rsplit("-", 1)[0] for p in pretrained] == [
        "quickstart-stage1", "quickstart-stage2", "quickstart-stage3"
    ]  # fmt: skip
    for folder in pretrained:
        assert (folder / "_COMMITTED").exists()
        metrics = json.loads((folder / "lineage.json").read_text())["metrics"]
        assert metrics, folder


def test_the_image_ships_the_repositorys_presets(rootfs):
    packaged = rootfs / PY / "llmflow" / "configs" / "quickstart.yaml"
    assert packaged.read_bytes() == (REPO / "configs" / "quickstart.yaml").read_bytes()
    for name in ("flows/deploy.py", "deployments/prefect.yaml", "configs/smollm3-1.7b.yaml"):
        assert (rootfs / "opt" / "llmflow" / name).read_bytes() == (REPO / name).read_bytes()


def test_pip_check_is_clean(image):
    out = inside(image, "pip", "check")
    assert out.returncode == 0 and "No broken requirements found" in out.stdout, out.stdout


def test_the_image_holds_every_extra_the_dockerfile_names(image):
    from tests.packaging.test_dockerfile import image_extras

    extras = ",".join(sorted(image_extras()))
    # no index: pip can only say that every requirement of llmflow[extras] is already installed
    out = inside(image, "pip", "install", "--no-index", "--dry-run", f"llmflow[{extras}]")
    assert out.returncode == 0 and "Would install" not in out.stdout, out.stdout + out.stderr


def test_the_image_size_and_its_torch_is_a_cpu_build(image, rootfs):
    size = int(sh("podman", "image", "inspect", "--format", "{{.Size}}", image).stdout)
    print(f"image {image}: {size} bytes ({size / 2**30:.2f} GiB)")
    torch = [p.name for p in (rootfs / PY).glob("torch-*.dist-info")]
    assert len(torch) == 1 and "+cpu" in torch[0], torch
    assert not list((rootfs / PY).glob("nvidia_*")), "a CUDA library came with a dependency"
    assert size < 6 * 2**30, f"{size / 2**30:.2f} GiB: something heavy entered the image"


# --- nothing of the host in it -------------------------------------------------------------------

HOST_PATHS = ("/run/llmflow-build", "/opt/pypi", "/opt/wheels", "/etc/xdg/pip", "llmflow-image.")


def host_secrets() -> list[str]:
    """The canary and the AWS_* values of the host (those long enough to mean something)."""
    found = [v for k, v in os.environ.items() if k.startswith("AWS_") and len(v) >= 8]
    return [CANARY, *found]


def test_no_secret_or_host_path_in_the_config_or_history(inspected):
    config = inspected["OCIv1"]["config"]
    names = [e.split("=", 1)[0] for e in config.get("Env", [])]
    assert not [n for n in names if n.startswith(("AWS_", "PIP_CERT", "PIP_INDEX", "PIP_EXTRA"))]
    assert not [n for n in names if n in ("PIP_FIND_LINKS", "PIP_TRUSTED_HOST", "PIP_CONFIG_FILE")]
    text = json.dumps(inspected)
    for value in (*host_secrets(), *HOST_PATHS, str(REPO)):
        assert value not in text, value
    history = " ".join(h.get("created_by", "") for h in inspected["OCIv1"].get("history", []))
    assert "--mount" not in history and "pip.conf" not in history


def test_no_pip_config_or_host_ca_bundle_in_the_file_system(image, rootfs, inspected):
    for path in ("etc/pip.conf", "etc/xdg/pip", "root/.config/pip", "root/.pip", "root/.cache/pip"):
        assert not (rootfs / path).exists(), path
    leftover = rootfs / "run" / "llmflow-build"
    assert not leftover.exists() or not any(leftover.rglob("*.*")), list(leftover.rglob("*"))
    # pip's settings in the image are the Dockerfile's own ENV (PIP_NO_CACHE_DIR, ...), nothing more
    env = [e.split("=", 1) for e in inspected["OCIv1"]["config"].get("Env", [])]
    own = {f":env:.{k[4:].lower().replace('_', '-')}='{v}'" for k, v in env if k.startswith("PIP_")}
    out = inside(image, "pip", "config", "list")
    assert out.returncode == 0 and set(out.stdout.split()) <= own, out.stdout
    # The bundle is the distro's: each certificate in it is one of /usr/share/ca-certificates.
    pem = re.compile(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", re.S)
    distro = {
        c for f in (rootfs / "usr/share/ca-certificates").rglob("*.crt") for c in pem.findall(
            f.read_text(errors="replace"))
    }  # fmt: skip
    bundle = pem.findall((rootfs / "etc/ssl/certs/ca-certificates.crt").read_text())
    assert bundle and set(bundle) <= distro, len(set(bundle) - distro)
    assert not [p for p in (rootfs / "usr/local/share/ca-certificates").rglob("*") if p.is_file()]
    # No copy of the host's bundle anywhere, unless it is byte for byte the distro's own.
    host = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
    if host.is_file():
        digest = hashlib.sha256(host.read_bytes()).hexdigest()
        own = hashlib.sha256((rootfs / "etc/ssl/certs/ca-certificates.crt").read_bytes())
        if digest != own.hexdigest():
            size = host.stat().st_size
            same = [
                p for p in rootfs.rglob("*") if p.is_file() and not p.is_symlink()
                and p.stat().st_size == size
                and hashlib.sha256(p.read_bytes()).hexdigest() == digest
            ]  # fmt: skip
            assert not same, same


def test_no_secret_or_host_path_in_the_installed_files(rootfs):
    """The places a build could leave them: /etc, /root, /opt/llmflow, pip's install records."""
    files = [*(rootfs / "etc").rglob("*"), *(rootfs / "root").rglob("*")]
    files += [*(rootfs / "opt" / "llmflow").rglob("*"), *(rootfs / PY).glob("*.dist-info/*")]
    leaks = []
    for path in files:
        if path.is_relative_to(rootfs / "opt" / "llmflow"):
            if (REPO / path.relative_to(rootfs / "opt" / "llmflow")).exists():
                continue  # copied from the build context (build.sh names the mounts it makes)
        if path.is_file() and not path.is_symlink() and path.stat().st_size < 2**22:
            text = path.read_bytes().decode("utf-8", "replace")
            leaks += [(str(path), v) for v in (*host_secrets(), *HOST_PATHS) if v in text]
    assert not leaks, leaks[:10]
