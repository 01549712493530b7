"""Orbax writes an array that arrives in slices, one slice in memory at a time.

The gap: Orbax's `NumpyHandler` writes a whole numpy array, and MaxText's `to_maxtext.LazyTensorHandler` only
delays building that whole array until Orbax writes it. A scanned DeepSeek-V3 stacks every layer's (and every
expert's) tensor into one array, e.g. the routed experts' `wi_0` is 58 x 256 x 7168 x 2048 (436 GB in BF16),
assembled from thousands of Hugging Face tensors in different shards. `SlicedArrayHandler` overrides the
handler's `_open_and_write` (orbax-checkpoint==0.12.4): it opens the tensorstore Orbax specified, with one
chunk per slice (so no chunk is read back and rewritten), and writes the slices as `SlicedArray.slices()`
yields them. One array is written at a time (Orbax would start every array's write at once). The checkpoint
is Orbax's own, with Orbax's metadata, read back by `ocp` and MaxText like any other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
            t = await ts.open(ts.Spec(_with_chunks(tspec, value.chunk)), create=True, open=True, context=ts_context)
            for index, block in value.slices():
                await t[index].write(block)
        return None


def register() -> None:
    """Orbax writes every `SlicedArray` leaf with `SlicedArrayHandler` from now on in this process."""
    type_handlers.register_type_handler(SlicedArray, SlicedArrayHandler(), override=True)
