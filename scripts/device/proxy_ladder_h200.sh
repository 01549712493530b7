#!/usr/bin/env bash
# One device run: `maxtext-moe bench` on the one-GPU DeepSeek-V3 proxy, rung by rung, as many
# rungs at once as the machine has GPUs (one process per GPU, pinned with CUDA_VISIBLE_DEVICES; a rung
# never shares its GPU). A rung may carry bench options too: `--profile` adds where the device time of
# two warm-up steps went. Logs and JSON: $OUT/results.tgz.
# A rung named NAME@DIR runs the maxtext_moe of the source tree DIR (an older commit carried in .device, say,
# to measure a change against its parent in one call). Its Python starts with -P: from the repository root,
# `python -m` would otherwise import the repository's own package ahead of DIR's on PYTHONPATH.
# A rung's first word after its name may name another recipe (a word without "="); the one-GPU proxy otherwise.
# Each summary has the GPU compile's own memory estimate (MaxText's log); with REMAT_GEMMS=1 each rung also dumps
# its optimized HLO and the summary says how much GEMM work XLA's rematerialization recomputes there
# (maxtext_moe/plan/remat_gemms.py, as `plan --compile` reads a deviceless dump).
# Usage there: bash scripts/device/proxy_ladder_h200.sh STEPS ["NAME[@DIR] [RECIPE] key=value ..." ...]
# (no rungs given: three rungs of upstream's block, tokamax with cuDNN attention through JAX, then TE, then FP8)
set -uo pipefail
steps=${1:-8}; shift || true
source scripts/device/common.sh
python3 -m maxtext_moe doctor deepseek3-proxy-h200-1gpu 2>&1 | tee -a "$W/gpu.txt"
RUNG_TIMEOUT=${RUNG_TIMEOUT:-280}
rung() {  # gpu, name[@tree], then overrides; writes NAME.json, NAME.log and NAME.summary
  local gpu=$1 name=${2%@*} tree=$PWD t0=$SECONDS recipe=deepseek3-proxy-h200-1gpu
  [ "$2" = "$name" ] || tree=$(cd "${2#*@}" && pwd) || return; shift 2
  case ${1:-} in *=* | --* | "") ;; *) recipe=$1; shift ;; esac
  local dump=/tmp/runs/$name/hlo-dump
  [ "${REMAT_GEMMS:-0}" = 1 ] && set -- "$@" "xla_flags.xla_dump_to=$dump" xla_flags.xla_dump_hlo_as_text=true \
    xla_flags.xla_dump_hlo_module_re=jit_train_step
  CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH="$tree:$PYTHONPATH" timeout -k 10 "$RUNG_TIMEOUT" \
    python3 -P -m maxtext_moe bench "$recipe" \
    --steps "$steps" --warmup 3 --out "$W/$name.json" base_output_directory="/tmp/runs/$name" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  { echo "=== $name (GPU $gpu, $((SECONDS - t0)) s wall): $recipe${*:+ $*} rc=$rc"
    grep -E "^(step time|predicted|tokens/s|model TFLOPS|MFU|peak device|loss|profile|  [a-zA-Z])" "$W/$name.log" \
      || tail -4 "$W/$name.log"
    grep -ho "Total estimated memory size.*" /tmp/runs/"$name"/*/maxtext.log 2>/dev/null | sed 's/^/GPU compile: /'
    [ -d "$dump" ] && PYTHONPATH="$tree:$PYTHONPATH" python3 -P -c \
      "import sys; from pathlib import Path; from maxtext_moe.plan import remat_gemms; print(remat_gemms.find(Path(sys.argv[1])).render())" "$dump"
    [ $rc -eq 0 ] || tail -15 /tmp/runs/"$name"/*/maxtext.log 2>/dev/null  # where a failed or stopped rung was
  } > "$W/$name.summary"
}
if [ $# -eq 0 ]; then
  set -- "tokamax_cudnnjax moe.impl=maxtext" "tokamax_cudnnte moe.impl=maxtext attention=cudnn_flash_te" \
         "tokamax_cudnnte_fp8 moe.impl=maxtext attention=cudnn_flash_te quantization=te_fp8_currentscaling"
fi
gpus=$(nvidia-smi -L | wc -l)
while [ $# -gt 0 ]; do
  names=()
  for ((g = 0; g < gpus && $# > 0; g++)); do
    # shellcheck disable=SC2086  # a spec is a name followed by space-separated overrides
    rung "$g" $1 &
    spec=${1%% *}; names+=("${spec%@*}"); shift
  done
  wait
  for n in "${names[@]}"; do cat "$W/$n.summary"; done
  pack  # after every round: a call stopped at its time limit still brings back what finished
done
