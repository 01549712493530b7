#!/usr/bin/env bash
# One device run on an H200: the GPU tests of our MoE layer, then the MoE layer benchmark
# against MaxText's block (MOE_GPU_TESTS=0 skips the tests). Arguments go to the benchmark.
# Logs and JSON: $OUT/results.tgz.
set -uo pipefail
source scripts/device/common.sh
[ "${MOE_GPU_TESTS:-1}" = 0 ] || timeout 150 python3 -m pytest tests/gpu/test_moe_gpu.py -q -p no:cacheprovider 2>&1 | tee "$W/pytest_gpu.log" | tail -15
python3 benchmarks/bench_moe_layer.py --out "$W/moe_layer_h200.json" "$@" 2>&1 | grep -v "Warning\|sow\|https://\|^ *$" | tee "$W/bench.log"
pack
