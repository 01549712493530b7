#!/usr/bin/env bash
# One device call: the carried cuDNN (scripts/device/build_cudnn_carry.sh; the earlier calls of its header carried
# the other parts) against the image's 9.19 on one H200. First benchmarks/bench_attention.py at the proxy's
# attention shape under each library, twice in turn; then `maxtext-moe bench` rungs of
# scripts/device/proxy_ladder_h200.sh, each under the library its first word names. Logs and JSON: $OUT/results.tgz.
# Usage there: bash scripts/device/cudnn_compare_h200.sh STEPS ["carried|image NAME [RECIPE] key=value ..." ...]
#   ATTENTION_BATCH (default 6, the one-GPU recipe's) sets the attention benchmark's batch.
set -uo pipefail
steps=$1; shift
source scripts/device/common.sh
# shellcheck source=scripts/device/use_carried_cudnn.sh
source scripts/device/use_carried_cudnn.sh || exit 1
n=0
for lib in image carried image carried; do
  n=$((n + 1))
  cudnn_use "$lib" || exit 1
  python3 benchmarks/bench_attention.py --batch "${ATTENTION_BATCH:-6}" --label "cuDNN $lib" \
    --out "$W/attention_${lib}_$n.json" > "$W/attention_${lib}_$n.log" 2>&1
  tail -1 "$W/attention_${lib}_$n.log" | tee -a "$W/attention.txt"
done
pack
for spec in "$@"; do
  cudnn_use "${spec%% *}" || exit 1
  bash scripts/device/proxy_ladder_h200.sh "$steps" "${spec#* }"
done
pack
