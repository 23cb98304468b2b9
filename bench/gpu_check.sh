#!/usr/bin/env bash
# The GPU check (docs/gpu.md): one prepared run on a machine with a CUDA device, about 5 minutes
# on one H200. It runs the CUDA tests (tests/test_cuda.py, tests/test_fused_dist.py), then the
# optimizer step alone on a ~1B-parameter model against torch.optim.AdamW(fused=True) and
# (foreach=True), and ShardedCAME against came_pytorch, and writes the JSON the docs page is
# rendered from (bench/render_docs.py).
#
#     bash bench/gpu_check.sh OUT_DIR          # writes OUT_DIR/gpu_check.json, tests' XML and logs
#
# Uses the machine's python3 (PYTHON to change it), which must hold torch with CUDA, pytest,
# lark, attrs, numpy, scipy and came_pytorch. Exits non-zero if a test failed.
set -uo pipefail
out=${1:-gpu_check}
python=${PYTHON:-python3}
mkdir -p "$out"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
PYTHONUNBUFFERED=1 timeout 240 "$python" -m pytest -q -p no:cacheprovider -o addopts="" -rs \
    tests/test_cuda.py tests/test_fused_dist.py --junitxml "$out/cuda_tests.xml" 2>&1 | tail -60 | tee "$out/cuda_tests.log"
tests=${PIPESTATUS[0]}
PYTHONUNBUFFERED=1 timeout 240 "$python" bench/bench_gpu.py --tests "$out/cuda_tests.xml" \
    --json "$out/gpu_check.json" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, bench exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
