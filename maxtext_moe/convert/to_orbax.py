"""`convert hf-to-orbax`: a Hugging Face DeepSeek-V3 checkpoint -> the Orbax checkpoint a recipe trains from.

MaxText's `to_maxtext.py` holds the whole model in host memory (eagerly, or one whole stacked array at a time
with `--lazy_load_tensors`, which for a scanned 671B model is a 436 GB array), and needs the FP8 weights
dequantized to a BF16 copy first. Here each Hugging Face tensor is read, dequantized, transposed by MaxText's
hook and written into its slot of the Orbax array (`upstream.orbax_stream`) before the next is read.

Host memory: the process's baseline (JAX, MaxText, the abstract model) plus about 3x the largest single Hugging
Face tensor in float32 (the raw tensor, its float32 copy, the block in the target dtype) plus 48 MiB, whatever
the layout and the model's size (measured in tests/e2e/test_convert.py; docs/CONVERT.md).

Crash safety: everything is written under `OUT.partial/`, renamed to `OUT` only when Orbax has finished; a
re-run removes a stale `OUT.partial/` and starts again. `OUT` is an Orbax step folder (`load_parameters_path`).
"""

from __future__ import annotations

import json
import resource
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from maxtext_moe.convert import hf_config, layout, staging
from maxtext_moe.convert.hf_checkpoint import HfCheckpoint
from maxtext_moe.convert.progress import Progress
from maxtext_moe.errors import UserError
from maxtext_moe.recipe.resolved import ResolvedRecipe

MARKER = "maxtext_moe_conversion.json"


def _blocks(target: layout.Target, hf: HfCheckpoint, progress: Progress) -> Iterator[tuple[tuple, np.ndarray]]:
    from maxtext.checkpoint_conversion.utils.tensor_handling import apply_hook_fns

    for s in target.slices:
        block = apply_hook_fns(hf.get(s.hf_key), s.shape, target.hook)
        if block.shape != s.shape:
            raise UserError(
                f"{hf.folder}: {s.hf_key} gives shape {block.shape}, MaxText's {target.key} wants {s.shape} there.",
                fix="check that the recipe describes this checkpoint's model.",
            )
        block = block.astype(target.dtype)
        progress.add(block.nbytes)
        yield s.index, block


def _nest(flat: dict[str, object]) -> dict[str, object]:
    """`"params-decoder-x"` keys -> MaxText's nested collections."""
    tree: dict[str, object] = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split("-")
        for p in parents:
            node = node.setdefault(p, {})  # type: ignore[assignment]
        node[leaf] = value
    return tree


def convert(src: Path, out: Path, resolved: ResolvedRecipe, log: Callable[[str], None] = print) -> Path:
    """Write `out` (an Orbax step folder) from the Hugging Face checkpoint `src`, for `resolved`'s model."""
    staging.refuse_existing(out)
    hf = HfCheckpoint(src)
    hf_config.check(hf.config, resolved, str(src / "config.json"))
    for shard in hf.shards():
        hf.header(shard)  # every shard readable and whole before anything is written

    import orbax.checkpoint as ocp

    from maxtext_moe.upstream import maxtext_params, orbax_stream

    mt_config, params = maxtext_params.abstract(resolved)
    targets = layout.targets(hf.config, mt_config, params)
    for t in targets:  # every source tensor listed in the index, before anything is written
        for s in t.slices:
            hf.shard_of(s.hf_key)
    total = sum(int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize for t in targets)
    progress = Progress(total, sum(len(t.slices) for t in targets), log)
    orbax_stream.register()
    leaves = {
        t.key: orbax_stream.SlicedArray(t.shape, np.dtype(t.dtype), t.chunk, lambda t=t: _blocks(t, hf, progress))
        for t in targets
    }
    partial = staging.fresh_partial(out, log)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    log(
        f"convert: {src} ({hf.total_bytes() / 2**30:,.2f} GiB in {len(hf.shards())} shard(s)) -> {out}; "
        f"host memory before writing {baseline / 2**20:,.0f} MiB"
    )
    with ocp.CheckpointManager(partial, item_names=("items",)) as manager:  # OCDBT + zarr3, as MaxText's
        manager.save(0, args=ocp.args.Composite(items=ocp.args.PyTreeSave({"params": _nest(leaves)})))
    (partial / "0" / MARKER).write_text(
        json.dumps({"source": str(src), "recipe": resolved.name} | resolved.checkpoint_identity(), indent=2)
    )
    (partial / "0").rename(out)
    shutil.rmtree(partial)
    log(f"convert: done; train from it with: maxtext-moe train {resolved.name} load_parameters_path={out}")
    return out
