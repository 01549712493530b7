"""`list` and `show`: what recipes there are, and what one resolves to."""

from __future__ import annotations

import argparse
import json

from maxtext_moe.commands import DEFAULT_RECIPE, resolve
from maxtext_moe.recipe import composition, show


def cmd_list(_: argparse.Namespace) -> int:
    """Recipes by the cluster they are written for (hardware x GPUs), so a user picks the row of their own."""
    rows = []
    for name in composition.recipe_names():
        t = resolve(name, []).topology
        desc = str(composition.load_yaml(composition.find_recipe(name)).get("description", "")).split()
        rows.append((t.hardware, t.num_devices, name + (" (default)" if name == DEFAULT_RECIPE else ""), desc))
    rows.sort(key=lambda r: (r[0] != "cpu", r[1] > 2, r[0], r[1], r[2]))
    width = max(len(r[2]) for r in rows) + 2
    print(f"{'cluster':<14}{'recipe':<{width}}what")
    for hardware, devices, name, desc in rows:
        summary = " ".join(desc)
        cut = summary[:100].rsplit(" ", 1)[0] + " ..." if len(summary) > 100 else summary
        print(f"{f'{devices} x {hardware}':<14}{name:<{width}}{cut}")
    print(
        "\nPick the row of your GPU type; another size of cluster is an override (topology.nodes=N), and "
        "`maxtext-moe plan RECIPE --gpus N` checks that it fits before you launch."
    )
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    resolved = resolve(a.recipe, a.overrides)
    print(json.dumps(resolved.to_dict(), indent=2, default=str) if a.json else show.render(resolved))
    return 0
