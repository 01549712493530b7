"""The `maxtext-moe` subcommands' handlers, grouped by area; `cli` parses the command line and calls them.

`recipes` (list, show), `runs` (train, bench, checkpoints, report), `planning` (plan, doctor, launch) and `files`
(data prepare, convert). Each handler takes the parsed arguments and returns the exit status.
"""

from __future__ import annotations

from collections.abc import Sequence

from maxtext_moe.recipe import composition
from maxtext_moe.recipe.resolved import ResolvedRecipe

DEFAULT_RECIPE = "deepseek3-tiny-cpu"


def resolve(ref: str, overrides: Sequence[str]) -> ResolvedRecipe:
    from maxtext_moe.recipe.validate import resolve as _resolve

    return _resolve(composition.compose(ref, overrides))


def split_recipe(args: list[str]) -> tuple[str, list[str]]:
    """`[RECIPE] [key=value ...]`: a first word without '=' names the recipe."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return DEFAULT_RECIPE, args
