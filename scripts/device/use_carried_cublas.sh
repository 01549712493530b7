#!/usr/bin/env bash
# Sourced after common.sh in a device call: put the newer cuBLAS that this and earlier calls carried in parts
# (cut to the H200's sm_90 kernels by scripts/device/build_cublas_carry.sh) in place of the image's cuBLAS 13.1,
# so that TE's single-kernel grouped GEMM ("V2", cuBLAS >= 13.4) runs.
# Every copy of the library on the machine is replaced, so XLA's own GEMMs run the same cuBLAS as TE's.
# shellcheck source=scripts/device/carry_join.sh
source scripts/device/carry_join.sh && carry_join cublas /tmp/cub.tar || return 1
mkdir -p /tmp/cubx && tar xf /tmp/cub.tar -C /tmp/cubx || return 1
python3 -c "
import lzma, shutil
for n in ('lt90.so', 'cb90.so'):
    with lzma.open(f'/tmp/cubx/{n}.xz') as f, open(f'/tmp/cubx/{n}', 'wb') as o:
        shutil.copyfileobj(f, o)
" || return 1
while read -r f; do
  case $(basename "$f") in libcublasLt.so.13*) src=/tmp/cubx/lt90.so ;; *) src=/tmp/cubx/cb90.so ;; esac
  cp "$src" "$f" && echo "replaced $f" | tee -a "$W/gpu.txt"
done < <(find / -xdev -type f \( -name 'libcublasLt.so.13*' -o -name 'libcublas.so.13*' \) 2>/dev/null)
python3 -c "import jax; jax.devices(); import transformer_engine.jax; import transformer_engine_jax as t; print('cuBLASLt seen by TE:', t.get_cublasLt_version())" | tee -a "$W/gpu.txt"
