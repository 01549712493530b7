#!/usr/bin/env bash
# Build .device/nccl/nccl_h200.tar.xz: an NCCL new enough for TE's NCCL EP (>= 2.30.4), for the lent H200s.
#
# The H200 image has NCCL 2.28.9 and no network. The pip wheel nvidia-nccl-cu13 carries libnccl.so.2
# with device code for seven architectures (252 MB for 2.30.7); the shared prune tool keeps sm_90 only,
# and xz brings it to about 36 MiB. With the TE archive (29 MB) and the wheelhouse (25 MB) that is over
# one 64 MiB carry, so it travels alone in a first call on the machine (carry .device/nccl; the call runs
# scripts/device/nccl_unpack.sh) and is unpacked to /opt/nccl, which stays while the machine is held (it is
# given back 30 s after a call); the next call carries TE and the wheels (.device/wheels, .device/xprof-stub,
# .device/te_h200_bundle.tar.xz, not .device/nccl) and sources /opt/nccl/activate.sh after
# scripts/device/common.sh (scripts/device/nccl_ep_h200x2.sh does). docs/PERFORMANCE.md has both calls.
# Usage: scripts/device/build_nccl_carry.sh [OUT.tar.xz]
#   NCCL_VERSION defaults to the nvidia-nccl-cu13 pin of pyproject.toml's gpu extra, the NCCL the container ships.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${1:-$root/.device/nccl/nccl_h200.tar.xz}
# shellcheck source=scripts/device/carry_fetch.sh
source "$root/scripts/device/carry_fetch.sh"
carry_fetch build_nccl_carry nvidia-nccl-cu13 NCCL_VERSION
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('nvidia/nccl/lib/libnccl.so.2', sys.argv[2])" \
  "$work"/nvidia_nccl_cu13-*.whl "$work/wheel"
mkdir -p "$work/nccl/lib"
python3 "$PRUNE_FATBIN" prune "$work/wheel/nvidia/nccl/lib/libnccl.so.2" "$work/nccl/lib/libnccl.so.2" --keep 90 --mode compact

# The pruned library must still load and report its version (no GPU needed for ncclGetVersion).
got=$(python3 -c "
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1]); v = ctypes.c_int()
assert lib.ncclGetVersion(ctypes.byref(v)) == 0
print(v.value)" "$work/nccl/lib/libnccl.so.2")
carry_expect_version build_nccl_carry libnccl "$got"

# LD_PRELOAD, not LD_LIBRARY_PATH: jaxlib's CUDA plugin and TE's libnccl_ep.so must bind the same libnccl.
cat >"$work/nccl/activate.sh" <<'EOF'
# Sourced on the device after common.sh: every library in the process binds this NCCL.
export LD_PRELOAD=/opt/nccl/lib/libnccl.so.2${LD_PRELOAD:+:$LD_PRELOAD}
export LD_LIBRARY_PATH=/opt/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
EOF
mkdir -p "$(dirname "$out")"
echo "build_nccl_carry: compressing (xz -9e, about a minute)" >&2
tar -C "$work" -cf - nccl | xz -T2 -9e >"$out"
size=$(stat -c %s "$out")
echo "build_nccl_carry: $out: NCCL $version, sm_90 only, $((size / 1048576)) MiB" >&2
[ "$size" -lt $((60 * 1048576)) ] || { echo "build_nccl_carry: over one carry" >&2; exit 1; }
