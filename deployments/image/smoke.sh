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
#   4. lists the step outputs and prints the pretrain output's lineage.
# The container is removed at the end (SMOKE_KEEP=1 keeps it and prints its name).
# Extra arguments after the image go to `llmflow run` (e.g. --set pretrain.stages.0.mixture...).
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
inside "$RUN_AS" sh -c 'cd /tmp/smoke/runs && for d in pretrain/*/; do
    echo "--- $d"; ls "$d"; llmflow lineage "$d"; done'
