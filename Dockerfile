# maxtext-moe on NVIDIA GPUs: build with scripts/build_container.sh, run on SLURM (pyxis/enroot) or Kubernetes
# (docs/CLUSTER.md). The Python environment is the one scripts/setup.sh builds on a laptop (requirements/cpu.lock,
# the project itself) plus the `gpu` extra pinned in pyproject.toml: one source of truth, tested by
# tests/test_container.py.
#
# Base: NGC JAX 26.10 for its CUDA 13 toolkit and headers (Transformer Engine's JAX extension is a source build
# that needs them), cuDNN, NCCL and the driver-compatibility libraries. Its own jax/TE builds are NOT used: the
# venv below pins jax 0.11.2 (+ CUDA 13 plugin) and transformer-engine[jax] 2.20.2, which is what the recipes
# were checked against. NCCL comes from the nvidia-nccl-cu13 wheel jax[cuda13] pulls in; TE's NCCL EP needs
# >= 2.30.4 - run `maxtext-moe doctor RECIPE` inside the image on a GPU node to see versions and gaps.
FROM nvcr.io/nvidia/jax:26.10-py3

# python3.12-venv: scripts/setup.sh creates a venv; its version follows the base image's Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12-venv \
    && rm -rf /var/lib/apt/lists/*

ENV MAXTEXT_MOE_VENV=/opt/venv \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    DECOUPLE_GCLOUD=TRUE
WORKDIR /opt/maxtext-moe

# Dependencies first (cached until the lock file or pyproject.toml changes), then the sources.
COPY requirements/ requirements/
COPY pyproject.toml README.md ./
COPY scripts/setup.sh scripts/setup.sh
COPY maxtext_moe/ maxtext_moe/
COPY recipes/ recipes/
COPY configs/ configs/
RUN scripts/setup.sh \
    && /opt/venv/bin/python -m pip install --disable-pip-version-check -e ".[gpu]"

RUN useradd --create-home --uid 1000 --shell /bin/bash maxtext \
    && mkdir -p /runs && chown maxtext:maxtext /runs
USER 1000:1000
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /runs

ENTRYPOINT ["maxtext-moe"]
CMD ["doctor"]
