#!/usr/bin/env bash
# A stand-in for the NGC JAX base where nvcr.io cannot be reached: a Debian 12 (bookworm) minbase root filesystem
# made with mmdebstrap and imported into podman. It has no Python, no CUDA and no compiler; the Dockerfile brings
# its own (see docs/CLUSTER.md, "2. Build the image").
# Usage: scripts/container/standin_base.sh [TAG]      (default localhost/debian-minbase:bookworm; prints the tag)
# Needs: apt-get install mmdebstrap podman
set -euo pipefail
tag=${1:-localhost/debian-minbase:bookworm}
for tool in mmdebstrap podman; do
  command -v "$tool" >/dev/null || { echo "standin_base: $tool is not installed (apt-get install mmdebstrap podman)" >&2; exit 2; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mmdebstrap --variant=minbase bookworm "$work/rootfs.tar" >&2
podman import --change 'CMD ["/bin/bash"]' "$work/rootfs.tar" "$tag" >&2
echo "$tag"
