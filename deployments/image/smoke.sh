#!/usr/bin/env bash
# A smoke run inside a built llmflow image, with no checkout mounted and no daemon:
#
#   deployments/image/smoke.sh [IMAGE]        # default localhost/llmflow:cpu (build.sh's tag)
#
# In a fresh working container (`buildah from`), run with chroot isolation (`podman run` needs
# setrlimit, which unprivileged hosts refuse), as the image's user (its USER; root when it
# declares none), it runs:
#   1. `llmflow --help`, also as an unprivileged uid (65534), which must be able to import it;
#   2. `pip check`: the installed distributions' requirements are met;
#   3. `llmflow run --until pretrain` with no config, in an empty folder: the quickstart preset
#      as the image ships it (the package data, not /opt/llmflow or a checkout);
#   4. lists the committed step outputs, and the files and metrics of each pretrain output.
# The container is removed at the end (SMOKE_KEEP=1 keeps it and prints its name).
# Extra arguments after the image go to `llmflow run`. The full quickstart pretraining (550k
# tokens, ~270 steps) ran at 120-230 tok/s in the image on 2 CPU cores shared with other jobs:
# an hour; tests/packaging/test_image.py shrinks the three stages' num_tokens with
#   --set pretrain.stages.0.mixture.num_tokens=16384 (1 and 2: 8192) and warmup_steps=2.
set -euo pipefail

IMAGE="${1:-localhost/llmflow:cpu}"
shift || true
command -v buildah >/dev/null || { echo "smoke.sh: buildah is not installed" >&2; exit 1; }

CTR=$(buildah from --pull-never "$IMAGE")
if [ "${SMOKE_KEEP:-0}" = 1 ]; then
    trap 'echo "container kept: $CTR" >&2' EXIT
else
    trap 'buildah rm "$CTR" >/dev/null' EXIT
fi
USER_OF_IMAGE=$(buildah inspect --type image --format '{{.OCIv1.Config.User}}' "$IMAGE")
RUN_AS="${USER_OF_IMAGE:-0:0}"

timed() {  # timed LABEL CMD...
    local label="$1" start rc=0
    shift
    start=$(date +%s)
    "$@" || rc=$?
    echo "== ${label}: $(($(date +%s) - start)) s (exit ${rc})"
    return "$rc"
}
inside() {  # inside USER CMD...: a command in the container, host environment left outside
    local user="$1"
    shift
    buildah run --isolation chroot --user "$user" "$CTR" -- "$@"
}

echo "image: ${IMAGE} (user: ${USER_OF_IMAGE:-root, none declared})"
timed "llmflow --help" inside "$RUN_AS" llmflow --help
timed "llmflow --help as uid 65534" inside 65534:65534 sh -c 'llmflow --help > /dev/null'
timed "pip check" inside "$RUN_AS" pip check
# An empty folder, so the run can only find the preset packaged with llmflow.
inside "$RUN_AS" sh -c 'rm -rf /tmp/smoke && mkdir -p /tmp/smoke'
timed "llmflow run --until pretrain (packaged quickstart)" inside "$RUN_AS" sh -c \
    'cd /tmp/smoke && ls -A && exec llmflow run --until pretrain "$@"' sh "$@"
inside "$RUN_AS" sh -c 'cd /tmp/smoke/runs && for d in */*/; do
    case "$d" in .*) continue ;; esac
    [ -e "$d/_COMMITTED" ] && echo "committed: $d"; done'
inside "$RUN_AS" python -c '
import json, pathlib
for d in sorted(pathlib.Path("/tmp/smoke/runs/pretrain").glob("[!.]*")):
    print("---", d, sorted(p.name for p in d.iterdir()))
    print("   ", json.loads((d / "lineage.json").read_text()).get("metrics"))'
