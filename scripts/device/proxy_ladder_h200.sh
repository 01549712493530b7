#!/usr/bin/env bash
# One device call on the lent H200 (issue 4): `maxtext-moe bench` on the one-GPU DeepSeek-V3 proxy,
# rung by rung. Carry `.device` (wheels, xprof stub, te_h200_bundle.tar.xz). Results under $OUT.
# Usage there: bash scripts/device/proxy_ladder_h200.sh STEPS ["NAME key=value ..." ...]
# (no rungs given: the first call's three, upstream tokamax with cuDNN attention through JAX, then TE, then FP8)
set -uo pipefail
steps=${1:-8}; shift || true
python3 -m pip install -q --no-index --no-deps .device/wheels/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/.device/xprof-stub DECOUPLE_GCLOUD=TRUE PYTHONUNBUFFERED=1
python3 -c "import tarfile;tarfile.open('.device/te_h200_bundle.tar.xz').extractall('/opt/te',filter='tar')" || exit 1
source /opt/te/activate.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee $OUT/gpu.txt
python3 -m maxtext_moe doctor deepseek3-proxy-h200-1gpu attention=cudnn_flash_te 2>&1 | tee -a $OUT/gpu.txt
rung() {  # name, then overrides
  local name=$1; shift
  echo "=== $name: $*"
  timeout 280 python3 -m maxtext_moe bench deepseek3-proxy-h200-1gpu --steps "$steps" --warmup 3 --out "$OUT/$name.json" \
    base_output_directory=/tmp/runs "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?"; grep -E "^(step time|predicted|tokens/s|model TFLOPS|MFU|peak device|loss) " "$OUT/$name.log" || tail -4 "$OUT/$name.log"
}
if [ $# -eq 0 ]; then
  set -- "tokamax_cudnnjax" "tokamax_cudnnte attention=cudnn_flash_te" \
         "tokamax_cudnnte_fp8 attention=cudnn_flash_te quantization=te_fp8_currentscaling"
fi
for spec in "$@"; do
  # shellcheck disable=SC2086  # a spec is a name followed by space-separated overrides
  rung $spec
done
