#!/usr/bin/env bash
# Build and tag the maxtext-moe image (docker, else podman), optionally push it and convert it for enroot/pyxis.
# Usage: scripts/build_container.sh [--push REGISTRY/REPO] [--enroot]
#   tag:     maxtext-moe:<version from pyproject.toml>   (also REGISTRY/REPO:<version> with --push)
#   --enroot writes maxtext-moe+<version>.sqsh here, the default image of `maxtext-moe launch --slurm`.
# On a SLURM login node without docker, import a pushed image instead:
#   enroot import -o maxtext-moe+<version>.sqsh docker://REGISTRY#REPO:<version>
# and put the .sqsh on a filesystem all nodes mount (srun --container-image=/shared/maxtext-moe+<version>.sqsh).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml")
engine=$(command -v docker || command -v podman || true)
[ -n "$engine" ] || { echo "build_container: neither docker nor podman is installed" >&2; exit 2; }

push="" enroot=0
while [ $# -gt 0 ]; do
  case "$1" in
    --push) push=$2; shift 2 ;;
    --enroot) enroot=1; shift ;;
    *) echo "build_container: unknown argument $1 (see the usage at the top of this script)" >&2; exit 2 ;;
  esac
done

tag="maxtext-moe:$version"
"$engine" build -t "$tag" "$root"
if [ -n "$push" ]; then
  "$engine" tag "$tag" "$push:$version"
  "$engine" push "$push:$version"
fi
if [ "$enroot" = 1 ]; then
  command -v enroot >/dev/null || { echo "build_container: --enroot needs enroot on this machine" >&2; exit 2; }
  scheme=dockerd; [ "$(basename "$engine")" = podman ] && scheme=podman
  enroot import -o "maxtext-moe+$version.sqsh" "$scheme://$tag"
fi
echo "$tag"
