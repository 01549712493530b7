"""Are an Orbax checkpoint's array bytes still all on disk? A check cheap enough for a 671B checkpoint.

The gap: Orbax marks a step complete when its save finishes (`_CHECKPOINT_METADATA`, `commit_success.txt`),
and says nothing about what happened to the files since (a copy cut short, a disk that filled during
`rsync`, a scrubbed file). A truncated data file shows only when MaxText restores it, as an 82 KB
"incompatible handler" error after the model is built.

MaxText saves with OCDBT: `items/manifest.ocdbt` and a B-tree whose leaves point at byte ranges
(file, offset, length) in the data files under `items/**/d/`. This module reads the manifest and the
B-tree nodes with tensorstore's public `ocdbt.dump` (the index only, kilobytes to megabytes even for 671B),
and checks that every data file it names exists and is long enough for every range in it. It does not
read the array bytes: a file of the right length with wrong bytes in it (the chunks carry no checksum)
is found only when the restore decodes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from maxtext_moe.errors import brief


def _parse(location: str) -> tuple[str, int, int]:
    """`"value:<base>:<file>:<offset>:<length>"` (tensorstore's dump notation) -> (relative file, offset, length)."""
    _kind, rest = location.split(":", 1)
    path, offset, length = rest.rsplit(":", 2)
    base, file_id = path.rsplit(":", 1)
    return base + file_id, int(offset), int(length)


def _extents(kv: Any, location: str, ends: dict[str, int]) -> None:
    """Record in `ends` the furthest byte each data file must hold, for the B-tree node at `location`."""
    import tensorstore as ts

    name, offset, length = _parse(location)
    ends[name] = max(ends.get(name, 0), offset + length)
    node = ts.ocdbt.dump(kv, location).result()
    for entry in node["entries"]:
        if "location" in entry:  # an interior node's child
            _extents(kv, entry["location"], ends)
        elif "indirect_value" in entry:  # a leaf's value stored in a data file
            name, offset, length = _parse(entry["indirect_value"])
            ends[name] = max(ends.get(name, 0), offset + length)


def problem(items: Path) -> str | None:
    """Why the OCDBT data under `items` is incomplete, or None when every indexed byte range is on disk.

    Checkpoints saved without OCDBT (`checkpoint_storage_use_ocdbt: false`) have no manifest: None.
    """
    if not (items / "manifest.ocdbt").is_file():
        return None
    import tensorstore as ts

    ends: dict[str, int] = {}
    try:
        kv = ts.KvStore.open(f"file://{items}/").result()
        versions = ts.ocdbt.dump(kv).result()["versions"]
        root = versions[-1]["root"].get("location") if versions else None
        if root is not None:
            _extents(kv, root, ends)
    except ValueError as e:  # tensorstore's error for an unreadable manifest or node
        return f"its OCDBT index in {items} cannot be read ({brief(e, 240)})"
    for name, needed in sorted(ends.items()):
        path = items / name
        if not path.is_file():
            return f"its data file {path} is missing"
        size = path.stat().st_size
        if size < needed:
            return f"its data file {path} is truncated ({size} bytes, the index needs {needed})"
    return None
