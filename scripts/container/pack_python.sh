#!/usr/bin/env bash
# shellcheck disable=SC2016 # $ORIGIN in single quotes is for the dynamic loader, not the shell
# Pack this machine's CPython 3.12 (pyenv's, or any built with a shared libpython) into a relocatable archive the
# Dockerfile installs instead of downloading python-build-standalone's (build arg PYTHON_DIST): for builds that
# cannot reach GitHub. Like python-build-standalone's install_only archives, the result needs only glibc from the
# base: the shared libraries its modules link (OpenSSL, libffi, SQLite, ...) are copied in and every ELF file finds
# them through an $ORIGIN-relative RUNPATH. Left out: tests, IDLE, Tk, readline and curses (interactive use only),
# and everything installed into site-packages (the venv has its own; ensurepip stays).
# The archive needs a base whose glibc is at least this machine's (it prints both).
# Usage: scripts/container/pack_python.sh [PYTHON]
#   writes scripts/container/dist/cpython-<version>-<glibc>.tar.gz and prints its file name
# Needs: patchelf (apt-get install patchelf)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=scripts/python312.sh
source "$root/scripts/python312.sh"
py=${1:-$(find_python)} || { echo "pack_python: no Python 3.12 found on PATH or under pyenv" >&2; exit 2; }
command -v patchelf >/dev/null || { echo "pack_python: patchelf is not installed (apt-get install patchelf)" >&2; exit 2; }
read -r version prefix < <("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3], sys.base_prefix)')
[ "${version%.*}" = 3.12 ] || { echo "pack_python: $py is Python $version, not 3.12" >&2; exit 2; }
glibc=$(ldd --version | sed -n '1s/.* \([0-9][0-9.]*\)$/\1/p')
name="cpython-$version-glibc$glibc.tar.gz"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dest="$work/python"
mkdir -p "$dest/bin" "$dest/lib" "$dest/include"
cp -a "$prefix/include/python3.12" "$dest/include/"
cp -a "$prefix/lib/python3.12" "$dest/lib/"
cp -a "$prefix"/lib/libpython3.12.so* "$prefix/lib/libpython3.so" "$dest/lib/"
cp -a "$prefix/bin/python3.12" "$dest/bin/"
ln -s python3.12 "$dest/bin/python3"
ln -s python3.12 "$dest/bin/python"
std="$dest/lib/python3.12"
rm -rf "$std/test" "$std/idlelib" "$std/tkinter" "$std/turtledemo" "$std/turtle.py"
find "$std/site-packages" -mindepth 1 -maxdepth 1 ! -name README.txt -exec rm -rf {} +
rm -f "$std"/lib-dynload/{_tkinter,readline,_curses,_curses_panel,_dbm,_gdbm}.cpython-312-*.so
find "$dest" -name __pycache__ -type d -prune -exec rm -rf {} +

# Copy in every shared library the interpreter and its modules link, except glibc's own and libpython.
elfs=("$dest/bin/python3.12" "$dest/lib/libpython3.12.so.1.0" "$std"/lib-dynload/*.so)
ldd "${elfs[@]}" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r soname path; do
    case "$soname" in
      libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libutil.so.*|ld-linux*|libpython3*) ;;
      *) cp -L "$path" "$dest/lib/$soname" ;;
    esac
  done
if ldd "${elfs[@]}" 2>/dev/null | grep -q 'not found'; then
  echo "pack_python: $py links a library this machine lacks:" >&2
  ldd "${elfs[@]}" | grep 'not found' >&2
  exit 1
fi
patchelf --set-rpath '$ORIGIN/../lib' "$dest/bin/python3.12"
for lib in "$dest"/lib/*.so*; do
  [ -L "$lib" ] || patchelf --set-rpath '$ORIGIN' "$lib"
done
for mod in "$std"/lib-dynload/*.so; do
  patchelf --set-rpath '$ORIGIN/../..' "$mod"
done

# Relocated, with nothing of this machine's library path: the modules the project needs import.
mv "$dest" "$work/moved"
env -i "$work/moved/bin/python3.12" -c \
  'import bz2, ctypes, hashlib, lzma, sqlite3, ssl, venv, zlib, ensurepip, sys; print(sys.version)' >&2
mv "$work/moved" "$dest"

mkdir -p "$here/dist"
tar -C "$work" -czf "$here/dist/$name" python
echo "pack_python: $py (CPython $version, built on glibc $glibc) -> scripts/container/dist/$name" >&2
echo "$name"
