#!/bin/sh
# Install the `gpu` extra of pyproject.toml into the venv, building Transformer Engine's JAX extension (an sdist)
# against the extra's CUDA 13 JAX and headers. Run by the Dockerfile before `pip install -e ".[gpu]"`, which then
# finds everything installed.
# Why not plain `pip install .[gpu]`: transformer_engine_jax 2.20.2 declares jax[cuda12] as a build requirement, so
# pip's isolated build compiles it against CUDA 12 and makes it require transformer_engine_cu12, beside the extra's
# CUDA 13 JAX. Built here without isolation, its setup takes the CUDA major (13) from the venv's jax plugin, and with
# NVTE_BUILD_USE_NVIDIA_WHEELS=1 the headers from the venv's NVIDIA wheels (nvidia/cu13, cudnn, nccl, nvshmem), not
# from a CUDA toolkit of the base; scripts/container/te-build.txt pins what that build needs besides the extra.
# Only a C++ compiler is needed: the extension has no CUDA sources, and no GPU is asked at build time.
# Usage: MAXTEXT_MOE_VENV=/opt/venv scripts/container/install_te.sh
set -euf
py="${MAXTEXT_MOE_VENV:?set MAXTEXT_MOE_VENV}/bin/python"
here=$(cd "$(dirname "$0")" && pwd)
extra() {  # the gpu extra's requirements, with (--te) or without (--rest) Transformer Engine
  "$py" -c 'import sys, tomllib
reqs = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["gpu"]
print(" ".join(r for r in reqs if r.startswith("transformer-engine") == (sys.argv[2] == "--te")))' \
    "$here/../../pyproject.toml" "$1"
}
rest=$(extra --rest)
te=$(extra --te)
[ -n "$te" ] || { echo "install_te: no transformer-engine requirement in the gpu extra" >&2; exit 2; }
# shellcheck disable=SC2086 # one word per requirement (globbing is off: set -f)
"$py" -m pip install --disable-pip-version-check $rest -r "$here/te-build.txt"
# shellcheck disable=SC2086
NVTE_BUILD_USE_NVIDIA_WHEELS=1 "$py" -m pip install --disable-pip-version-check --no-build-isolation $te
