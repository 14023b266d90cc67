#!/usr/bin/env bash
# Run HERE (with the package registry), before a device is lent: download the wheels the device's
# image lacks (Python 3.12; it has torch, transformers, numpy, safetensors, fsspec, tqdm and no
# registry) into .whl/ at the repository root, which git ignores and `run` carries.
#   bash tests/gpu/device/fetch.sh        then: run(command="bash tests/gpu/device/run.sh",
#                                                 carry=[".whl"], timeout_s=590)
set -euo pipefail
ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$ROOT"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
PLATFORMS=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  PLATFORMS="$PLATFORMS --platform $p"
done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLATFORMS -d .whl -r tests/gpu/device/wheels.txt
echo "$(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (carry limit 64 MiB)"
