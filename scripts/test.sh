#!/usr/bin/env bash
# Fresh machine -> the full test suite (CPU). Extra arguments go to pytest, e.g. scripts/test.sh -m "not slow"
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$("$root/scripts/setup.sh" | tail -n 1)
cd "$root"
exec "$py" -m pytest "$@"
