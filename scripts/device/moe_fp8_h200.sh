#!/usr/bin/env bash
# One device call on the lent H200: our MoE experts with TE's FP8 grouped GEMM (moe.fp8: current_scaling)
# against BF16, measured in the same call. Install the wheelhouse and TE, run the GPU tests (BF16 backends and
# FP8 current scaling against the float32 reference), time the layer with te and te_fp8 at 8192 and 16384
# tokens, then `maxtext-moe bench` on the one-GPU proxy in BF16 and in FP8. Carry `.device` (wheels, xprof
# stub, te_h200_bundle.tar.xz); the time limits below sum to under one 600 s call. 8 result files under $OUT.
# Usage there: bash scripts/device/moe_fp8_h200.sh [STEPS]
set -uo pipefail
steps=${1:-8}
python3 -m pip install -q --no-index --no-deps .device/wheels/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/.device/xprof-stub DECOUPLE_GCLOUD=TRUE PYTHONUNBUFFERED=1
python3 -c "import tarfile;tarfile.open('.device/te_h200_bundle.tar.xz').extractall('/opt/te',filter='tar')" || exit 1
source /opt/te/activate.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee $OUT/gpu.txt
python3 -m maxtext_moe doctor deepseek3-proxy-h200-1gpu moe.fp8=current_scaling 2>&1 | tee -a $OUT/gpu.txt
timeout 150 python3 -m pytest tests/test_moe_gpu.py -m gpu -q -p no:cacheprovider 2>&1 | tee $OUT/pytest_gpu.log | tail -15
timeout 150 python3 scripts/bench_moe_layer.py --tokens 8192 16384 --backends te te_fp8 --no-maxtext \
  --out $OUT/moe_layer_h200.json 2>&1 | grep -v "Warning\|sow\|https://\|^ *$" | tee $OUT/bench_layer.log
proxy() {  # name, then overrides of the proxy recipe
  local name=$1; shift
  echo "=== proxy $name: $*"
  timeout 140 python3 -m maxtext_moe bench deepseek3-proxy-h200-1gpu --steps "$steps" --warmup 3 \
    --out "$OUT/proxy_$name.json" base_output_directory=/tmp/runs "$@" > "$OUT/proxy_$name.log" 2>&1
  echo "rc=$?"; grep -E "^(step time|tokens/s|model TFLOPS|MFU|peak device|loss|MoE block) " "$OUT/proxy_$name.log" \
    || tail -4 "$OUT/proxy_$name.log"
}
proxy bf16
proxy fp8 moe.fp8=current_scaling
