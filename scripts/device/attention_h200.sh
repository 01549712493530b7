#!/usr/bin/env bash
# One device call: every attention kernel of benchmarks/bench_attention.py at MLA's shape (192-wide queries and
# keys, 128-wide values, 128 heads), causal, forward and backward, at 4K (the recipe's batch 6) and 8K (batch 3),
# each checked against the float32 reference; then any `maxtext-moe bench` rungs of
# scripts/device/proxy_ladder_h200.sh. A kernel that fails logs why and the others go on. Logs and JSON:
# $OUT/results.tgz; the last lines are one table.
# Usage there: bash scripts/device/attention_h200.sh STEPS ["NAME [RECIPE] key=value ..." ...]
#   KERNELS (default "cudnn fa3 tokamax_mosaic tokamax_triton te") and SHAPES ("4096:6 8192:3") choose the runs;
#   fa3 needs .device/fa3/fa3_h200.tar.xz (scripts/device/build_fa3_carry.sh), which common.sh unpacks.
set -uo pipefail
steps=$1; shift
source scripts/device/common.sh
for shape in ${SHAPES:-4096:6 8192:3}; do
  for kernel in ${KERNELS:-cudnn fa3 tokamax_mosaic tokamax_triton te}; do
    name=attention_${kernel}_s${shape%:*}
    NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 timeout -k 10 "${ATTENTION_TIMEOUT:-150}" \
      python3 benchmarks/bench_attention.py --implementation "$kernel" --seq "${shape%:*}" --batch "${shape#*:}" \
      --label "$kernel" --out "$W/$name.json" > "$W/$name.log" 2>&1
    echo "s=${shape%:*} b=${shape#*:} rc=$? $(tail -1 "$W/$name.log")" | tee -a "$W/attention.txt"
  done
  pack
done
[ $# -eq 0 ] || bash scripts/device/proxy_ladder_h200.sh "$steps" "$@"
pack
cat "$W/attention.txt"
