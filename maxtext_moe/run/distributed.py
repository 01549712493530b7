"""Who am I in a multi-process run, and starting `jax.distributed` before any device is touched.

MaxText's own start-up (`max_utils.maybe_initialize_jax_distributed_system`) knows only its GPU
variables (`JAX_COORDINATOR_IP`, `NNODES`, `NODE_RANK`) and, for CPUs, explicit arguments; it
knows nothing of Kubernetes indexed Jobs, does not check the process count against the recipe,
and it runs after our run-folder and corpus writes, which several processes must not race on.
Our recipes set `skip_jax_distributed_system: true` and this module does it instead, from one of:

- plain environment (highest precedence): `JAX_COORDINATOR_ADDRESS=host:port`, `JAX_NUM_PROCESSES`,
  `JAX_PROCESS_ID` (and optionally JAX's own `JAX_LOCAL_DEVICE_IDS=0,1`);
- Kubernetes indexed Job / JobSet: `JOB_COMPLETION_INDEX` is the process id, unless the pod starts
  several processes and gives each its `JAX_PROCESS_ID` (what `launch --k8s` renders); the manifest sets
  `JAX_COORDINATOR_ADDRESS` to pod 0 behind the headless Service
  (`<job>-0.<service>:<port>`) and `JAX_NUM_PROCESSES` (see scripts/k8s/, `maxtext-moe launch --k8s`);
- SLURM (`srun`): `SLURM_NTASKS`, `SLURM_PROCID`, `SLURM_LOCALID`, the first host of
  `SLURM_STEP_NODELIST`/`SLURM_JOB_NODELIST` on JAX's port rule (job id % 4096 + 61440).

Process layout. CPU recipes: one process per `topology.nodes`, each with `topology.gpus_per_node`
CPU devices (`--xla_force_host_platform_device_count`). GPU recipes: one process per GPU
(`nodes x gpus_per_node` processes, local device = the local rank) is what `launch --slurm`
and `launch --k8s` render, as JAX's SLURM detection and NVIDIA's JAX-Toolbox do: on two H200s one
process driving both GPUs hung in its first all-gather with expert parallelism 2 (MaxText's block and
ours), where one process per GPU trains (docs/PERFORMANCE.md). One process per node with all its GPUs
is accepted too. Anything else is refused.
"""

from __future__ import annotations

import os
import random
import re
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from maxtext_moe.errors import UserError
from maxtext_moe.recipe.resolved import Topology

SLURM_PORT_BASE = 65535 - 2**12 + 1  # JAX's SlurmCluster rule: port = job id % 4096 + this
DEFAULT_PORT = 8476
_KV_PREFIX = "maxtext-moe/leader-first/"
_FAILED = "failed: "


@dataclass(frozen=True)
class ProcessSpec:
    """This process's place in the job, as the launcher (or its absence) describes it."""

    source: str  # "single", "env", "kubernetes" or "slurm"
    num_processes: int
    process_id: int
    coordinator: str | None  # host:port of process 0; None for a single process
    local_device_ids: tuple[int, ...] | None  # None: every device this process can see

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    def per_process(self, path: Path) -> Path:
        """`path` for process 0; `name.process-K.ext` beside it for the others (their own log)."""
        return path if self.is_leader else path.with_name(f"{path.stem}.process-{self.process_id}{path.suffix}")


