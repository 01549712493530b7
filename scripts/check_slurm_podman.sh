#!/usr/bin/env bash
# Run the SLURM job of `maxtext-moe launch --runtime podman` once, inside the built image, under a real SLURM of two
# fake nodes on this machine (tests/slurm_cluster.py, the test suite's cluster), and print its output.
# Usage: scripts/check_slurm_podman.sh [IMAGE] [LOG]   (IMAGE: localhost/maxtext-moe:<version>; LOG: where the
# job's output is copied, default runs/slurm-podman-check.log). Needs root, podman (scripts/build_container.sh) and
# SLURM (scripts/setup-slurm.sh). Four CPU processes train the tiny recipe for 4 steps with FSDP across them.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml")
image=${1:-localhost/maxtext-moe:$version}
log=${2:-$root/runs/slurm-podman-check.log}
py=$("$root/scripts/setup.sh" | tail -n 1)
"$root/scripts/setup-slurm.sh"
podman image exists "$image" || { echo "check_slurm_podman: no image $image; run scripts/build_container.sh" >&2; exit 2; }
work=$(mktemp -d /tmp/maxtext-moe-podman-job.XXXXXX)
chmod 755 "$work"  # munged (user munge) keeps its socket below it
mkdir -p "$work/runs" "$(dirname "$log")"
chmod 1777 "$work/runs"  # the image runs as uid 1000 and writes its run folder here
# This machine kind's hard limits are below podman's defaults for a container (docs/CLUSTER.md, section 2).
printf '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]\n[engine]\nruntime = "runc"\n' \
  > "$work/containers.conf"
"$py" -m maxtext_moe launch deepseek3-tiny-cpu --slurm --nodes 2 --tasks-per-node 2 --runtime podman \
  --image "$image" ici_fsdp_parallelism=-1 > "$work/train.sbatch"
cd "$root/tests"
"$py" - "$work" "$log" <<'EOF'
import os, shutil, sys, time
from pathlib import Path

import slurm_cluster
from maxtext_moe.run.distributed import free_port

work, log = Path(sys.argv[1]), Path(sys.argv[2])
cluster = slurm_cluster.Cluster(work / "slurm").start()
try:
    env = {"RUNS": str(work / "runs"), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
           "CONTAINERS_CONF": str(work / "containers.conf")}
    start = time.time()
    job = cluster.sbatch(work / "train.sbatch", "steps=4", "per_device_batch_size=1", "max_target_length=64",
                         "base_num_decoder_layers=2", "mtp_num_layers=0", env=env)
    state = cluster.wait(job, 1800)
    out = (work / f"mtm-deepseek3-tiny-cpu-{job}.out").read_text()
    shutil.copy(work / "train.sbatch", log.with_suffix(".sbatch"))
    log.write_text(out)
    print(out)
    print(f"job {job}: {state} in {time.time() - start:.0f} s; output in {log}")
    sys.exit(0 if state == "COMPLETED" else 1)
finally:
    cluster.stop()
EOF
