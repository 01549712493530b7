#!/bin/sh
# Install the image's CPython 3.12 at DEST, whatever the base carries (run by the Dockerfile's python stage).
#   default:          python-build-standalone's CPython $PYTHON_VERSION, downloaded by uv $UV_VERSION (from PyPI);
#                     needs only glibc, apt and a python3 to bootstrap uv (installed with apt when the base lacks one)
#   PYTHON_DIST=FILE: the relocatable archive scripts/container/dist/FILE (pack_python.sh makes one from a local
#                     CPython 3.12) instead, where GitHub, which serves python-build-standalone, cannot be reached
# PIP_CERT, when set, is the CA bundle that pip and uv trust (a TLS-intercepting proxy).
# Usage: scripts/container/install_python.sh DEST
set -eu
dest=$1
here=$(cd "$(dirname "$0")" && pwd)
if [ -n "${PIP_CERT:-}" ]; then
  export SSL_CERT_FILE="$PIP_CERT"
fi

if [ -n "${PYTHON_DIST:-}" ]; then
  mkdir -p "$dest"
  tar -xzf "$here/dist/$PYTHON_DIST" -C "$dest" --strip-components=1
else
  : "${PYTHON_VERSION:?set PYTHON_VERSION (a 3.12 release) or PYTHON_DIST}" "${UV_VERSION:?set UV_VERSION}"
  boot=$(mktemp -d)
  if ! python3 -m venv "$boot/uv" 2>/dev/null; then
    apt-get update
    apt-get install -y --no-install-recommends python3-venv
    rm -rf /var/lib/apt/lists/*
    python3 -m venv "$boot/uv"
  fi
  "$boot/uv/bin/python" -m pip install --disable-pip-version-check --no-cache-dir "uv==$UV_VERSION"
  UV_PYTHON_INSTALL_DIR="$boot/pythons" "$boot/uv/bin/uv" python install "$PYTHON_VERSION"
  exe=$(UV_PYTHON_INSTALL_DIR="$boot/pythons" "$boot/uv/bin/uv" python find --managed-python "$PYTHON_VERSION")
  mv "$(readlink -f "$("$exe" -c 'import sys; print(sys.base_prefix)')")" "$dest"
  rm -rf "$boot"
fi

"$dest/bin/python3.12" -c 'import bz2, ctypes, hashlib, lzma, sqlite3, ssl, sys, venv, zlib; print("python:", sys.version)'
