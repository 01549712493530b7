"""A Hugging Face checkpoint folder (config.json, safetensors shards, their index), read one tensor at a time.

transformers' `from_pretrained` (and MaxText's `to_maxtext.py`, which calls it or loads shards whole) builds
the model in host memory; this reads the index, keeps each shard's small header, and returns a tensor on
demand in float32, FP8 weights dequantized with their block scales.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from maxtext_moe.convert import fp8, safetensors_io
from maxtext_moe.errors import UserError

INDEX = "model.safetensors.index.json"
SCALE = "_scale_inv"


class HfCheckpoint:
    """The tensors of `folder`, by Hugging Face name."""

    def __init__(self, folder: Path):
        self.folder = folder
        config = folder / "config.json"
        if not config.is_file():
            raise UserError(f"{folder}: no config.json; not a Hugging Face checkpoint folder.", fix="pass SRC.")
        self.config: dict[str, Any] = json.loads(config.read_text())
        index = folder / INDEX
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self.index_name = INDEX
        else:
            single = folder / "model.safetensors"
            if not single.is_file():
                raise UserError(f"{folder}: neither {INDEX} nor model.safetensors.", fix="pass the checkpoint folder.")
            self.weight_map = dict.fromkeys(safetensors_io.read_header(single)[0], single.name)
            self.index_name = single.name
        self.header = cache(self._header)

    def _header(self, shard: str) -> tuple[dict[str, dict], int]:
        return safetensors_io.read_header(self.folder / shard)

    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def total_bytes(self) -> int:
        return sum((self.folder / s).stat().st_size for s in self.shards() if (self.folder / s).is_file())

    def shard_of(self, key: str) -> str:
        """The shard the index names for `key`; a missing entry is a `UserError` naming the key and the index."""
        shard = self.weight_map.get(key)
        if shard is None:
            raise UserError(
                f"{self.folder / self.index_name}: no entry for {key!r}, which the recipe's model needs.",
                fix="use the complete index of this checkpoint (or check the recipe's layers and experts).",
            )
        return shard

    def _raw(self, key: str) -> np.ndarray:
        shard = self.shard_of(key)
        header, start = self.header(shard)
        if key not in header:
            raise UserError(
                f"{self.folder / shard}: the index places {key!r} in this shard, but the shard has no such tensor.",
                fix="download the shard again, or use the index that came with it.",
            )
        return safetensors_io.read_tensor(self.folder / shard, key, header, start)

    def get(self, key: str) -> np.ndarray:
        """Tensor `key` in float32; an FP8 weight is multiplied out by its `weight_scale_inv` blocks."""
        raw = self._raw(key)
        if raw.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            return fp8.dequantize(raw, self._raw(key + SCALE).astype(np.float32))
        return raw.astype(np.float32)
