#!/usr/bin/env bash
# One device run on an H200: the GPU tests of our MoE layer (BF16 backends and FP8
# current scaling against the float32 reference), then the layer timed with TE in BF16 and in FP8
# (`moe.fp8: current_scaling`) at 8192 and 16384 tokens. With two GPUs the tests and the timing run side
# by side, one per GPU. Logs and JSON: $OUT/results.tgz. Usage there: bash scripts/device/moe_fp8_h200.sh
set -uo pipefail
source scripts/device/common.sh
second=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest tests/gpu/test_moe_gpu.py -m gpu -q -p no:cacheprovider \
  > "$W/pytest_moe_gpu.log" 2>&1 &
[ "$second" = 1 ] || wait
CUDA_VISIBLE_DEVICES=$second timeout 200 python3 benchmarks/bench_moe_layer.py --tokens 8192 16384 \
  --backends te te_fp8 --no-maxtext --out "$W/moe_layer_fp8.json" > "$W/bench_layer.log" 2>&1
wait
tail -15 "$W/pytest_moe_gpu.log"; grep -v "Warning\|sow\|https://\|^ *$" "$W/bench_layer.log" | tail -8
pack
