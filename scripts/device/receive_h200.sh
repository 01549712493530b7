#!/usr/bin/env bash
# One device call on an H200: the GPU tests of the MoE layer and the expert-parallel receive side, then
# benchmarks/bench_receive.py at one EP8 rank's receive side of the 671B recipes (tokens each rank sends: 16384
# for batch 4 x 4096, 24576 for batch 6), BF16 and FP8 (current scaling) through TE. A failure is logged and the
# rest goes on. Logs and JSON: $OUT/results.tgz; the last lines are one table per run.
# Usage there: bash scripts/device/receive_h200.sh [TOKENS ...]   (RECEIVE_GPU_TESTS=0 skips the tests;
# RECEIVE_FP8 names the FP8 modes, default "none current_scaling"; RECEIVE_TIMEOUT limits each benchmark run,
# default 200 s: each variant compiles for about 70 s at 4096 tokens, so give two token counts 400)
set -uo pipefail
source scripts/device/common.sh
[ "${RECEIVE_GPU_TESTS:-1}" = 0 ] ||
  timeout 240 python3 -m pytest tests/gpu/test_moe_gpu.py -m gpu -q -rs -p no:cacheprovider > "$W/gpu_tests.log" 2>&1
tail -3 "$W/gpu_tests.log" 2>/dev/null
tokens=("$@"); [ ${#tokens[@]} -gt 0 ] || tokens=(16384 24576)
for fp8 in ${RECEIVE_FP8:-none current_scaling}; do
  (cd benchmarks && timeout -k 10 "${RECEIVE_TIMEOUT:-200}" python3 bench_receive.py --tokens "${tokens[@]}" \
    --backend te --fp8 "$fp8" --out "$W/receive_$fp8.json") > "$W/receive_$fp8.log" 2>&1
  echo "fp8=$fp8 rc=$?"; grep -A9 "^variant" "$W/receive_$fp8.log"
  pack
done
