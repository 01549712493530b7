#!/usr/bin/env bash
# First of the two NCCL EP device runs on a 2 x H200 machine (kind nvidia-h200-x2): carry
# .device/nccl only (built here by scripts/device/build_nccl_carry.sh) and unpack it to /opt/nccl, which
# stays while the machine is held; then check that the library loads and reports its version. The second
# run, within 30 s, is scripts/device/nccl_ep_h200x2.sh (docs/PERFORMANCE.md, "What limits speed now").
set -euo pipefail
tar -xJf .device/nccl/nccl_h200.tar.xz -C /opt
LD_PRELOAD=/opt/nccl/lib/libnccl.so.2 python3 -c "
import ctypes
v = ctypes.c_int()
assert ctypes.CDLL('libnccl.so.2').ncclGetVersion(ctypes.byref(v)) == 0
print('NCCL at /opt/nccl:', v.value)"
