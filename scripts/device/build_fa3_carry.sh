#!/usr/bin/env bash
# Build .device/fa3/fa3_h200.tar.xz: FlashAttention-3 for MLA's head widths (queries and keys 192, values 128)
# on Hopper, as an XLA FFI library that `attention.kernel: fa3` calls (maxtext_moe/upstream/fa3_attention.py).
#
# Why a source build: FA3's JAX binding (kyutai-labs/flash-attn3-jax) ships wheels for head width 128 only,
# and MLA needs 192 for the queries and keys. Its build takes switches for each kernel family; this script
# keeps the two MLA needs (the (192, 128) forward and the 192 backward, which also serves values of 128),
# BF16, sm_90a, no split, paged, local, soft-cap, varlen or GQA packing; with the (192, 192) forward, which the
# binding's dispatch links beside them, that is three kernel files: about 3 minutes on 2 cores from scratch
# (a second run relinks). The binding's strides of 128-wide values under 192-wide queries are set by
# fa3_value_strides.py, applied to a copy of the source.
#
# Usage: scripts/device/build_fa3_carry.sh [OUT.tar.xz]
#   FA3_JAX_SRC   a checkout of flash-attn3-jax at FA3_JAX_COMMIT with csrc/cutlass filled in; by default the
#                 script clones it (with its CUTLASS submodule) into its work folder.
#   FA3_BUILD     the work folder, kept between runs so a second run only relinks (default
#                 ~/.cache/maxtext-moe-fa3).
#   CUDA_HOME     the CUDA toolkit (default /usr/local/cuda); nvcc >= 12.3.
# The archive holds flash_attn3_jax_lib/flash_api*.so and BUILD_INFO; on the H200, unpack it to /opt/fa3 and
# put /opt/fa3 on PYTHONPATH (scripts/device/common.sh does).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${1:-$root/.device/fa3/fa3_h200.tar.xz}
FA3_JAX_REPO=https://github.com/kyutai-labs/flash-attn3-jax
FA3_JAX_COMMIT=dccfc1650e47fdc7e254db27cf605154f386a67a # v0.2.3, FA3 with the (192, 128) backward
build=${FA3_BUILD:-$HOME/.cache/maxtext-moe-fa3}
cuda=${CUDA_HOME:-/usr/local/cuda}
python=$(ls -d "$(pyenv root 2>/dev/null || echo /usr)"/versions/3.12.*/bin/python3 2>/dev/null | tail -1)
python=${python:-python3}
mkdir -p "$build"

src=${FA3_JAX_SRC:-$build/src}
if [ -z "${FA3_JAX_SRC:-}" ] && [ ! -d "$src/.git" ]; then
  echo "build_fa3_carry: cloning $FA3_JAX_REPO at $FA3_JAX_COMMIT" >&2
  git clone -q "$FA3_JAX_REPO" "$src"
  git -C "$src" checkout -q "$FA3_JAX_COMMIT"
  git -C "$src" submodule -q update --init --depth 1 csrc/cutlass
fi
[ -f "$src/csrc/cutlass/include/cute/tensor.hpp" ] || {
  echo "build_fa3_carry: $src/csrc/cutlass is empty; FA3_JAX_SRC needs its CUTLASS submodule" >&2
  exit 2
}

# The project's CMake list globs every kernel file and its switches miss some names (`_split_sm90.cu`), so
# the build compiles a copy of the sources whose instantiations folder holds the three MLA needs alone.
kernels=(flash_fwd_hdim192_128_bf16_sm90.cu flash_fwd_hdim192_bf16_sm90.cu flash_bwd_hdim192_bf16_sm90.cu)
rm -rf "$build/mla-src"
cp -a "$src" "$build/mla-src"
inst=$build/mla-src/csrc/flash_attn/src/instantiations
find "$inst" -name '*.cu' -delete
for k in "${kernels[@]}"; do cp -p "$src/csrc/flash_attn/src/instantiations/$k" "$inst/"; done
src=$build/mla-src
python3 "$root/scripts/device/fa3_value_strides.py" "$src/csrc/flash_attn/flash.cpp"

