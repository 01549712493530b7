#!/usr/bin/env bash
# Fresh machine -> lint (ruff check, ruff format --check), then the full test suite (CPU), SLURM's included.
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not slow"; the tests run in three pytest-xdist workers on
# two cores, since the SLURM jobs and the fault tests spend much of their time waiting (a watchdog's timeout, SLURM's
# KillWait and requeue hold): about 20 minutes of pytest on a 2-core machine, the two CPUs about 60% busy. -n 0 for one.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The three installs download and unpack independently, so they run side by side (on a fresh clone, two cores: the
# two venvs, ruff and collection in 92 s, where the venvs alone took 149 s one after the other); each one's failure
# still stops the tests.
"$root/scripts/setup-hf-reference.sh" >/dev/null &  # torch + transformers for the conversion tests, apart from .venv
hf_reference=$!
"$root/scripts/setup-slurm.sh" &                    # SLURM and munge for the job tests (tests/slurm_cluster.py)
slurm=$!
py=$("$root/scripts/setup.sh" | tail -n 1)
wait "$hf_reference"
wait "$slurm"
cd "$root"
"$py" -m ruff check .
"$py" -m ruff format --check .
# Whole files to a worker (--dist loadfile): a file's module-scoped fixtures, such as test_slurm_job.py's cluster
# and uninterrupted reference job, then run once (pytest-xdist 3.8's loadgroup marks have no effect under pytest 9).
# Files go out in collection order, which tests/conftest.py starts with the longest (--no-loadscope-reorder);
# the 30 slowest tests are listed at the end.
exec "$py" -m pytest -n 3 --dist loadfile --no-loadscope-reorder --durations=30 "$@"
