#!/usr/bin/env bash
# Build .cublas_0, .cublas_1 and .cublas_2: the cuBLAS of pyproject.toml's gpu extra for the lent H200s, whose
# image has cuBLAS 13.1 (TE's single-kernel grouped GEMM, "V2", needs >= 13.4 on Hopper) and no network.
#
# The wheel's two libraries hold kernels for seven architectures; scripts/device/prune_cublas.py keeps sm_90's
# and xz brings them to about 119 MiB, so they travel in three carries, on one machine held between them (it is
# given back 30 s after a run; each run below starts within that):
#   first run: carry .device and .cublas_0; `source scripts/device/common.sh && source scripts/device/carry_join.sh &&
#           carry_stash cublas`
#   second run: carry .cublas_1; `source scripts/device/carry_join.sh && carry_stash cublas`
#   third run: carry .cublas_2 and .device/xprof-stub; `source scripts/device/common.sh &&
#           source scripts/device/use_carried_cublas.sh && ...` (the runs; docs/PERFORMANCE.md has them).
# Usage: scripts/device/build_cublas_carry.sh [DIR]   (DIR holds the three folders; default: the repository root)
#   CUBLAS_VERSION defaults to the nvidia-cublas pin of pyproject.toml's gpu extra, the cuBLAS the container ships.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dest=${1:-$root}
# shellcheck source=scripts/device/carry_fetch.sh
source "$root/scripts/device/carry_fetch.sh"
carry_fetch build_cublas_carry nvidia-cublas CUBLAS_VERSION
python3 -c "
import sys, zipfile
for name in ('libcublasLt.so.13', 'libcublas.so.13'):
    zipfile.ZipFile(sys.argv[1]).extract(f'nvidia/cu13/lib/{name}', sys.argv[2])" "$work"/nvidia_cublas-*.whl "$work/wheel"
mkdir -p "$work/lib"
for name in libcublasLt.so.13 libcublas.so.13; do
  python3 "$root/scripts/device/prune_cublas.py" "$work/wheel/nvidia/cu13/lib/$name" "$work/lib/$name"
done

# The pruned libraries must still load and report the pinned version (no GPU needed to ask).
got=$(python3 -c "
import ctypes, sys
lt = ctypes.CDLL(sys.argv[1] + '/libcublasLt.so.13')
ctypes.CDLL(sys.argv[1] + '/libcublas.so.13')
print(lt.cublasLtGetVersion())" "$work/lib")
carry_expect_version build_cublas_carry cuBLASLt "$got"

echo "build_cublas_carry: compressing (xz -9, a few minutes)" >&2
xz -T2 -9 -c "$work/lib/libcublasLt.so.13" >"$work/lt90.so.xz"
xz -T2 -9 -c "$work/lib/libcublas.so.13" >"$work/cb90.so.xz"
tar -C "$work" -cf "$work/cublas.tar" lt90.so.xz cb90.so.xz
carry_split "$work/cublas.tar" "$dest" cublas
