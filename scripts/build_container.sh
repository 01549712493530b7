#!/usr/bin/env bash
# Build and tag the maxtext-moe image (docker when its daemon answers, else podman), optionally push it and convert
# it for enroot/pyxis.
# Usage: scripts/build_container.sh [--standin] [--base IMAGE] [--python-dist FILE] [--ca-bundle FILE]
#                                   [--push REGISTRY/REPO] [--enroot]
#   tag:     maxtext-moe:<version from pyproject.toml>   (also REGISTRY/REPO:<version> with --push)
#   --standin      where nvcr.io and GitHub cannot be reached: build on a Debian 12 minbase (made once with
#                  scripts/container/standin_base.sh) with this machine's CPython 3.12 (packed once with
#                  scripts/container/pack_python.sh) instead of NGC's base and python-build-standalone's CPython
#   --base IMAGE   another base (build arg BASE_IMAGE; default nvcr.io/nvidia/jax:26.07-py3, see the Dockerfile)
#   --python-dist FILE   an archive in scripts/container/dist/ as the image's Python (build arg PYTHON_DIST)
#   --ca-bundle FILE     a CA bundle for pip and uv behind a TLS-intercepting proxy, mounted for the build only
#                        (podman)
#   --enroot writes maxtext-moe+<version>.sqsh here, the default image of `maxtext-moe launch --slurm`.
# On a SLURM login node without docker, import a pushed image instead:
#   enroot import -o maxtext-moe+<version>.sqsh docker://REGISTRY#REPO:<version>
# and put the .sqsh on a filesystem all nodes mount (srun --container-image=/shared/maxtext-moe+<version>.sqsh).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/container/engine.sh
source "$root/scripts/container/engine.sh"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml")
engine=$(container_engine) || { echo "build_container: neither a docker daemon nor podman is available" >&2; exit 2; }

push="" enroot=0 standin=0 base="" dist="" ca=""
while [ $# -gt 0 ]; do
  case "$1" in
    --push) push=$2; shift 2 ;;
    --enroot) enroot=1; shift ;;
    --standin) standin=1; shift ;;
    --base) base=$2; shift 2 ;;
    --python-dist) dist=$2; shift 2 ;;
    --ca-bundle) ca=$2; shift 2 ;;
    *) echo "build_container: unknown argument $1 (see the usage at the top of this script)" >&2; exit 2 ;;
  esac
done

if [ "$standin" = 1 ]; then
  [ "$engine" = podman ] || { echo "build_container: --standin builds with podman (podman import)" >&2; exit 2; }
  base=${base:-localhost/debian-minbase:bookworm}
  podman image exists "$base" || "$root/scripts/container/standin_base.sh" "$base" >/dev/null
  if [ -z "$dist" ]; then
    dist=$(cd "$root/scripts/container/dist" 2>/dev/null && find . -maxdepth 1 -name 'cpython-3.12.*.tar.gz' \
      -printf '%f\n' | sort -V | tail -n 1)
    [ -n "$dist" ] || dist=$("$root/scripts/container/pack_python.sh")
  fi
fi

args=()
# shellcheck disable=SC2207 # engine_limits prints whitespace-separated arguments
args+=($(engine_limits "$engine"))
[ -z "$base" ] || args+=(--build-arg "BASE_IMAGE=$base")
if [ -n "$dist" ]; then
  [ -f "$root/scripts/container/dist/$dist" ] || { echo "build_container: no scripts/container/dist/$dist" >&2; exit 2; }
  args+=(--build-arg "PYTHON_DIST=$dist")
fi
if [ -n "$ca" ]; then
  [ "$engine" = podman ] || { echo "build_container: --ca-bundle mounts the bundle with podman build -v" >&2; exit 2; }
  args+=(-v "$(realpath "$ca"):/run/build-ca.pem:ro" --build-arg PIP_CERT=/run/build-ca.pem)
fi

tag="maxtext-moe:$version"
"$engine" build "${args[@]}" -t "$tag" "$root"
if [ -n "$push" ]; then
  "$engine" tag "$tag" "$push:$version"
  "$engine" push "$push:$version"
fi
if [ "$enroot" = 1 ]; then
  command -v enroot >/dev/null || { echo "build_container: --enroot needs enroot on this machine" >&2; exit 2; }
  scheme=dockerd; [ "$engine" = podman ] && scheme=podman
  enroot import -o "maxtext-moe+$version.sqsh" "$scheme://$tag"
fi
echo "$tag"
