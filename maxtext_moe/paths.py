"""Where the recipe and fragment YAML files live.

In a source checkout (and an editable install) they are the repository's `recipes/` and
`configs/`; in a built wheel the same folders are bundled under `maxtext_moe/_bundled/`. One
lookup serves both so that `maxtext-moe train` with no arguments works however it was installed.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def data_root() -> Path:
    """The folder that holds `recipes/` and `configs/`."""
    bundled = _PACKAGE / "_bundled"
    if (bundled / "recipes").is_dir():
        return bundled
    return _PACKAGE.parent


def recipes_dir() -> Path:
    return data_root() / "recipes"


def configs_dir() -> Path:
    return data_root() / "configs"


def display(path: Path) -> str:
    """A short, stable name for a file in messages: relative to the data root when inside it."""
    try:
        return str(path.resolve().relative_to(data_root()))
    except ValueError:
        return str(path)
