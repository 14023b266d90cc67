#!/usr/bin/env bash
# Builds the Dockerfile's CPU target (or another target) with Docker when a daemon answers, and
# with buildah (chroot isolation, no daemon, no privileges beyond root's) otherwise.
#
#   deployments/image/build.sh [--base-from-debian] [--tag TAG] [--target cpu] [-- BUILD ARGS...]
#
# --base-from-debian: no registry reachable for `python:3.11-slim`: make a stand-in for it from
#   Debian's packages (mmdebstrap, bookworm's Python 3.11), stored locally as
#   localhost/llmflow-base:python3.11-slim-debian and tagged docker.io/library/python:3.11-slim so
#   the Dockerfile's FROM resolves to it unchanged (reused on the next build; --rebuild-base
#   makes it again).
#
# With buildah, the host's pip settings (`pip config list`: index and extra-index URLs, trusted
# hosts, find-links, constraints; PIP_* environment variables included) and its CA bundle reach
# every RUN as read-only bind mounts (`--volume`): /etc/pip.conf and files under
# /run/llmflow-build. They are not layers: nothing of them stays in the image (tests/packaging/
# test_image.py checks). Local folders named by the pip settings (file:// indexes, find-links) are
# mounted too, so a host with a local wheel mirror builds from it.
# If the CPU torch index (TORCH_INDEX_CPU) cannot be reached and a find-links folder holds a CPU
# torch wheel for the image's Python, TORCH_SPEC is pinned to that wheel's version (a
# `torch==X+cpu` pin can only be met by a CPU build, so pip never falls back to a CUDA torch).
# With Docker, the pip settings are not forwarded (Docker has no build-time bind mount of host
# folders): Docker hosts build from the public indexes.
#
# Each command is timed; the last lines give the image and its size.
set -euo pipefail
cd "$(dirname "$0")/../.."

TAG=localhost/llmflow:cpu
TARGET=cpu
BASE_FROM_DEBIAN=0
REBUILD_BASE=0
PYTHON_VERSION=3.11
BASE_LOCAL=localhost/llmflow-base:python${PYTHON_VERSION}-slim-debian
BASE_ALIAS=docker.io/library/python:${PYTHON_VERSION}-slim
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --base-from-debian) BASE_FROM_DEBIAN=1 ;;
        --rebuild-base) REBUILD_BASE=1 ;;
        --tag) TAG="$2"; shift ;;
        --target) TARGET="$2"; shift ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

timed() {  # timed LABEL CMD...: runs CMD, prints how long it took
    local label="$1" start rc=0
    shift
    start=$(date +%s)
    echo "+ $*" >&2
    "$@" || rc=$?
    echo "== ${label}: $(($(date +%s) - start)) s (exit ${rc})" >&2
    return "$rc"
}

if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    BUILDER=docker
elif command -v buildah >/dev/null; then
    BUILDER=buildah
else
    echo "build.sh: no Docker daemon answers and buildah is not installed" \
        "(apt-get install buildah podman mmdebstrap)" >&2
    exit 1
fi
echo "builder: ${BUILDER}" >&2
if [ "$TARGET" = gpu ] && [ "$BASE_FROM_DEBIAN" = 1 ]; then
    echo "build.sh: --base-from-debian stands in for python:slim only; the gpu target needs" \
        "its CUDA base (CUDA_BASE)" >&2
    exit 2
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/llmflow-image.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# --- the stand-in base ----------------------------------------------------------------------
if [ "$BASE_FROM_DEBIAN" = 1 ]; then
    if [ "$REBUILD_BASE" = 0 ] && buildah inspect --type image "$BASE_LOCAL" >/dev/null 2>&1; then
        echo "base: reusing ${BASE_LOCAL} (--rebuild-base makes it again)" >&2
    else
        # python:3.11-slim has no PEP 668 marker, a `python` command and pip on PATH: remove
        # Debian's EXTERNALLY-MANAGED marker, add python-is-python3 and python3-pip. No docs or
        # man pages (as in the slim images); apt's lists are cleaned by mmdebstrap itself.
        timed "mmdebstrap (bookworm minbase + python3)" mmdebstrap --variant=minbase \
            --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
            --dpkgopt='path-exclude=/usr/share/locale/*' \
            --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
            bookworm "$WORK/rootfs.tar"
        timed "podman import (rootfs -> ${BASE_LOCAL})" podman import \
            --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
            "$WORK/rootfs.tar" "$BASE_LOCAL" >/dev/null
        rm -f "$WORK/rootfs.tar"
    fi
    timed "tag base as ${BASE_ALIAS}" buildah tag "$BASE_LOCAL" "$BASE_ALIAS"
