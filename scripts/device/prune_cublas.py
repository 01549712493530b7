"""Cut cuBLAS (libcublas.so.13, libcublasLt.so.13) down to the kernels one GPU architecture loads; cuDNN's
libraries too (scripts/device/build_cudnn_carry.sh), whose kernels sit in the same kinds of section.

Why: the lent H200 has cuBLAS 13.1, TE's single-kernel grouped GEMM needs 13.4 on Hopper, and the pip wheel's
libraries (about 580 MiB) hold kernels for seven architectures; nothing outside the machine can be reached, so
a newer cuBLAS has to travel in the 64 MiB carries. The shared prune tool (shared/device/te/prune_fatbin.py)
handles the `.nv_fatbin` section that NCCL and TE keep their kernels in; cuBLASLt keeps them in two more places,
which this script handles with the same rule (entries of other architectures are zeroed, every header, size and
offset stays, so the library's own tables still point at valid records):
- `.cask_resource`: fatbin containers of the Blackwell CASK kernels (none for sm_90 in 13.10);
- `.ldata`: zstd-compressed CUDA ELF cubins, one frame each, its architecture read from the ELF header.
A container `compact` mode leaves with only another architecture's entry is zeroed too. The kept library must
still load and report its version (checked by scripts/device/build_cublas_carry.sh without a GPU). Needs the
`zstd` command, to read each frame's ELF header.

    PRUNE_FATBIN=.../prune_fatbin.py python3 scripts/device/prune_cublas.py SRC_LIB OUT_LIB [--keep 90]
"""

from __future__ import annotations

import argparse
import importlib.util
import mmap
import os
import struct
import subprocess
from types import ModuleType

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ELF_MAGIC = b"\x7fELF"


def load_prune_fatbin() -> ModuleType:
    path = os.environ.get("PRUNE_FATBIN", "")
    if not os.path.isfile(path):
        raise SystemExit(f"prune_cublas: set PRUNE_FATBIN to shared/device/te/prune_fatbin.py (got {path!r})")
    spec = importlib.util.spec_from_file_location("prune_fatbin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def zstd_frame_size(buf: mmap.mmap, pos: int) -> int:
    """Bytes of the zstd frame at `pos` (RFC 8878: header, blocks up to the last, optional checksum)."""
    fhd = buf[pos + 4]
    fcs_flag, single_segment, checksum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
    n = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[dict_flag] + (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    while True:
        header = int.from_bytes(buf[pos + n : pos + n + 3], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            raise SystemExit(f"prune_cublas: not a zstd frame at {pos:#x} (reserved block type)")
        n += 3 + (1 if kind == 1 else size)
        if last:
            return n + (4 if checksum else 0)


def cubin_arch(frame: bytes) -> int | None:
    """The SM number of the CUDA ELF a zstd frame holds (None if it holds something else). ELF ABI version 8
    moved the SM number from bits 0-7 of e_flags to bits 8-15."""
    head = subprocess.run(["zstd", "-d", "-c", "-q"], input=frame, capture_output=True).stdout[:0x40]
    if head[:4] != ELF_MAGIC or len(head) < 0x34:
        return None
    flags = struct.unpack_from("<I", head, 0x30)[0]
    return (flags >> 8) & 0xFF if head[8] >= 8 else flags & 0xFF


def zero_fatbin_entries(pf: ModuleType, buf: mmap.mmap, section: tuple[int, int], keep: list[int]) -> int:
    zeroed = 0
    for e in pf.walk_fatbins(buf, *section):
        if e["arch"] not in keep:
            buf[e["payload_off"] : e["payload_off"] + e["payload_size"]] = bytes(e["payload_size"])
            zeroed += e["payload_size"]
    return zeroed


def zero_ldata_cubins(buf: mmap.mmap, section: tuple[int, int], keep: list[int]) -> tuple[int, int]:
    pos, end = section[0], section[0] + section[1]
    kept = zeroed = 0
    while (pos := buf.find(ZSTD_MAGIC, pos, end)) >= 0:
        n = zstd_frame_size(buf, pos)
        arch = cubin_arch(bytes(buf[pos : pos + n]))
        if arch is not None and arch not in keep:
            buf[pos : pos + n] = bytes(n)
            zeroed += n
        else:
            kept += n
        pos += n
    return kept, zeroed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--keep", type=int, action="append", default=None, help="SM number to keep (default 90)")
    args = ap.parse_args()
    keep = args.keep or [90]
    pf = load_prune_fatbin()
    pf.cmd_compact(args.src, args.out, keep, False)
    with open(args.out, "r+b") as fh:
        buf = mmap.mmap(fh.fileno(), 0)
        sections = pf.elf_sections(buf)
        fatbins = [sections[s] for s in (".nv_fatbin", ".cask_resource") if s in sections]
        zeroed = sum(zero_fatbin_entries(pf, buf, section, keep) for section in fatbins)
        print(f"fatbin entries of other architectures: zeroed {zeroed / 2**20:.1f} MiB")
        if ".ldata" in sections:
            kept, zeroed = zero_ldata_cubins(buf, sections[".ldata"], keep)
            print(f".ldata cubins: kept {kept / 2**20:.1f} MiB, zeroed {zeroed / 2**20:.1f} MiB")
        buf.flush()


if __name__ == "__main__":
    main()
