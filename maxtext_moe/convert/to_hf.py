"""`convert orbax-to-hf`: a training run's Orbax checkpoint (or a converted folder) -> Hugging Face safetensors.

MaxText's `to_huggingface.py` restores the whole training state into host memory, then transforms and saves
the model at once (1.3 TB for DeepSeek-V3 in BF16). Here each Hugging Face tensor is read as one slot of its
Orbax array (`upstream.orbax_stream.ArrayReader`), turned back by MaxText's own hooks (`saving_to_hf`), cast
to BF16 and written straight into its place in a safetensors shard whose header was written first. Only the
parameters are read; the optimizer state beside them is never opened.

Host memory: the process's baseline plus the slot being converted (the stored block, its Hugging Face layout,
its BF16 copy) and the tensorstore chunk that holds it, within the bound `to_orbax` states, whatever the model's
size (measured in tests/e2e/test_convert.py; docs/CONVERT.md).

Crash safety: shards, index and config.json are written under `OUT.partial/` and renamed to `OUT` when all are
complete; a re-run removes a stale `OUT.partial/` and starts again.
"""

from __future__ import annotations

import json
import resource
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from maxtext_moe.convert import hf_config, layout, staging
from maxtext_moe.convert.hf_checkpoint import INDEX
from maxtext_moe.convert.progress import Progress
from maxtext_moe.convert.safetensors_io import ShardWriter
from maxtext_moe.convert.to_orbax import MARKER
from maxtext_moe.errors import UserError
from maxtext_moe.recipe.resolved import ResolvedRecipe
from maxtext_moe.run import run_dir

if TYPE_CHECKING:
    import tensorstore as ts

    from maxtext_moe.upstream.orbax_stream import ArrayReader

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)  # the router's e_score_correction_bias, as DeepSeek ships it


def find_items(src: Path, step: int | None) -> tuple[Path, Path | None]:
    """The Orbax `items` folder to read: `src/checkpoints/STEP/items` of a run (latest complete step by
    default), or `src/items` of a converted folder; and the file that records which model wrote it."""
    if (src / "items" / "_METADATA").is_file():
        if step is not None:
            raise UserError(f"{src} is one checkpoint, not a run folder; it has no steps.", fix="drop --step.")
        return src / "items", src / MARKER
    found = run_dir.scan(src / "checkpoints")
    if not found.complete:
        raise UserError(
            f"{src}: no complete checkpoint (neither items/_METADATA nor checkpoints/N/items).",
            fix="pass a run folder (runs/RECIPE) that has saved a checkpoint, or a folder hf-to-orbax wrote.",
        )
    if step is None:
        step = found.latest
    elif step not in found.complete:
        raise UserError(
            f"{src}: no complete checkpoint for step {step}; complete steps: {found.complete}.",
            fix=f"pass one of them with --step, or leave --step out for the latest ({found.latest}).",
        )
    return src / "checkpoints" / str(step) / "items", src / run_dir.IDENTITY


def _check_identity(record: Path | None, resolved: ResolvedRecipe) -> None:
    """Refuse a checkpoint that a recorded, different model wrote (its shapes would not be the recipe's)."""
    if record is None or not record.is_file():
        return
    wrote = json.loads(record.read_text())
    want = resolved.checkpoint_identity()
    if wrote.get("model_digest") not in (None, want["model_digest"]):
        have = wrote.get("model", {})
        differ = [f"{k} {have.get(k)} there, {v} here" for k, v in sorted(want["model"].items()) if have.get(k) != v]
        raise UserError(
            f"{record}: the checkpoint holds recipe {wrote.get('recipe')!r}'s model, not the one --recipe and the "
            f"overrides give ({'; '.join(differ[:4]) or 'another model'}).",
            fix=f"pass --recipe {wrote.get('recipe')} with the overrides it was trained or converted with.",
        )


def _dtype(hf_key: str) -> np.dtype:
    return F32 if hf_key.endswith("e_score_correction_bias") else BF16


