"""Room for a checkpoint: the size of one, the filesystem it goes to, and a check before training starts.

The gap: MaxText starts training whatever room the output filesystem has, and the first checkpoint
save on a full disk fails after compilation and the first steps, as a chain of Orbax writer-thread
errors. The size comes from the planner's parameter count (`plan.model`) and dtypes (`plan.layout`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from maxtext_moe.errors import UserError
from maxtext_moe.recipe.resolved import ResolvedRecipe


def human(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def checkpoint_bytes(resolved: ResolvedRecipe) -> int | None:
    """About one checkpoint's bytes: the parameters in weight_dtype plus the optimizer state (Adam's mu in
    mu_dtype and nu in weight_dtype; sgd keeps none). An upper bound: Orbax compresses the chunks with zstd,
    and moments early in a run compress well (the tiny recipe's 5.4M parameters: 64 MB estimated, 44 MB
    written after 5 steps). None for a model the planner does not describe."""
    from maxtext_moe.plan import layout
    from maxtext_moe.plan.model import Model

    try:
        model = Model.from_recipe(resolved)
    except UserError:
        return None
    lay = layout.from_recipe(resolved)
    optimizer = 0 if resolved.effective("opt_type") == "sgd" else lay.mu_bytes + lay.weight_bytes
    return model.total_params * (lay.weight_bytes + optimizer)


@dataclass(frozen=True)
class Filesystem:
    device: str
    mount: Path
    free: int
    size: int

    def __str__(self) -> str:
        return f"{self.device} (mounted on {self.mount}, {human(self.free)} free of {human(self.size)})"


def filesystem(path: Path) -> Filesystem:
    """The filesystem `path` is (or will be) written to: its device as /proc/mounts names it, and its room."""
    existing = path.resolve()
    while not existing.exists():
        existing = existing.parent
    mount = existing
    while not os.path.ismount(mount):
        mount = mount.parent
    device = str(mount)
    mounts = Path("/proc/mounts")
    if mounts.is_file():
        for line in mounts.read_text().splitlines():
            fields = line.split()
            if len(fields) > 1 and fields[1].replace("\\040", " ") == str(mount):
                device = fields[0]  # the last entry for a mount point is the one on top
    st = os.statvfs(existing)
    return Filesystem(device, mount, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


def require_room(resolved: ResolvedRecipe, output: Path) -> None:
    """Refuse to start when `output`'s filesystem cannot hold one more checkpoint (before anything is written)."""
    if not resolved.effective("enable_checkpointing"):
        return
    need = checkpoint_bytes(resolved)
    if need is None:
        return
    fs = filesystem(output)
    if fs.free < need:
        raise UserError(
            f"{output} is on {fs}, and one checkpoint of this model (parameters and optimizer state) "
            f"needs up to {human(need)}.",
            key="base_output_directory",
            source=resolved.sources.get("maxtext.base_output_directory"),
            fix=f"free space on {fs.mount}, or set base_output_directory=DIR on a filesystem with room for "
            "at least one checkpoint (Orbax keeps max_num_checkpoints_to_keep of them).",
        )
