#!/usr/bin/env bash
# Build the image (or take one), then run `maxtext-moe doctor` and a short training of the default recipe (a tiny
# DeepSeek-V3 on the CPU) in it; everything goes to a log, with the build's wall time and the image's size.
# Usage: scripts/check_container.sh [--image TAG] [--log FILE] [--steps N] [BUILD_CONTAINER_ARGS...]
#   without --image, builds with scripts/build_container.sh BUILD_CONTAINER_ARGS (e.g. --standin --ca-bundle FILE)
#   --log FILE   default build/container-check.log      --steps N   default 3
# Exits non-zero when the build, doctor or the training fails, or the training does not reach step N.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/container/engine.sh
source "$root/scripts/container/engine.sh"
engine=$(container_engine) || { echo "check_container: neither a docker daemon nor podman is available" >&2; exit 2; }
image="" log="$root/build/container-check.log" steps=3 build_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --image) image=$2; shift 2 ;;
    --log) log=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    *) build_args+=("$1"); shift ;;
  esac
done
mkdir -p "$(dirname "$log")"
: > "$log"
say() { echo "$*" | tee -a "$log"; }

say "# maxtext-moe image check, $(date -u '+%Y-%m-%d %H:%M UTC'), $engine, $(nproc) CPUs"
if [ -z "$image" ]; then
  start=$(date +%s)
  "$root/scripts/build_container.sh" "${build_args[@]}" > "$log.build" 2>&1 \
    || { tail -n 40 "$log.build" | tee -a "$log"; say "build: FAILED (full log $log.build)"; exit 1; }
  image=$(tail -n 1 "$log.build")
  say "build: $(( $(date +%s) - start )) s wall (build_container.sh ${build_args[*]}; full log $log.build)"
fi
size=$("$engine" image inspect --format '{{.Size}}' "$image")
say "image: $image, $(awk -v b="$size" 'BEGIN {printf "%.2f GiB (%.0f bytes)", b / 1024^3, b}')"

# shellcheck disable=SC2207 # engine_limits prints whitespace-separated arguments
run=("$engine" run --rm $(engine_limits "$engine") "$image")
say "\$ ${run[*]} doctor"
"${run[@]}" doctor 2>&1 | tee -a "$log"
say "\$ ${run[*]} train steps=$steps"
start=$(date +%s)
"${run[@]}" train "steps=$steps" 2>&1 | tee -a "$log"
say "train: $(( $(date +%s) - start )) s wall"
grep -Eq "^step +$steps/$steps " "$log" || { say "check_container: the training did not reach step $steps"; exit 1; }
say "check_container: ok"