def _plan(targets: list[layout.Target], shapes: dict, copies: dict) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """Every Hugging Face tensor in the order it will be written: name, shape, dtype."""
    out = []
    for t in targets:
        for s in t.slices:
            out += [(key, shapes[s.hf_key], _dtype(s.hf_key)) for key in [s.hf_key, *copies.get(s.hf_key, [])]]
    return out


def _shards(plan: list, max_bytes: int) -> list[list]:
    """Consecutive runs of `plan` of at most `max_bytes` each (a larger tensor has a shard of its own)."""
    shards: list[list] = [[]]
    size = 0
    for entry in plan:
        nbytes = int(np.prod(entry[1], dtype=np.int64)) * entry[2].itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _open(reader: ArrayReader, target: layout.Target, items: Path) -> ts.TensorStore:
    """The stored array of `target`, checked against the recipe's shape."""
    names = layout.orbax_names(target.key)
    fix = "pass the recipe (and overrides) this checkpoint was trained or converted with."
    for name in names:
        try:
            array = reader.open(name)
        except ValueError:
            continue
        if tuple(array.shape) != target.shape:
            shape = tuple(array.shape)
            raise UserError(f"{items}: {name} has shape {shape}, the recipe's model wants {target.shape}.", fix=fix)
        return array
    raise UserError(f"{items}: no array {' or '.join(map(repr, names))}, which the recipe's model has.", fix=fix)


def convert(
    src: Path,
    out: Path,
    resolved: ResolvedRecipe,
    step: int | None = None,
    max_shard_bytes: int = 5 * 2**30,
    log: Callable[[str], None] = print,
) -> Path:
    """Write `out` (config.json, safetensors shards, their index) from the Orbax checkpoint under `src`."""
    staging.refuse_existing(out)
    items, record = find_items(src, step)
    _check_identity(record, resolved)

    from maxtext.checkpoint_conversion.utils.tensor_handling import apply_hook_fns

    from maxtext_moe.upstream import maxtext_params, orbax_stream

    config = hf_config.for_recipe(resolved)
    mt_config, params = maxtext_params.abstract(resolved)
    targets = layout.targets(config, mt_config, params, to_hf=True)
    shapes = layout.hf_shapes(config, int(mt_config.mtp_num_layers))
    copies = layout.mtp_copies(config, int(mt_config.mtp_num_layers))
    reader = orbax_stream.ArrayReader(items)
    arrays = {}
    for t in targets:  # every array present with the recipe's shape, before anything is written
        arrays[t.key] = _open(reader, t, items)
    plan = _plan(targets, shapes, copies)
    shards = _shards(plan, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    partial = staging.fresh_partial(out, log)
    partial.mkdir(parents=True)
    total = sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for _, shape, dtype in plan)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    log(
        f"convert: {items} -> {out} ({total / 2**30:,.2f} GiB in {len(shards)} shard(s)); "
        f"host memory before writing {baseline / 2**20:,.0f} MiB"
    )
    progress = Progress(total, len(plan), log)
    writers = (ShardWriter(partial / n, s) for n, s in zip(names, shards, strict=True))  # each opened when due
    writer = next(writers)
    for t in targets:
        for s in t.slices:
            block = np.asarray(arrays[t.key][s.index].read().result())
            tensor = np.asarray(apply_hook_fns(block, shapes[s.hf_key], t.hook)).astype(_dtype(s.hf_key))
            for key in [s.hf_key, *copies.get(s.hf_key, [])]:
                if not writer.pending:
                    writer = next(writers)
                writer.write(key, tensor)
                progress.add(tensor.nbytes)
    weight_map = {key: name for name, shard in zip(names, shards, strict=True) for key, _, _ in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (partial / INDEX).write_text(json.dumps(index, indent=2))
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    partial.rename(out)
    log(f"convert: done; load it with transformers' AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return out