SINGLE = ProcessSpec("single", 1, 0, None, None)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: 'gpu[007-009,012],cpu1' -> 'gpu007'."""
    m = re.match(r"([^\[,]+)(?:\[([^\]\-,]+))?", nodelist.strip())
    if not m:
        raise UserError(
            f"cannot read the SLURM node list {nodelist!r}.",
            key="SLURM_JOB_NODELIST",
            fix="set JAX_COORDINATOR_ADDRESS=host:port to name the coordinator yourself.",
        )
    return m.group(1) + (m.group(2) or "")


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UserError(f"must be a whole number, got {env[name]!r}.", key=name, source="environment") from None


def detect(env: Mapping[str, str] | None = None) -> ProcessSpec:
    """Read the launcher's variables (no jax import). Precedence: plain env, Kubernetes, SLURM."""
    env = os.environ if env is None else env
    ids = env.get("JAX_LOCAL_DEVICE_IDS")
    local = tuple(int(i) for i in ids.split(",")) if ids else None
    if "JAX_PROCESS_ID" in env or "JOB_COMPLETION_INDEX" in env:
        source, id_var = (
            ("env", "JAX_PROCESS_ID") if "JAX_PROCESS_ID" in env else ("kubernetes", "JOB_COMPLETION_INDEX")
        )
        missing = [v for v in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES") if not env.get(v)]
        if missing:
            raise UserError(
                f"{id_var} is set but {' and '.join(missing)} not: a multi-process launch needs all three.",
                key=missing[0],
                source="environment",
                fix="export JAX_COORDINATOR_ADDRESS=<process-0 host>:<port> and JAX_NUM_PROCESSES=<count> "
                "(`maxtext-moe launch --k8s` renders them into the Job).",
            )
        return ProcessSpec(
            source, _int(env, "JAX_NUM_PROCESSES"), _int(env, id_var), env["JAX_COORDINATOR_ADDRESS"], local
        )
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:  # srun step of several tasks
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        coordinator = env.get("JAX_COORDINATOR_ADDRESS") or (
            f"{first_slurm_host(nodelist)}:{_int(env, 'SLURM_JOB_ID') % 2**12 + SLURM_PORT_BASE}"
        )
        tasks, nodes = _int(env, "SLURM_NTASKS"), _int(env, "SLURM_NNODES") if "SLURM_NNODES" in env else 1
        if local is None and tasks > nodes:  # several tasks per node: one GPU each, by local rank
            local = (_int(env, "SLURM_LOCALID"),)
        return ProcessSpec("slurm", tasks, _int(env, "SLURM_PROCID"), coordinator, local)
    return SINGLE


def check_layout(spec: ProcessSpec, topology: Topology) -> None:
    """Refuse a process count the recipe's topology cannot have been meant for."""
    hw = topology.profile
    allowed = {topology.nodes} if hw.maxtext_hardware == "cpu" else {topology.nodes, topology.num_devices}
    if spec.num_processes not in allowed:
        want = " or ".join(str(n) for n in sorted(allowed))
        raise UserError(
            f"the launcher ({spec.source}) started {spec.num_processes} process(es), but the recipe's topology "
            f"({topology.nodes} node(s) x {topology.gpus_per_node} {hw.name} device(s)) needs {want}.",
            key="topology.nodes",
            source="recipe",
            fix=f"launch {want} process(es) (`maxtext-moe launch RECIPE --nodes {topology.nodes}` renders the job), "
            f"or set topology.nodes to match the launcher.",
        )
    if not 0 <= spec.process_id < spec.num_processes:
        raise UserError(
            f"process id {spec.process_id} is outside 0..{spec.num_processes - 1}.",
            key="JAX_PROCESS_ID",
            source=spec.source,
            fix="number processes from 0.",
        )


def layout_warning(spec: ProcessSpec, topology: Topology, expert_parallel: bool) -> str | None:
    """A warning when one process drives several GPUs with expert parallelism: accepted, but on two H200s
    that layout hung in its first all-gather (MaxText's block and ours alike) where one process per GPU
    trained, so the user should hear it before waiting on a silent job."""
    several = spec.local_device_ids is None or len(spec.local_device_ids) > 1
    if (
        topology.profile.maxtext_hardware != "gpu"
        or not expert_parallel
        or topology.gpus_per_node == 1
        or not (several and spec.num_processes == topology.nodes)
    ):
        return None
    return (
        f"warning: one process drives {topology.gpus_per_node} GPUs with expert parallelism; on two H200s "
        "that layout hung in its first all-gather while one process per GPU trained. Start one process "
        "per GPU (docs/CLUSTER.md)."
    )


def process_env(topology: Topology, env: Mapping[str, str]) -> dict[str, str]:
    """Variables this process needs before jax starts: CPU device count per process in XLA_FLAGS."""
    if topology.profile.maxtext_hardware != "cpu" or topology.gpus_per_node == 1:
        return {}
    flag = f"--xla_force_host_platform_device_count={topology.gpus_per_node}"
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    return {"XLA_FLAGS": " ".join(flags + [flag])}


def initialize(topology: Topology | None, *, timeout_s: int = 300) -> ProcessSpec:
    """Detect this process's place, set its env, and start `jax.distributed` when there are several.

    Must run after the recipe's env is applied and before anything touches a device (MaxText
    included): jax reads XLA_FLAGS once, and `jax.distributed.initialize` refuses to run after a
    backend exists. `topology` None (a script without a recipe, e.g. benchmarks/bench_ep_dispatch.py): no
    layout check and no CPU device count; the launcher's variables alone decide.
    """
    spec = detect()
    if topology is not None:
        check_layout(spec, topology)
        os.environ.update(process_env(topology, os.environ))
    import jax

    if jax.distributed.is_initialized():  # a second run in the same process (tests, notebooks)
        return spec
    # A single process starts a one-process runtime on a free loopback port too: only then does JAX's
    # preemption notifier catch SIGTERM, which MaxText's `enable_autocheckpoint` turns into a checkpoint
    # at the next step and a clean stop (a scheduler's time limit or preemption loses nothing).
    coordinator = spec.coordinator or f"127.0.0.1:{free_port()}"
    # SLURM's local rank picks a GPU; a CPU process has its own devices, numbered from 0 whatever its rank.
    cpu = topology is not None and topology.profile.maxtext_hardware == "cpu"
    local = None if cpu or not spec.local_device_ids else list(spec.local_device_ids)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        initialization_timeout=timeout_s,
        local_device_ids=local,
    )
    return spec


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A loopback port nobody listens on now, for a coordinator on this machine (tests use it too).

    Chosen between the kernel's ephemeral range and JAX's SLURM ports, where Linux leaves a gap (61000-61439
    by default): a port the kernel hands out for a bind to port 0 is one it also gives to outgoing
    connections, so between this call and the coordinator's own bind, seconds later in another process,
    any connection on the machine (SLURM's daemons talk on loopback all the time) may take it, and the
    coordinator fails to start. Elsewhere, or with no gap, the kernel's choice."""
    try:
        high = int(EPHEMERAL_RANGE.read_text().split()[1])
    except (OSError, IndexError, ValueError):
        high = SLURM_PORT_BASE
    candidates = list(range(high + 1, SLURM_PORT_BASE))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def leader_first(spec: ProcessSpec, step: str, *, timeout_s: int = 600) -> Iterator[None]:
    """Run the body on process 0 first; the others run it once process 0 has finished it.

    The run-folder guard and the corpus write to a shared folder; run by several processes at
    once they would race (truncated identity files, one process deleting another's partial
    corpus). Process 0's outcome travels through jax.distributed's key-value store, so when it
    fails the others stop with its message instead of waiting out a barrier timeout.
    """
    if spec.num_processes == 1:
        yield
        return
    from maxtext_moe.upstream import jax_coordination

    client = jax_coordination.client()
    key = _KV_PREFIX + step
    if spec.is_leader:
        try:
            yield
        except BaseException as e:
            client.key_value_set(key, f"{_FAILED}{e}")
            raise
        client.key_value_set(key, "ok")
        return
    outcome = client.blocking_key_value_get(key, timeout_s * 1000)
    if outcome.startswith(_FAILED):
        told = outcome[len(_FAILED) :]  # process 0's own message, with its fix when it has one
        raise UserError(
            f"process 0 failed while preparing the {step}: {told}",
            fix=None if " Fix: " in told else "see process 0's message; this process stopped with it.",
        )
    yield


def quiet(_: str) -> None:
    """The progress printer of processes other than 0: one terminal line per step, not N."""
