#!/usr/bin/env bash
# One device call: benchmarks/bench_dense_fp8.py (each dense projection of the proxy in BF16 and in TE's FP8,
# forward and backward, checked against float32), then any `maxtext-moe bench` rungs of
# scripts/device/proxy_ladder_h200.sh. Logs and JSON: $OUT/results.tgz.
# Usage there: bash scripts/device/dense_fp8_h200.sh STEPS ["NAME [RECIPE] key=value ..." ...]
#   TOKENS (default 32768: the FP8 recipe's batch 8 x 4096) sets the rows of every GEMM.
set -uo pipefail
steps=$1; shift
source scripts/device/common.sh
timeout -k 10 "${DENSE_TIMEOUT:-240}" python3 benchmarks/bench_dense_fp8.py --tokens "${TOKENS:-32768}" \
  --out "$W/dense_fp8.json" > "$W/dense_fp8.log" 2>&1
echo "bench_dense_fp8 rc=$?"; cat "$W/dense_fp8.log"
pack
[ $# -eq 0 ] || bash scripts/device/proxy_ladder_h200.sh "$steps" "$@"
pack
