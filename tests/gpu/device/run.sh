#!/usr/bin/env bash
# Run THERE, on a lent GPU, from the repository root (the device tool's working copy), with .whl/
# carried (fetch.sh made it): install the wheels and llmflow without dependencies, then the GPU
# suite and the MFU benchmark (causal rows, then packed documents); logs go to $OUT.
# Budget: one call of under 10 minutes (GPU_TEST_S + MFU_S + install).
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl 2>&1 | tail -3
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/llmflow   # the repository root is the package
export PYTHONPATH=/tmp/site:/tmp/pkg
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, torch.cuda.get_device_name())"
T0=$(date +%s)
timeout "${GPU_TEST_S:-300}" python3 -m pytest -m gpu -p no:cacheprovider -q -rA --durations=15 \
  tests/gpu -o addopts="" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
echo "pytest -m gpu: $(( $(date +%s) - T0 )) s"
T1=$(date +%s)
timeout "${MFU_S:-200}" python3 benchmarks/bench_mfu.py --rounds "${MFU_ROUNDS:-3}" --steps 5 \
  --warmup 2 2>&1 | tee "$OUT/bench_mfu.log" | tail -8
if python3 benchmarks/bench_mfu.py --help 2>/dev/null | grep -q -- --packed; then
  timeout "${MFU_S:-200}" python3 benchmarks/bench_mfu.py --rounds "${MFU_ROUNDS:-3}" --steps 5 \
    --warmup 2 --packed "${PACKED_DOC_LEN:-512}" 2>&1 | tee "$OUT/bench_mfu_packed.log" | tail -8
fi
echo "bench_mfu: $(( $(date +%s) - T1 )) s"
