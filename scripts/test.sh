#!/usr/bin/env bash
# Fresh machine -> lint (ruff check, ruff format --check), then the full test suite (CPU).
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not slow"
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$("$root/scripts/setup.sh" | tail -n 1)
cd "$root"
"$py" -m ruff check .
"$py" -m ruff format --check .
"$root/scripts/setup-hf-reference.sh" >/dev/null  # torch + transformers for the conversion tests, apart from .venv
exec "$py" -m pytest "$@"