fi

BUILD_ARGS=(--build-arg "PYTHON_VERSION=${PYTHON_VERSION}")

if [ "$BUILDER" = docker ]; then
    timed "docker build --target ${TARGET}" docker build --target "$TARGET" -t "$TAG" \
        "${BUILD_ARGS[@]}" "${EXTRA[@]}" .
    docker image inspect --format 'image: {{.Id}} size: {{.Size}} bytes' "$TAG"
    exit 0
fi

# --- the host's pip settings and CA bundle, as build-time mounts -----------------------------
MOUNT=/run/llmflow-build
mkdir -p "$WORK/mount"
PIP_HOST=(python3 -m pip)
"${PIP_HOST[@]}" --version >/dev/null 2>&1 || PIP_HOST=(pip)
# One [global] section from the effective settings (files and PIP_* variables); local paths are
# mapped to mounts. Prints the volumes to add, one per line, and a torch wheel found in find-links.
"${PIP_HOST[@]}" config list 2>/dev/null > "$WORK/pip-config.txt" || true
python3 - "$WORK/pip-config.txt" "$WORK/mount" "$MOUNT" > "$WORK/volumes.txt" <<'PY'
import ast, os, re, shutil, sys
from pathlib import Path

listing, out, mount = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
settings = {}
for line in listing.read_text().splitlines():  # "global.key='value'" or ":env:.key='value'"
    m = re.match(r"^(.*?)\.([\w-]+)=(.*)$", line)
    if m and m.group(1) in ("global", "install", "wheel", "download", ":env:"):
        key = m.group(2).replace("_", "-")
        # environment variables override the files, as in pip itself
        if m.group(1) == ":env:" or key not in settings:
            settings[key] = ast.literal_eval(m.group(3))
ca = settings.pop("cert", None) or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get(
    "SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
volumes, folders = [], {}

def local(token: str, index: bool = False) -> str:
    """A file:// URL or an absolute path on the host, mapped to a read-only mount.

    A local index (``.../simple``) is mounted with its parent: its pages link to ``../../files``.
    """
    path = token[len("file://"):] if token.startswith("file://") else token
    if not path.startswith("/") or not os.path.exists(path):
        return token
    path = os.path.normpath(path)
    folder, name = (os.path.dirname(path), os.path.basename(path)) if index else (path, "")
    target = folders.get(folder)
    if target is None:
        target = folders[folder] = f"{mount}/local{len(folders)}"
        volumes.append(f"{folder}:{target}:ro")
    target = f"{target}/{name}" if name else target
    return ("file://" + target) if token.startswith("file://") else target

lines = ["[global]"]
for key, value in sorted(settings.items()):
    if key in ("index-url", "extra-index-url", "find-links", "constraint", "requirement"):
        index = key.endswith("index-url")
        value = " ".join(local(t, index) for t in value.split())
    lines.append(f"{key} = {value}")
if os.path.isfile(ca):
    shutil.copyfile(ca, out / "ca.crt")
    lines.append(f"cert = {mount}/ca.crt")
(out / "pip.conf").write_text("\n".join(lines) + "\n")
if os.path.isfile(ca):
    print(f"{out / 'ca.crt'}:{mount}/ca.crt:ro")
print(f"{out / 'pip.conf'}:/etc/pip.conf:ro")
print("\n".join(volumes))
# a CPU torch wheel the find-links offer, for when the CPU torch index is out of reach
for path in folders:
    if os.path.isdir(path):
        for f in sorted(os.listdir(path)):
            if re.match(r"torch-[\d.]+\+cpu-cp311-", f):
                (out.parent / "torch.txt").write_text(f.split("-")[1] + "\n")
PY
mapfile -t VOLUMES < <(grep -v '^$' "$WORK/volumes.txt")
echo "pip settings forwarded (mounted at build time only):" >&2
sed 's/^/    /' "$WORK/mount/pip.conf" >&2
VOLUME_ARGS=()
for v in "${VOLUMES[@]}"; do VOLUME_ARGS+=(--volume "$v"); done

TORCH_INDEX_CPU=https://download.pytorch.org/whl/cpu
for a in "${EXTRA[@]}"; do
    case "$a" in TORCH_INDEX_CPU=*) TORCH_INDEX_CPU="${a#TORCH_INDEX_CPU=}" ;; esac
