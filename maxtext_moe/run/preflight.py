"""Checks that need jax or the machine, run before the run folder or the corpus is written.

`validate` runs without jax; what it cannot know (does jax see the recipe's GPUs, does MaxText's own
config model accept the keys, does the output filesystem have room for a checkpoint) is asked here, once
the recipe's environment is set and jax.distributed is up, so a rejected run leaves nothing behind and fails
in seconds rather than after the corpus is built or at the first checkpoint save.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from maxtext_moe.recipe.resolved import ResolvedRecipe
from maxtext_moe.run import disk_space
from maxtext_moe.tools import doctor
from maxtext_moe.upstream import maxtext_config


def check(resolved: ResolvedRecipe, maxtext: dict[str, Any]) -> Any:
    """Refuse a GPU recipe without GPUs, run MaxText's config model on `maxtext`, and refuse an output
    filesystem without room for one checkpoint; returns MaxText's config.

    MaxText's import prints a line per optional dependency it stubs out; that says nothing to the user here.
    """
    doctor.require_gpu(resolved)
    with redirect_stdout(io.StringIO()):
        config = maxtext_config.check(maxtext, resolved.sources)
    disk_space.require_room(resolved, Path(maxtext["base_output_directory"]))
    return config
