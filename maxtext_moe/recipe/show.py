"""`maxtext-moe show`: the resolved recipe as YAML, each value annotated with the file or override it came from.

MaxText prints its configuration without saying where a value was set; a recipe composed of fragments and
overrides needs that answer for every key.
"""

from __future__ import annotations

import json
from typing import Any

from maxtext_moe.recipe import advice, training
from maxtext_moe.recipe.resolved import ResolvedRecipe


def _yaml_scalar(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else json.dumps(value, default=str)


def render(r: ResolvedRecipe) -> str:
    lines = [f"# recipe {r.name}: {r.description}", f"# composed from: {', '.join(r.files)}"]
    t = r.topology
    lines += [
        "topology:",
        f"  hardware: {t.hardware}  # {r.sources.get('topology.hardware', '')}",
        f"  nodes: {t.nodes}  # {r.sources.get('topology.nodes', 'default')}",
        f"  gpus_per_node: {t.gpus_per_node}  # {r.sources.get('topology.gpus_per_node', 'hardware default')}",
        f"  # {t.num_devices} device(s) in all",
    ]
    for section, values, prefix in (
        ("maxtext", r.maxtext, "maxtext"),
        ("env", r.env, "env"),
        ("corpus", r.corpus or {}, "corpus"),
        ("moe", r.moe, "moe"),
        ("attention", r.attention, "attention"),
        ("guard", r.guard, "guard"),
        ("job", r.job, "job"),
    ):
        if not values:
            continue
        lines.append(f"{section}:")
        width = max(len(k) for k in values) + 2
        for key in sorted(values):
            src = r.sources.get(f"{prefix}.{key}", "derived from xla_flags" if key == "XLA_FLAGS" else "")
            lines.append(f"  {(key + ':').ljust(width)} {_yaml_scalar(values[key])}  # {src}")
    if r.training_settings is not None:
        lines += training.show_lines(r.training_settings, r.sources, int(r.effective("steps")))
    lines += [f"# {note}" for note in advice.notes(r)]
    return "\n".join(lines)
