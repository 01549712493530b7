"""Safetensors shards read and written one tensor at a time.

The `safetensors` package's numpy loader has no FP8 (`F8_E4M3`) or BF16 dtype, which DeepSeek-V3's shards are
made of, and its loaders map whole files. The format is a little-endian u64 header length, a JSON header
(name -> dtype, shape, byte offsets) and the raw bytes; reading one tensor is one seek and one read, so memory
holds that tensor only. A damaged shard (truncated, bad header) is a `UserError` naming the shard and the key.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from maxtext_moe.errors import UserError

DTYPES: dict[str, Any] = {
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "U8": np.uint8,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """The shard's tensor table and where its data starts; a damaged header is a `UserError`."""
    fix = "download this shard again (compare its size and checksum with the source)."
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise UserError(f"{path}: the shard is missing.", fix=fix) from None
    except (OSError, ValueError, struct.error) as e:
        raise UserError(f"{path}: not a readable safetensors shard ({e}).", fix=fix) from None
    header.pop("__metadata__", None)
    start = 8 + length
    for key, info in header.items():
        end = start + info["data_offsets"][1]
        if end > size:
            raise UserError(
                f"{path}: shard is damaged: tensor {key!r} ends at byte {end:,}, the file has {size:,}.", fix=fix
            )
    return header, start


def read_tensor(path: Path, key: str, header: dict[str, dict], start: int) -> np.ndarray:
    """One tensor of a shard, read with one seek (no memory map: only this tensor is resident)."""
    info = header[key]
    begin, end = info["data_offsets"]
    dtype = np.dtype(DTYPES[info["dtype"]])
    with path.open("rb") as f:
        f.seek(start + begin)
        data = np.fromfile(f, dtype=dtype, count=(end - begin) // dtype.itemsize)
    return data.reshape(info["shape"])


class ShardWriter:
    """A safetensors file whose tensors (names, shapes, dtypes) are known up front and arrive one at a time, in
    order: the header is written first, then each tensor's bytes as it comes (what `transformers` and
    `safetensors.safe_open` read), so only the tensor being written is in memory."""

    def __init__(self, path: Path, layout: list[tuple[str, tuple[int, ...], np.dtype]]):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key, shape, dtype in layout:
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[key] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.pending = [(key, tuple(shape), dtype) for key, shape, dtype in layout]
        self.file = path.open("wb")
        self.file.write(struct.pack("<Q", len(raw)))
        self.file.write(raw)

    def write(self, key: str, tensor: np.ndarray) -> None:
        want = self.pending.pop(0)
        if (key, tensor.shape, tensor.dtype) != want:
            raise ValueError(f"{self.file.name}: got {key} {tensor.shape} {tensor.dtype}, the header says {want}")
        np.ascontiguousarray(tensor).tofile(self.file)
        if not self.pending:
            self.file.close()
