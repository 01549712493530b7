"""DeepSeek-V3's FP8 weights: e4m3 values with one float32 `weight_scale_inv` per 128x128 block.

MaxText's `deepseek_dequantize.py` dequantizes with torch and writes a whole BF16 copy of the model (1.3 TB)
before conversion; here one tensor is dequantized as it is read, in place, a block row at a time.
"""

from __future__ import annotations

import numpy as np

BLOCK = 128


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """`weight` (rows, cols) in float32, each `block` x `block` tile multiplied by its scale."""
    rows, cols = weight.shape
    want = (-(-rows // block), -(-cols // block))
    if scale_inv.shape != want:
        raise ValueError(f"scale shape {scale_inv.shape} for a {weight.shape} weight in {block}-blocks; want {want}")
    out = weight.astype(np.float32)
    for i in range(want[0]):
        out[i * block : (i + 1) * block] *= np.repeat(scale_inv[i].astype(np.float32), block)[:cols]
    return out
