#!/usr/bin/env bash
# One device call on the lent 2 x H200 machine (kind nvidia-h200-x2; issues 4 and 5): the real
# ragged_all_to_all exchange against its emulation, then `maxtext-moe bench` of the two-GPU proxy with
# expert parallelism 2 (our block, TE) and with FSDP 2 (MaxText's block), one process per GPU.
# Carry `.device` (wheels, xprof stub, te_h200_bundle.tar.xz). Results under $OUT (at most 8 files).
set -uo pipefail
steps=${1:-8}
python3 -m pip install -q --no-index --no-deps .device/wheels/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/.device/xprof-stub DECOUPLE_GCLOUD=TRUE PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -c "import tarfile;tarfile.open('.device/te_h200_bundle.tar.xz').extractall('/opt/te',filter='tar')" || exit 1
source /opt/te/activate.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$OUT/gpu.txt"
nvidia-smi topo -m >> "$OUT/gpu.txt" 2>&1
timeout 240 python3 -m pytest tests/test_moe_dispatch.py -m gpu -q -p no:cacheprovider > "$OUT/dispatch_gpu.log" 2>&1
echo "dispatch GPU tests rc=$?"; tail -3 "$OUT/dispatch_gpu.log"
two_processes() {  # name recipe [overrides]: one process per GPU, process 0 reports
  local name=$1; shift
  local pids=()
  for i in 0 1; do
    JAX_COORDINATOR_ADDRESS=127.0.0.1:8476 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=$i JAX_LOCAL_DEVICE_IDS=$i \
      timeout 420 python3 -m maxtext_moe bench "$@" --steps "$steps" --warmup 3 --out "$OUT/$name.json" \
      base_output_directory=/tmp/runs > "$OUT/$name.p$i.log" 2>&1 &
    pids+=($!)
  done
  local rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  echo "=== $name: $* rc=$rc"
  grep -E "^(MoE block|step time|predicted|tokens/s|model TFLOPS|MFU|peak device|loss) " "$OUT/$name.p0.log" \
    || tail -5 "$OUT/$name.p0.log"
}
two_processes ep2_ours_te deepseek3-proxy-h200-2gpu
two_processes fsdp2_maxtext deepseek3-proxy-h200-2gpu-fsdp