done
if [ "$TARGET" = cpu ] && ! printf '%s\n' "${EXTRA[@]}" | grep -q '^TORCH_SPEC=' \
    && ! curl -fsS -m 20 -o /dev/null "${TORCH_INDEX_CPU%/}/torch/" 2>/dev/null; then
    TORCH_VERSION=$(tail -1 "$WORK/torch.txt" 2>/dev/null || true)
    if [ -n "$TORCH_VERSION" ]; then
        echo "build.sh: ${TORCH_INDEX_CPU} is out of reach; pinning TORCH_SPEC=torch==${TORCH_VERSION}" \
            "(a CPU wheel in the host's find-links), TORCH_INDEX_CPU=https://pypi.org/simple" >&2
        # the pin alone keeps CUDA builds out; the index it is looked up in (besides the
        # forwarded find-links) is PyPI's, so pip does not retry the unreachable one per package
        BUILD_ARGS+=(--build-arg "TORCH_SPEC=torch==${TORCH_VERSION}"
            --build-arg "TORCH_INDEX_CPU=https://pypi.org/simple")
    else
        echo "build.sh: warning: ${TORCH_INDEX_CPU} is out of reach and no CPU torch wheel is in" \
            "the find-links; pip may fall back to a CUDA torch" >&2
    fi
fi

PULL=()
[ "$BASE_FROM_DEBIAN" = 1 ] && PULL=(--pull-never)
timed "buildah bud --target ${TARGET}" buildah bud --isolation chroot --layers \
    "${PULL[@]}" --target "$TARGET" -t "$TAG" "${VOLUME_ARGS[@]}" "${BUILD_ARGS[@]}" \
    "${EXTRA[@]}" .
# buildah leaves the mount points of --volume in the layers of the RUNs that had them: an empty
# /etc/pip.conf and empty files and folders under /run/llmflow-build. A last layer removes them,
# once they are checked to be empty (a file with content there would be a build's leftover).
CLEAN=$(buildah from --pull-never "$TAG")
ROOTFS=$(buildah mount "$CLEAN")
if [ -e "$ROOTFS/etc/pip.conf" ] && [ ! -s "$ROOTFS/etc/pip.conf" ]; then
    rm -f "$ROOTFS/etc/pip.conf"
fi
if [ -d "$ROOTFS$MOUNT" ]; then
    if [ -n "$(find "$ROOTFS$MOUNT" -mindepth 1 \( -type f -size +0 -o ! -type f ! -type d \) | head -1)" ] \
        || [ -n "$(find "$ROOTFS$MOUNT" -mindepth 2 | head -1)" ]; then
        echo "build.sh: ${MOUNT} in the image holds more than empty mount points" >&2
        buildah umount "$CLEAN" >/dev/null; buildah rm "$CLEAN" >/dev/null
        exit 1
    fi
    rm -rf "${ROOTFS:?}$MOUNT"
fi
buildah umount "$CLEAN" >/dev/null
buildah config --created-by "deployments/image/build.sh: remove the build's empty mount points" \
    "$CLEAN"
timed "buildah commit (mount points removed)" buildah commit --quiet --rm "$CLEAN" "$TAG" >/dev/null
SIZE=$(podman image inspect --format '{{.Size}}' "$TAG")
echo "image: ${TAG} size: ${SIZE} bytes ($((SIZE / 1024 / 1024)) MiB)"
