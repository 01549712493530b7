#!/usr/bin/env bash
# Fresh machine -> a tiny DeepSeek-V3 training on this CPU (the embedded default recipe).
# Extra arguments go to `maxtext-moe train`, e.g. scripts/run-default.sh steps=400
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$("$root/scripts/setup.sh" | tail -n 1)
exec "$py" -m maxtext_moe train "$@"
