"""Which versions of the GPU libraries this process would load (cuBLASLt, NCCL, TE's NCCL EP library, any
installed distribution), found without importing the frameworks that carry them.

Why apart from `doctor`: the same answers serve `doctor`'s report and the GPU tests that skip without NCCL EP.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
from pathlib import Path


def nvidia_lib(stem: str) -> str | None:
    """A CUDA library from the pip `nvidia-*` wheels (where jax[cuda13] gets it), else the loader's."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []) or []:
        found = sorted(Path(root).glob(f"**/lib/{stem}.so*"))
        if found:
            return str(found[0])
    return ctypes.util.find_library(stem.removeprefix("lib"))


def call_version(stem: str, symbol: str, by_pointer: bool) -> int | None:
    path = nvidia_lib(stem)
    if path is None:
        return None
    try:
        fn = getattr(ctypes.CDLL(path), symbol)
    except (OSError, AttributeError):
        return None
    if by_pointer:
        v = ctypes.c_int(0)
        return v.value if fn(ctypes.byref(v)) == 0 else None
    fn.restype = ctypes.c_size_t
    return int(fn())


def loaded_nccl_code() -> int | None:
    """The version of `libnccl.so.2` as TE's `ep_bootstrap` loads it (by that name: the copy the loader
    picks, LD_PRELOAD first, or the one jax's plugin already loaded), else of the pip wheel's copy."""
    try:
        v = ctypes.c_int(0)
        if ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(v)) == 0:
            return v.value
    except (OSError, AttributeError):
        pass
    return call_version("libnccl", "ncclGetVersion", by_pointer=True)


def nccl_ep_lib_path() -> str | None:
    """TE's NCCL EP library (`libnccl_ep.so`, shipped in TE's core wheel), found without importing TE."""
    spec = importlib.util.find_spec("transformer_engine")
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("**/libnccl_ep*.so*"))
    return str(found[0]) if found else None


def nccl_version(code: int) -> tuple[int, int, int]:
    """NCCL's integer version (since 2.9: major*10000 + minor*100 + patch; before: *1000 + *100)."""
    if code >= 20900:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