if [ ! -x "$build/venv/bin/python" ]; then
  "$python" -m venv "$build/venv"
  # CMake >= 3.26 knows nvcc's C++20 dialect, which FA3's sources need; Debian 12 ships 3.25.
  "$build/venv/bin/python" -m pip install -q "pybind11==2.13.6" "cmake==3.31.6" "ninja==1.11.1.4"
fi
export PATH=$build/venv/bin:$PATH
pybind=$("$build/venv/bin/python" -m pybind11 --cmakedir)

# One kernel family per switch; ON removes it. The forward (192, 128) kernel is HDIMDIFF192, the backward
# rounds both widths to 192 and runs the HDIM192 kernel.
switches=(
  SPLIT=ON PAGEDKV=ON APPENDKV=ON LOCAL=ON SOFTCAP=ON PACKGQA=ON FP16=ON FP8=ON SM8x=ON VARLEN=ON CLUSTER=ON
  HDIM64=ON HDIM96=ON HDIM128=ON HDIM256=ON HDIMDIFF64=ON HDIM192=OFF HDIMDIFF192=OFF BACKWARD=OFF SM90=OFF
)
defines=()
for s in "${switches[@]}"; do defines+=("-DFLASHATTENTION_DISABLE_$s"); done

# CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl, which nvcc finds and the host compiler of the
# binding's C++ file does not. -fpermissive: with FP16 and split-KV switched off, the binding's fallbacks
# return an error value from two void functions (paths this build never takes: BF16, one split).
cxx_flags="-fpermissive$([ -d "$cuda/include/cccl" ] && echo " -I$cuda/include/cccl" || true)"
echo "build_fa3_carry: configuring in $build/cmake" >&2
cmake -S "$src" -B "$build/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc" -DCUDAToolkit_ROOT="$cuda" -DFLASH_ATTN_CUDA_ARCHS=90 \
  -Dpybind11_DIR="$pybind" -DPython_EXECUTABLE="$build/venv/bin/python" -DCMAKE_CXX_FLAGS="$cxx_flags" \
  -DSKBUILD_PLATLIB_DIR="$build/install" "${defines[@]}" >"$build/configure.log" 2>&1 ||
  { tail -20 "$build/configure.log" >&2; exit 1; }
# Each kernel file takes one nvcc process for one to two minutes: two at once on this machine kind.
echo "build_fa3_carry: compiling (about 3 minutes on 2 cores; log: $build/build.log)" >&2
start=$(date +%s)
cmake --build "$build/cmake" -j "${FA3_JOBS:-2}" >"$build/build.log" 2>&1 || { tail -30 "$build/build.log" >&2; exit 1; }
echo "build_fa3_carry: compiled in $(($(date +%s) - start)) s" >&2

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/flash_attn3_jax_lib"
cp "$build"/cmake/flash_api*.so "$stage/flash_attn3_jax_lib/"
cat >"$stage/BUILD_INFO" <<EOF
flash-attn3-jax $FA3_JAX_COMMIT
nvcc $("$cuda/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
kernels: BF16 sm_90a, forward (192, 128), backward 192
EOF
# The library must load and register FA3's FFI targets here, without a GPU.
PYTHONPATH="$stage" LD_LIBRARY_PATH="$cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$build/venv/bin/python" -c "
import flash_attn3_jax_lib.flash_api as f
names = sorted(f.get_ffi_registrations())
assert 'flash_mha_fwd' in names and 'flash_mha_bwd' in names, names
print('build_fa3_carry: FFI targets', ' '.join(names))" >&2
mkdir -p "$(dirname "$out")"
tar -C "$stage" -cf - . | xz -T2 -9 >"$out"
echo "build_fa3_carry: $out: $(($(stat -c %s "$out") / 1024)) KiB" >&2
