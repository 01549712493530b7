#!/usr/bin/env bash
# Create (or refresh) .venv-hf, the reference environment of the conversion tests (torch + transformers),
# apart from the product's .venv. Reinstalls only when requirements/hf-reference.txt changed.
# Usage: scripts/setup-hf-reference.sh   (prints the venv's python path last)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${MAXTEXT_MOE_HF_VENV:-$root/.venv-hf}
want=$(sha256sum "$root/requirements/hf-reference.txt" | cut -c1-16)
stamp="$venv/.maxtext-moe-installed"
# shellcheck source=scripts/python312.sh
source "$root/scripts/python312.sh"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    py=$(find_python) || py=""
    [ -n "$py" ] || { echo "setup-hf-reference: no Python 3.12 found on PATH or under pyenv" >&2; exit 2; }
    echo "setup-hf-reference: creating $venv with $py" >&2
    "$py" -m venv "$venv"
  fi
  echo "setup-hf-reference: installing torch + transformers into $venv (first time: about a minute)" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$root/requirements/hf-reference.txt"
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
