#!/usr/bin/env bash
# Build .cudnn_0, .cudnn_1, ...: a newer cuDNN for the lent H200s, whose image has cuDNN 9.19 and no network.
# cuDNN runs the proxies' attention (`attention: cudnn_flash_jax`), 18% of the BF16 step in `bench --profile`;
# scripts/device/cudnn_compare_h200.sh measures the two on one machine.
#
# The wheel's ten libraries (876 MiB for 9.28.1) hold kernels for several architectures;
# scripts/device/prune_cublas.py keeps sm_90's, and xz brings the set to 182 MiB: four carries, on one machine
# held between them (it is given back 30 s after a run; each run below starts within that):
#   first run: carry .device and .cudnn_0 (with the tracked tree, just under 64 MiB);
#           `source scripts/device/common.sh && source scripts/device/carry_join.sh && carry_stash cudnn`
#   each middle run: carry .cudnn_N; `source scripts/device/carry_join.sh && carry_stash cudnn`
#   the last: carry the last .cudnn_N and .device/xprof-stub; `source scripts/device/common.sh &&
#           source scripts/device/use_carried_cudnn.sh && cudnn_use carried && ...` (docs/PERFORMANCE.md).
# Usage: scripts/device/build_cudnn_carry.sh [DIR]   (DIR holds the folders; default: the repository root)
#   CUDNN_VERSION defaults to 9.28.1.4, the one measured against the image's 9.19 (docs/PERFORMANCE.md: no faster
#   a step, so the gpu extra pins none and takes the cuDNN jax[cuda13] requires).
set -euo pipefail
CUDNN_VERSION=${CUDNN_VERSION:-9.28.1.4}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dest=${1:-$root}
# shellcheck source=scripts/device/carry_fetch.sh
source "$root/scripts/device/carry_fetch.sh"
carry_fetch build_cudnn_carry nvidia-cudnn-cu13 CUDNN_VERSION
python3 -c "
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('nvidia/cudnn/lib/')])" "$work"/nvidia_cudnn_cu13-*.whl "$work/wheel"
mkdir -p "$work/lib"
for lib in "$work"/wheel/nvidia/cudnn/lib/*.so.9; do
  python3 "$root/scripts/device/prune_cublas.py" "$lib" "$work/lib/$(basename "$lib")"
done

# The pruned set must still load and report the pinned version (no GPU needed to ask).
got=$(python3 -c "import ctypes, sys; print(ctypes.CDLL(sys.argv[1] + '/libcudnn_graph.so.9').cudnnGetVersion())" "$work/lib")
carry_expect_version build_cudnn_carry cuDNN "$got"

echo "build_cudnn_carry: compressing (xz -9, about ten minutes on two cores)" >&2
tar -C "$work/lib" -cf - . | xz -T2 -9 >"$work/cudnn.tar.xz"
carry_split "$work/cudnn.tar.xz" "$dest" cudnn
