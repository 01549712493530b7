"""MaxText's configuration keys and their default values, read without importing MaxText.

The resolver must not import jax (importing it fixes XLA's flags before the recipe's environment
is applied), and importing `maxtext` imports jax. MaxText's own `configs/base.yml` lists every key
its pydantic model accepts from a YAML file, with its default; reading that file gives the key
catalogue for "unknown key" and type checks at no import cost.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from maxtext_moe.errors import UserError


@functools.cache
def maxtext_package_dir() -> Path:
    spec = importlib.util.find_spec("maxtext")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "MaxText is not installed in this Python environment.",
            fix="install the pinned dependencies: `scripts/setup.sh` (or `pip install maxtext==0.2.5`).",
        )
    return Path(next(iter(spec.submodule_search_locations)))


def base_yml() -> Path:
    return maxtext_package_dir() / "configs" / "base.yml"


def model_yml(model_name: str) -> Path:
    return maxtext_package_dir() / "configs" / "models" / f"{model_name}.yml"


def assets_dir() -> Path:
    return maxtext_package_dir() / "assets"


@functools.cache
def defaults() -> dict[str, Any]:
    """Every MaxText key with its base.yml default, plus keys only its pydantic model declares.

    base.yml does not list every key the model accepts (maxtext 0.2.5 lacks `prefuse_moe_weights`,
    which `te_moe_block=true` requires), so those are read from configs/types.py without importing it.
    """
    with open(base_yml(), encoding="utf-8") as f:
        keys = yaml.safe_load(f)
    return {**_pydantic_only_defaults(), **keys}


def _pydantic_only_defaults() -> dict[str, Any]:
    """`name: T = Field(default, ...)` declarations in MaxText's configs/types.py with a literal, non-None default.

    None defaults are left out: they mark derived or list-valued settings (e.g. `ici_parallelism`) that a
    recipe should not set and that the mesh check must not mistake for mesh axes.
    """
    tree = ast.parse((maxtext_package_dir() / "configs" / "types.py").read_text(encoding="utf-8"))
    found: dict[str, Any] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "Field"
            and node.value.args
        ):
            try:
                value = ast.literal_eval(node.value.args[0])
            except ValueError:
                continue
            if value is not None:
                found[node.target.id] = value
    return found


@functools.cache
def model_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in (maxtext_package_dir() / "configs" / "models").glob("*.yml")))


@functools.cache
def model_defaults(model_name: str) -> dict[str, Any]:
    """The keys MaxText's model file sets for `model_name` (empty for `default`)."""
    path = model_yml(model_name)
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def refuse_owned(owned: Iterable[str], source: Callable[[str], str | None], section: str, fix: str) -> None:
    """Refuse a MaxText key that a recipe section derives (`source(key)`: where a recipe or override set it, None
    where none did): two places for one value would let them disagree."""
    for key in owned:
        if where := source(key):
            raise UserError(f"is set by the {section}: section, not directly.", key=key, source=where, fix=fix)
