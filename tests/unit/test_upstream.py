"""Every upstream internal maxtext-moe touches still exists in the pinned versions (maxtext_moe.upstream)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import sys
import tomllib
import types

import pytest
from conftest import REPO

from maxtext_moe.upstream import SYMBOLS, maxtext_errors


def _pins() -> dict[str, str]:
    """Distribution -> version pinned in pyproject.toml (dependencies and the gpu extra)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for req in [*project["dependencies"], *project["optional-dependencies"]["gpu"]]:
        name, _, version = req.partition("==")
        pins[name.split("[")[0].lower()] = version
    pins["transformer-engine-jax"] = pins["transformer-engine"]
    return pins


@pytest.mark.parametrize(("dist", "module", "attr"), SYMBOLS, ids=[f"{m}.{a}" for _, m, a in SYMBOLS])
def test_touched_symbol_exists_in_the_pinned_version(dist: str, module: str, attr: str) -> None:
    if dist.startswith("transformer-engine") and importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("Transformer Engine is not installed here (GPU machines only)")
    assert importlib.metadata.version(dist) == _pins()[dist], f"{dist} is not the pinned version"
    if dist.startswith("transformer-engine"):
        import jax

        jax.devices()  # TE binds to the CUDA libraries the JAX plugin loads
    obj = importlib.import_module(module)
    for part in attr.split("."):
        assert hasattr(obj, part), f"{module}.{attr}: {part} is gone in {dist} {_pins()[dist]}"
        obj = getattr(obj, part)


def test_maxtext_te_context_still_turns_errors_into_a_reyield(monkeypatch: pytest.MonkeyPatch) -> None:
    """With TE importable, MaxText's context re-yields on any error in its body (the quirk
    `maxtext_errors` unwraps); a stand-in for TE's sharding module makes its `try` branch run here."""
    from maxtext.utils import max_utils

    sharding = types.ModuleType("transformer_engine.jax.sharding")
    sharding.MeshResource = lambda **_: None
    sharding.global_shard_guard = lambda _: contextlib.nullcontext()
    monkeypatch.setitem(sys.modules, "transformer_engine.jax.sharding", sharding)
    cause = MemoryError("out of memory while training")
    with pytest.raises(RuntimeError) as raised:
        with max_utils.transformer_engine_context():
            raise cause
    assert str(raised.value) == maxtext_errors.REYIELDED
    assert maxtext_errors.underlying(raised.value) is cause
