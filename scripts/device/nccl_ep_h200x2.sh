#!/usr/bin/env bash
# Second of the two NCCL EP device runs on a 2 x H200 machine (the first runs
# scripts/device/nccl_unpack.sh): with NCCL 2.30.7 from /opt/nccl bound by every library, one run measures
#   - doctor on the two-GPU proxy with moe.exchange=nccl_ep (is NCCL EP usable here?);
#   - the GPU tests: tests/gpu/test_nccl_ep_gpu.py (our layer through NCCL EP against XLA's all-to-all,
#     outputs, gradients, the overflow error) and tests/gpu/test_dispatch_gpu.py;
#   - the EP2 layer (benchmarks/bench_ep_dispatch.py) with our block over XLA's all-to-all and over NCCL EP;
#   - the EP2 proxy step (`maxtext-moe bench deepseek3-proxy-h200-2gpu`, batch 4, the recipe's remat) with
#     MaxText's te_moe_block (TE's fused MoE, BF16: the seeds' path; it cannot keep the bias update), ours
#     with the recipe's exchange, and ours with moe.exchange=nccl_ep; one process per GPU.
# Usage there: bash scripts/device/nccl_ep_h200x2.sh STEPS ["NAME PROCESSES RECIPE key=value ..." ...]
# (extra specs run after the three). Logs and JSON: $OUT/results.tgz.
set -uo pipefail
steps=${1:-8}; shift || true
[ -f /opt/nccl/activate.sh ] || { echo "nccl_ep_h200x2: no /opt/nccl; run scripts/device/nccl_unpack.sh first"; exit 2; }
source scripts/device/common.sh
# shellcheck disable=SC1091  # unpacked by the first run
source /opt/nccl/activate.sh
proxy=deepseek3-proxy-h200-2gpu
python3 -m maxtext_moe doctor "$proxy" moe.exchange=nccl_ep > "$W/doctor_nccl_ep.txt" 2>&1
echo "doctor rc=$?"; grep -E "nccl|transformer-engine|can run|cannot run" "$W/doctor_nccl_ep.txt"
timeout 400 python3 -m pytest tests/gpu/test_nccl_ep_gpu.py tests/gpu/test_dispatch_gpu.py -q -rs -p no:cacheprovider \
  > "$W/nccl_ep_gpu.log" 2>&1
echo "NCCL EP GPU tests rc=$?"; tail -8 "$W/nccl_ep_gpu.log"; pack
te_block="moe.impl=maxtext te_moe_block=true prefuse_moe_weights=true te_gmm_quantization=te_no_quant"
te_block+=" routed_bias_update_rate=0.0"
DEVICE_RESULTS=$W DISPATCH_TESTS=0 EP_BENCH_IMPLS="all_to_all nccl_ep" bash scripts/device/proxy_2gpu_h200x2.sh "$steps" \
  "te_moe_block_b4 2 $proxy per_device_batch_size=4 $te_block" \
  "ours_auto_b4 2 $proxy per_device_batch_size=4" \
  "ours_nccl_ep_b4 2 $proxy per_device_batch_size=4 moe.exchange=nccl_ep" "$@"
