"""Check a recipe's XLA flags against the XLA that will run them, before anything else starts.

Why our own: XLA reads XLA_FLAGS when its first backend starts and aborts the whole process on a name it
does not know or a value it cannot parse, after MaxText has spent its start-up, with a fatal log line
that names neither the recipe file nor the key. The parser lives in XLA's C++ and shares one flag table
for every backend, so a short Python that starts the CPU backend with the recipe's flags reads them
exactly as a GPU run would; its message is then mapped back to the `xla_flags.NAME` key and its file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata

from maxtext_moe.errors import UserError
from maxtext_moe.recipe.resolved import ResolvedRecipe

_PROBE = "import jax; jax.devices('cpu')"
_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
_BAD_VALUE = re.compile(r"Couldn't interpret value (.*) for flag (\w+)\.")


def _run(flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)


def check(resolved: ResolvedRecipe) -> None:
    """Raise a UserError naming the key, its file and the fix if XLA would refuse the recipe's flags."""
    flags = resolved.env.get("XLA_FLAGS", "")
    if not flags:
        return
    probe = _run(flags)
    if probe.returncode == 0:
        return
    jaxlib = f"jaxlib {metadata.version('jaxlib')}"
    unknown, bad = _UNKNOWN.search(probe.stderr), _BAD_VALUE.search(probe.stderr)
    if unknown:
        name = re.findall(r"--(\w+)", unknown.group(1))[0]
        raise UserError(
            f"XLA ({jaxlib}) has no such flag.",
            key=f"xla_flags.{name}",
            source=resolved.sources.get(f"xla_flags.{name}"),
            fix="correct the name (XLA's flags are in its xla/debug_options_flags.cc) or remove the "
            "flag: XLA would abort the whole run on it.",
        )
    if bad:
        value, name = bad.groups()
        raise UserError(
            f"XLA ({jaxlib}) cannot read the value {value!r}.",
            key=f"xla_flags.{name}",
            source=resolved.sources.get(f"xla_flags.{name}"),
            fix="give a value of the flag's type (true/false, a number, or its list syntax).",
        )
    last = next((ln for ln in reversed(probe.stderr.splitlines()) if ln.strip()), "no message")
    raise UserError(
        f"XLA ({jaxlib}) refused the recipe's XLA_FLAGS: {last.strip()[:300]}",
        key="xla_flags",
        fix="check the xla_flags section; `maxtext-moe show RECIPE` prints the XLA_FLAGS it builds.",
    )
