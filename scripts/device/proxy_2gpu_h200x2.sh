#!/usr/bin/env bash
# One device run on a 2 x H200 machine (kind nvidia-h200-x2): the GPU tests (the
# real ragged_all_to_all exchange against its emulation, the grouped-GEMM backends), the EP2 MoE layer with and without
# per-rank dedup (benchmarks/bench_ep_dispatch.py, one process per GPU), then `maxtext-moe bench` of the two-GPU proxy
# with expert parallelism 2 (our block, TE) and with FSDP 2 (MaxText's block), one process per GPU (or one for both).
# Usage there: bash scripts/device/proxy_2gpu_h200x2.sh STEPS ["NAME PROCESSES RECIPE key=value ..." ...]
# DISPATCH_TESTS=0 skips the GPU tests; EP_BENCH_BACKENDS=" " skips the layer benchmark, EP_BUFFER_FACTORS lists
# the ragged_buffer_factor values it runs (default -1, the dropless worst case), EP_BENCH_IMPLS the exchanges
# (default all_to_all; nccl_ep needs the NCCL of scripts/device/nccl_ep_h200x2.sh).
# Logs and JSON: $OUT/results.tgz.
set -uo pipefail
steps=${1:-8}; shift || true
source scripts/device/common.sh
nvidia-smi topo -m >> "$W/gpu.txt" 2>&1
if [ "${DISPATCH_TESTS:-1}" != 0 ]; then
  timeout 200 python3 -m pytest tests/gpu tests/unit/test_upstream.py -q -rP -p no:cacheprovider \
    > "$W/dispatch_gpu.log" 2>&1
  echo "dispatch GPU tests rc=$?"; grep "JAX's transpose" "$W/dispatch_gpu.log"; tail -3 "$W/dispatch_gpu.log"; pack
fi
per_gpu() {  # processes (1: one process sees both GPUs; 2: one per GPU), log prefix, command; waits for all
  local procs=$1 log=$2 pids=() i rc=0 p; shift 2
  for ((i = 0; i < procs; i++)); do
    local dist=()
    [ "$procs" = 1 ] || dist=(JAX_COORDINATOR_ADDRESS=127.0.0.1:8476 JAX_NUM_PROCESSES="$procs" JAX_PROCESS_ID=$i
                             JAX_LOCAL_DEVICE_IDS=$i)
    env "${dist[@]}" PYTHONFAULTHANDLER=1 "$@" > "$log.p$i.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  return $rc
}
for backend in ${EP_BENCH_BACKENDS:-te}; do
  for factor in ${EP_BUFFER_FACTORS:--1}; do
    for impl in ${EP_BENCH_IMPLS:-all_to_all}; do
      name=ep_dispatch_${backend}_${impl}_f$factor
      per_gpu 2 "$W/$name" timeout -k 10 150 python3 benchmarks/bench_ep_dispatch.py --tokens-per-device 8192 \
        --experts 64 --backend "$backend" --impl "$impl" --buffer-factor "$factor" --out "$W/$name.json"
      echo "EP dispatch bench ($backend, $impl, ragged_buffer_factor $factor) rc=$?"
      grep -v "Warning\|^ *$" "$W/$name.p0.log" | tail -6; pack
    done
  done
done
bench() {  # name, processes, recipe [overrides]; process 0 reports
  local name=$1 procs=$2 t0=$SECONDS rc=0 f; shift 2
  per_gpu "$procs" "$W/$name" timeout -k 10 "${RUNG_TIMEOUT:-240}" python3 -m maxtext_moe bench "$@" \
    --steps "$steps" --warmup 3 --out "$W/$name.json" base_output_directory="/tmp/runs/$name" || rc=$?
  for f in /tmp/runs/"$name"/*/maxtext*.log; do [ -f "$f" ] && tail -300 "$f" > "$W/$name.$(basename "$f")"; done
  echo "=== $name ($procs process(es), $((SECONDS - t0)) s wall): $* rc=$rc"
  grep -E "^(step time|predicted|tokens/s|model TFLOPS|MFU|peak device|loss) " "$W/$name.p0.log" \
    || grep -v "warn" "$W/$name.p0.log" | tail -8
  pack  # after every run: a call stopped at its time limit still brings back what finished
}
if [ $# -eq 0 ]; then
  # What is left to learn at EP2 (docs/PERFORMANCE.md): the best layout against upstream in one call, and
  # where the idle time goes (per-GPU busy time of a profile).
  set -- "ep2_ours_te_batch4 2 deepseek3-proxy-h200-2gpu per_device_batch_size=4" \
         "fsdp2_maxtext_batch4 2 deepseek3-proxy-h200-2gpu-fsdp per_device_batch_size=4" \
         "ep2_ours_te_profile 2 deepseek3-proxy-h200-2gpu per_device_batch_size=4 --profile"
fi
for spec in "$@"; do
  # shellcheck disable=SC2086  # a spec is a name, a process count, a recipe, then space-separated overrides
  bench $spec
done
