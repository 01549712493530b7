# maxtext-moe on NVIDIA GPUs: build with scripts/build_container.sh, run on SLURM (pyxis/enroot) or Kubernetes
# (docs/CLUSTER.md). The Python environment is the one scripts/setup.sh builds on a laptop (requirements/cpu.lock,
# the project itself) plus the `gpu` extra pinned in pyproject.toml: one source of truth, tested by
# tests/e2e/test_container.py.
#
# Base (BASE_IMAGE): NGC JAX for the driver-compatibility libraries and a CUDA userland that cluster tooling expects.
# The image takes nothing else from it: Python 3.12 comes from the python stage below, the CUDA 13 headers that
# Transformer Engine's JAX extension compiles against from the NVIDIA wheels of the gpu extra, and JAX, TE and NCCL
# from the venv, which pins jax 0.11.2, transformer-engine[jax] 2.20.2 and nvidia-nccl-cu13, the versions the
# recipes were checked against (docs/CLUSTER.md says why, and which public sources name the default). Any Debian or
# Ubuntu base builds it: scripts/build_container.sh --standin builds on a Debian 12 minbase.
ARG BASE_IMAGE=nvcr.io/nvidia/jax:26.07-py3

# The venv's interpreter, whatever the base carries: python-build-standalone's CPython PYTHON_VERSION, installed
# by uv UV_VERSION; or PYTHON_DIST, an archive in scripts/container/dist/ (scripts/container/pack_python.sh).
FROM ${BASE_IMAGE} AS python
ARG PYTHON_VERSION=3.12.16
ARG UV_VERSION=0.13.9
ARG PYTHON_DIST=
ARG PIP_CERT
COPY scripts/container/ /tmp/container/
RUN /tmp/container/install_python.sh /opt/python

FROM ${BASE_IMAGE}
ARG BASE_IMAGE
# NCCL_VERSION is the nvidia-nccl-cu13 pin of pyproject.toml's gpu extra (TE's NCCL EP needs >= 2.30.4); the check
# after the install fails the build when the venv's NCCL differs from it.
ARG NCCL_VERSION=2.30.7
ARG NCCL_LIB=/opt/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2
# PIP_CERT: a CA bundle for pip behind a TLS-intercepting proxy (build_container.sh --ca-bundle); not kept.
ARG PIP_CERT
LABEL org.opencontainers.image.base.name="${BASE_IMAGE}" \
      maxtext-moe.nccl="${NCCL_VERSION}"

# g++: Transformer Engine's JAX extension is compiled below (C++ only; no nvcc, no GPU).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
COPY --from=python /opt/python /opt/python

ENV MAXTEXT_MOE_VENV=/opt/venv \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    DECOUPLE_GCLOUD=TRUE \
    PATH=/opt/python/bin:$PATH
WORKDIR /opt/maxtext-moe

# Dependencies first (cached until the lock file or pyproject.toml changes), then the sources.
COPY requirements/ requirements/
COPY pyproject.toml README.md ./
COPY scripts/setup.sh scripts/python312.sh scripts/
COPY scripts/container/install_te.sh scripts/container/te-build.txt scripts/container/
COPY maxtext_moe/ maxtext_moe/
COPY recipes/ recipes/
COPY configs/ configs/
RUN scripts/setup.sh \
    && scripts/container/install_te.sh \
    && /opt/venv/bin/python -m pip install --disable-pip-version-check -e ".[gpu]"

# What `maxtext-moe doctor` will report inside the image is the pinned NCCL, at NCCL_LIB (no GPU needed to ask).
RUN test -f "$NCCL_LIB" \
    && /opt/venv/bin/maxtext-moe doctor --json > /tmp/doctor.json \
    && /opt/venv/bin/python -c "import json, sys; got = '.'.join(map(str, json.load(open('/tmp/doctor.json'))['machine']['nccl'] or [])); sys.exit(None if got == sys.argv[1] else f'the venv has NCCL {got or None}, NCCL_VERSION says {sys.argv[1]}')" "$NCCL_VERSION" \
    && rm /tmp/doctor.json

RUN useradd --create-home --uid 1000 --shell /bin/bash maxtext \
    && mkdir -p /runs && chown maxtext:maxtext /runs
USER 1000:1000
# One NCCL per process: jaxlib's CUDA plugin opens this file by path, and the preload answers the soname
# libnccl.so.2 that TE's libnccl_ep.so asks for, so neither can bind the base image's own NCCL.
ENV PATH=/opt/venv/bin:$PATH \
    LD_PRELOAD=${NCCL_LIB}
WORKDIR /runs

ENTRYPOINT ["maxtext-moe"]
CMD ["doctor"]
