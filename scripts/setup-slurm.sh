#!/usr/bin/env bash
# Install SLURM (slurmctld, slurmd, the client commands) and munge from Debian's packages when they are missing, for
# the tests that run jobs under a real scheduler (tests/slurm_cluster.py starts and stops its own daemons; nothing
# here starts a service). Without root or apt-get it says so, and those tests skip.
set -euo pipefail
if command -v sbatch >/dev/null && [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "setup-slurm: SLURM is not installed and this is not root with apt-get; the SLURM job tests will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
