#!/usr/bin/env bash
# One device run on one H200: `maxtext-moe plan RECIPE --compile --json` for each DeepSeek-V3
# recipe, every 671B one on JAX's mock GPU topology of its full device count and the proxies, each under
# its own time limit (PLAN_TIMEOUT seconds, default 150); a failure is logged and the next recipe runs.
# PLAN_JOBS recipes compile at once (default 1): a compile is mostly one CPU core's work and leaves the GPU's
# memory alone (`plan --compile` turns preallocation off), so a 16-core machine takes several 671B recipes
# in one call's limit. Do not time training beside it: XLA's autotuner still runs kernels on the GPU.
# JSON and logs: plan_compile/ in $OUT/results.tgz (packed again after every recipe, so a call stopped at its
# limit still brings back what finished); a table of compiled vs planned memory comes last.
# Usage there: bash scripts/device/plan_compile_h200.sh ["recipes/NAME.yml [key=value ...]" ...]  (default: the
# proxies, then every 671B recipe; a 671B compile can take many minutes: name a few per call, with PLAN_JOBS to
# run them together; overrides in the same argument compile a variant, named NAME+key-value)
# A 671B compile outlasts one device run (still running after 545 s on an H200, 2026-12-01). PLAN_DETACH=1 starts
# the compiles detached (setsid) and returns at once, so the call can go on with other work (the
# compiles run no GPU kernels); the next call, within the 30 s the machine stays held, runs
# `bash scripts/device/plan_compile_h200.sh --collect`, which waits for them (up to PLAN_TIMEOUT s) and packs.
set -uo pipefail
source scripts/device/common.sh
PLAN_TIMEOUT=${PLAN_TIMEOUT:-150}
PLAN_JOBS=${PLAN_JOBS:-1}
R="$W/plan_compile"; mkdir -p "$R"  # packed into $OUT/results.tgz: a call brings back at most 8 files
table() { python3 scripts/device/plan_compile_table.py "$R" | tee "$R/table.txt"; pack; }
if [ "${1:-}" = --collect ]; then
  while [ ! -e "$R/done" ] && [ "$SECONDS" -lt "$PLAN_TIMEOUT" ]; do sleep 5; done
  [ -e "$R/done" ] || echo "plan_compile: still compiling after $SECONDS s; what finished:"
  cat "$R/status.txt" 2>/dev/null
  table
  exit 0
fi
if [ -n "${PLAN_DETACH:-}" ]; then
  rm -f "$R/done"
  PLAN_DETACH='' setsid nohup bash "$0" "$@" > "$R/detached.log" 2>&1 < /dev/null &
  echo "plan_compile: compiling $# recipe(s) detached (log $R/detached.log); collect with: bash $0 --collect"
  exit 0
fi
if [ $# -eq 0 ]; then
  set -- recipes/deepseek3-proxy-*.yml recipes/deepseek3-671b-*.yml
fi
compile() {  # one "RECIPE.yml [key=value ...]": NAME.json (or NAME.log's last lines on failure), a status line
  local recipe=${1%% *} overrides=() name t0=$SECONDS rc
  [ "$recipe" = "$1" ] || read -ra overrides <<< "${1#* }"
  name=$(basename "$recipe" .yml)
  for o in "${overrides[@]}"; do name+="+${o//=/-}"; done  # deepseek3-671b-h200-128+scan_layers-true
  mkdir -p "$W/$name.work"  # a failed compile leaves its full log there (TMPDIR), packed with the rest
  TMPDIR="$W/$name.work" timeout -k 10 "$PLAN_TIMEOUT" python3 -m maxtext_moe plan "$(basename "$recipe" .yml)" \
    "${overrides[@]}" --compile --json > "$R/$name.json" 2> "$R/$name.log"
  rc=$?
  echo "$name: rc=$rc, $((SECONDS - t0)) s" | tee -a "$R/status.txt"
  [ "$rc" = 0 ] || { rm -f "$R/$name.json"; tail -3 "$R/$name.log"; }
}
for recipe in "$@"; do
  while [ "$(jobs -rp | wc -l)" -ge "$PLAN_JOBS" ]; do wait -n; pack; done
  compile "$recipe" &
done
wait
touch "$R/done"
table
