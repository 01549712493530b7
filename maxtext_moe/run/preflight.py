"""Checks that need jax, run before the run folder or the corpus is written.

`validate` runs without jax; what it cannot know (does jax see the recipe's GPUs, does MaxText's own
config model accept the keys) is asked here, once the recipe's environment is set and jax.distributed is up,
so a rejected run leaves nothing behind and fails in seconds rather than after the corpus is built.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from typing import Any

from maxtext_moe.recipe.resolved import ResolvedRecipe
from maxtext_moe.tools import doctor
from maxtext_moe.upstream import maxtext_config


def check(resolved: ResolvedRecipe, maxtext: dict[str, Any]) -> Any:
    """Refuse a GPU recipe without GPUs, then run MaxText's config model on `maxtext`; returns MaxText's config.

    MaxText's import prints a line per optional dependency it stubs out; that says nothing to the user here.
    """
    doctor.require_gpu(resolved)
    with redirect_stdout(io.StringIO()):
        return maxtext_config.check(maxtext, resolved.sources)
