"""Orbax writes an array that arrives in slices, one slice in memory at a time.

The gap: Orbax's `NumpyHandler` writes a whole numpy array, and MaxText's `to_maxtext.LazyTensorHandler` only
delays building that whole array until Orbax writes it. A scanned DeepSeek-V3 stacks every layer's (and every
expert's) tensor into one array, e.g. the routed experts' `wi_0` is 58 x 256 x 7168 x 2048 (436 GB in BF16),
assembled from thousands of Hugging Face tensors in different shards. `SlicedArrayHandler` overrides the
handler's `_open_and_write` (orbax-checkpoint==0.12.4): it opens the tensorstore Orbax specified, with one
chunk per slice (so no chunk is read back and rewritten), and writes the slices as `SlicedArray.slices()`
yields them. One array is written at a time (Orbax would start every array's write at once). The checkpoint
is Orbax's own, with Orbax's metadata, read back by `ocp` and MaxText like any other.

Orbax's tensorstore context gives the OCDBT kvstore a 100 MB cache pool (B-tree nodes kept for re-reads when
restoring); a write-once conversion has no use for it, and filled, it held host memory that grew with the bytes
written. The arrays are opened in a child of Orbax's context whose pool (the one the kvstore spec names) holds
nothing, so host memory stays at one slice in flight.

Reading back (`ArrayReader`): Orbax restores whole arrays only. The arrays of a checkpoint are opened with the
tensorstore spec Orbax itself reads them with (`get_json_tspec_read`), so one slice at a time can be read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts
from orbax.checkpoint import type_handlers

Index = tuple[int | slice, ...]


@dataclass(eq=False)
class SlicedArray:
    """An array of `shape` whose contents `slices()` yields as (index, block); `chunk` is one block's extent
    (1 on the stacked axes)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunk: tuple[int, ...]
    slices: Callable[[], Iterator[tuple[Index, np.ndarray]]]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __deepcopy__(self, memo: dict) -> SlicedArray:  # Orbax copies values before its background write
        return self


class _WithoutCache:
    """Children of Orbax's tensorstore contexts in which the cache pool that a spec's kvstore names (Orbax's OCDBT
    pool) is limited to 0 bytes; one child per context, so that every array of a checkpoint shares one kvstore."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, str], tuple[ts.Context, ts.Context]] = {}

    def __call__(self, tspec: dict[str, Any], parent: ts.Context) -> ts.Context:
        pool = tspec.get("kvstore", {}).get("cache_pool")
        if pool is None:
            return parent
        made = self._made.get((id(parent), pool))
        if made is None or made[0] is not parent:
            made = (parent, ts.Context(ts.Context.Spec({pool: {"total_bytes_limit": 0}}), parent))
            self._made[(id(parent), pool)] = made
        return made[1]


_without_cache = _WithoutCache()


def _with_chunks(tspec: dict[str, Any], chunk: tuple[int, ...]) -> dict[str, Any]:
    """Orbax's write spec with zarr chunks (v2 `chunks`, v3 grid and shard codec) of `chunk`."""
    meta = dict(tspec["metadata"])
    if "chunk_grid" in meta:
        meta["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": list(chunk)}}
        codecs = [dict(c) for c in meta.get("codecs", [])]
        for c in codecs:
            if c.get("name") == "sharding_indexed":
                c["configuration"] = dict(c["configuration"], chunk_shape=list(chunk))
        meta["codecs"] = codecs
    else:
        meta["chunks"] = list(chunk)
    return dict(tspec, metadata=meta)


class SlicedArrayHandler(type_handlers.NumpyHandler):
    """`NumpyHandler` for `SlicedArray`: same on-disk format, written slice by slice."""

    def __init__(self) -> None:
        super().__init__()
        self._one_at_a_time: asyncio.Lock | None = None

    async def _open_and_write(self, value: Any, tspec: dict[str, Any], ts_context: Any) -> None:
        if not isinstance(value, SlicedArray):
            return await super()._open_and_write(value, tspec, ts_context)
        self._one_at_a_time = self._one_at_a_time or asyncio.Lock()
        async with self._one_at_a_time:
            spec = ts.Spec(_with_chunks(tspec, value.chunk))
            t = await ts.open(spec, create=True, open=True, context=_without_cache(tspec, ts_context))
            for index, block in value.slices():
                await t[index].write(block)
        return None


def register() -> None:
    """Orbax writes every `SlicedArray` leaf with `SlicedArrayHandler` from now on in this process."""
    type_handlers.register_type_handler(SlicedArray, SlicedArrayHandler(), override=True)


class ArrayReader:
    """The arrays of the Orbax checkpoint folder `items` (zarr or zarr3, OCDBT or not), opened by their Orbax
    name (`params.params.decoder...`) for reads of a slice at a time."""

    def __init__(self, items: Path):
        import orbax.checkpoint as ocp
        from etils import epath

        self.items = epath.Path(items)
        self.use_zarr3 = bool(ocp.PyTreeCheckpointHandler().metadata(self.items).use_zarr3)
        self.use_ocdbt = bool(type_handlers.is_ocdbt_checkpoint(self.items))
        self.context = type_handlers.get_ts_context(use_ocdbt=self.use_ocdbt)

    def open(self, name: str) -> ts.TensorStore:
        """Array `name`; a missing array raises ValueError (tensorstore's NOT_FOUND)."""
        info = type_handlers.ParamInfo(
            name=name, parent_dir=self.items, use_zarr3=self.use_zarr3, is_ocdbt_checkpoint=self.use_ocdbt
        )
        tspec = type_handlers.get_json_tspec_read(info, use_ocdbt=self.use_ocdbt)
        return ts.open(ts.Spec(tspec), open=True, read=True, context=_without_cache(tspec, self.context)).result()
