#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment with the pinned CPU dependencies.
# Finds Python 3.12 on PATH, then under pyenv; reinstalls only when the lock file changed.
# Usage: scripts/setup.sh        (prints the venv's python path last)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${MAXTEXT_MOE_VENV:-$root/.venv}

# shellcheck source=scripts/python312.sh
source "$root/scripts/python312.sh"

if [ ! -x "$venv/bin/python" ]; then
  py=$(find_python) || { echo "setup: no Python 3.12 found on PATH or under pyenv; install one (MaxText needs >= 3.12)" >&2; exit 2; }
  echo "setup: creating $venv with $py" >&2
  "$py" -m venv "$venv"
fi
want=$(cat "$root/requirements/cpu.lock" "$root/pyproject.toml" | sha256sum | cut -c1-16)
stamp="$venv/.maxtext-moe-installed"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing pinned dependencies into $venv (first time: a minute or two)" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$root/requirements/cpu.lock"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$root"
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
