#!/usr/bin/env bash
# The one-GPU tests (tests/gpu, marker gpu) on the lent H200, for a change to code they cover; the two-GPU ones
# skip themselves. Log: $OUT/results.tgz (gpu_tests.log). Usage there: bash scripts/device/gpu_tests_h200.sh [SECONDS [PATH ...]]
# (PATHs: test files or node ids to run instead of all of tests/gpu)
set -uo pipefail
source scripts/device/common.sh
seconds=${1:-240}; shift || true
timeout "$seconds" python3 -m pytest "${@:-tests/gpu}" -m gpu -q -rs -p no:cacheprovider > "$W/gpu_tests.log" 2>&1
echo "gpu tests: exit $?"
tail -12 "$W/gpu_tests.log"
pack
