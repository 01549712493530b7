"""Hardware profiles: the facts about a device kind that checks and estimates need.

MaxText knows only `hardware=gpu|cpu|tpu`; it cannot tell a Hopper from a Blackwell, so it cannot
refuse MXFP8 experts on an H200 before compiling. These profiles fill that gap. Figures are the
vendors' published dense (no sparsity) peaks; `measured_*` fields are
rates measured on the lent H200 and are used only where stated.

Device memory is the total CUDA reports (`cudaMemGetInfo`, PyTorch's "total capacity"), the figure
XLA_PYTHON_CLIENT_MEM_FRACTION takes its share of: the vendors' "141 GB" is about 139.8 GiB on an H200,
not the 131.3 GiB that 141 x 10^9 bytes would be.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    maxtext_hardware: str  # MaxText's `hardware` key for this device kind
    compute_capability: tuple[int, int] | None
    peak_bf16_tflops: float
    peak_fp8_tflops: float | None  # None: no FP8 matrix units
    cuda_memory_gib: float  # total device memory CUDA reports, which XLA's allocator takes its fraction of
    hbm_tbps: float
    intra_node_gbps: float  # per direction, per device (NVLink)
    inter_node_gbps: float  # per direction, per device (network)
    host_link_gbps: float  # per direction, device <-> host memory
    gpus_per_node: int  # GPUs per host (one process each, or one process per host)
    mxfp8: bool  # block-scaled FP8 (Blackwell and later)
    nvlink_domain: int  # GPUs that reach each other at intra_node_gbps (NVL72 racks span 18 hosts)
    host_mem_gb: float  # host memory per GPU (DGX H100/H200: 2 TB per 8 GPUs; Grace: 480 GB per 2 GPUs)

    @property
    def fp8(self) -> bool:
        return self.peak_fp8_tflops is not None


PROFILES: dict[str, Hardware] = {
    p.name: p
    for p in (
        Hardware("cpu", "cpu", None, 0.0, None, 0.0, 0.0, 0.0, 0.0, 0.0, 1, False, 1, 0.0),
        # CUDA's totals: the H200's read off the lent one (cuDeviceTotalMem 139.80 GiB,
        # docs/results/h200_device_memory_2026-12-02.txt; XLA's allocator had 123.03 GiB at 0.88); the others are the
        # "total capacity" PyTorch's out-of-memory errors print on them (H100 SXM 80 GB 79.11 GiB, GB200
        # 184.31, GB300 276.50 on a DGX Station), as public issue threads quote them.
        Hardware("h100", "gpu", (9, 0), 989.0, 1979.0, 79.11, 3.35, 450.0, 50.0, 64.0, 8, False, 8, 256.0),
        Hardware("h200", "gpu", (9, 0), 989.0, 1979.0, 139.81, 4.8, 450.0, 50.0, 64.0, 8, False, 8, 256.0),
        Hardware("gb200", "gpu", (10, 0), 2500.0, 5000.0, 184.31, 8.0, 900.0, 100.0, 450.0, 4, True, 72, 240.0),
        Hardware("gb300", "gpu", (10, 3), 2500.0, 5000.0, 276.50, 8.0, 900.0, 100.0, 450.0, 4, True, 72, 240.0),
    )
}


def profile(name: str) -> Hardware:
    """The profile called `name`; a `KeyError` names the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown hardware {name!r}; known: {', '.join(sorted(PROFILES))}") from None
