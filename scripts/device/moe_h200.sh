#!/usr/bin/env bash
# One device call on the lent H200 (issue 5): install the wheelhouse and TE, run the GPU tests, then the
# MoE layer benchmark (MOE_GPU_TESTS=0 skips the tests). Arguments go to the benchmark. Carry `.device` (wheels, xprof stub, te_h200_bundle.tar.xz). Results under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps .device/wheels/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/.device/xprof-stub DECOUPLE_GCLOUD=TRUE PYTHONUNBUFFERED=1
python3 -c "import tarfile;tarfile.open('.device/te_h200_bundle.tar.xz').extractall('/opt/te',filter='tar')" || exit 1
source /opt/te/activate.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee $OUT/gpu.txt
[ "${MOE_GPU_TESTS:-1}" = 0 ] || timeout 150 python3 -m pytest tests/test_moe_gpu.py -q -p no:cacheprovider 2>&1 | tee $OUT/pytest_gpu.log | tail -15
python3 scripts/bench_moe_layer.py --out $OUT/moe_layer_h200.json "$@" 2>&1 | grep -v "Warning\|sow\|https://\|^ *$" | tee $OUT/bench.log
