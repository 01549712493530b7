"""A differentiable call whose forward and backward each reach XLA as one unit, lowered where they are used.

The gap: XLA in JAX 0.11.2 crashes (SIGSEGV, in Shardy's canonicalization of the shard_map) compiling the
gradient of a `jax.shard_map` when a zero-size array crosses its boundary. TE's grouped GEMM passes
zero-size placeholders for its optional operands; inside `jax.lax.scan` (MaxText's scanned decoder layers),
JAX's partial evaluation moves them out of the loop body and feeds them back into our expert-parallel
shard_map as operands. A primitive is not split by partial evaluation: bound as one, the grouped GEMM's
forward and backward are traced only when lowered, inside the shard_map, so their placeholders never cross
its boundary. docs/UPSTREAM.md has the reproducer; JAX 0.12.0.1 compiles it without this.

The forward returns TE's own residuals (those of `jax.vjp`), so the backward reuses what TE saved (FP8
operands included) instead of recomputing it; zero-size residuals are left out and made again inside.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

_call_p = Primitive("maxtext_moe_opaque_call")
_call_p.multiple_results = True
_call_p.def_impl(lambda *args, fn: fn(*args))


def _abstract(*avals: jax.core.ShapedArray, fn: Callable[..., list[jax.Array]]) -> list[jax.core.ShapedArray]:
    out = jax.eval_shape(fn, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    return [jax.core.ShapedArray(o.shape, o.dtype) for o in out]


_call_p.def_abstract_eval(_abstract)
mlir.register_lowering(
    _call_p, lambda ctx, *args, fn: mlir.lower_fun(fn, multiple_results=True)(ctx, *args), cacheable=False
)


def _batch(args: Sequence[jax.Array], dims: Sequence[Any], *, fn: Callable[..., list[jax.Array]]) -> tuple:
    """Under `jax.vmap` (the emulated expert-parallel layer), the wrapped function vmapped, still one unit."""
    in_axes = tuple(dims)  # None for an argument that is not batched
    outs = _call_p.bind(*args, fn=lambda *a: jax.vmap(fn, in_axes=in_axes)(*a))
    return outs, [0] * len(outs)


batching.primitive_batchers[_call_p] = _batch
# What it wraps may hold custom-partitioned calls (TE's are), whose lowering needs the devices: JAX looks for
# them in the jaxpr, where the wrapped function is not yet traced, so the primitive says so itself.
dispatch.prim_requires_devices_during_lowering.add(_call_p)


@dataclass(frozen=True)
class _Residuals:
    """Where `jax.vjp`'s residuals of one call go: kept ones cross from the forward to the backward, zero-size
    ones are made again in the backward."""

    treedef: Any
    kept: tuple[bool, ...]
    empty: tuple[jax.ShapeDtypeStruct, ...]


def opaque_vjp(
    f: Callable[..., jax.Array], num_diff: int, residual_name: str | None = None
) -> Callable[..., jax.Array]:
    """`f(*args)` (one array out), differentiable in its first `num_diff` arguments (the rest get no gradient,
    e.g. integer group sizes), with its forward and its backward each bound as one primitive.

    `residual_name`: the remat name of the residuals the forward hands the backward. Names given inside `f`
    (TE's quantizer checkpoint names) are traced only when the primitive is lowered, where no remat policy
    sees them; without a name here a policy of names recomputes the whole forward in the backward pass.
    """

    def pullback(*args: jax.Array) -> tuple[jax.Array, Any]:
        rest = args[num_diff:]
        return jax.vjp(lambda *d: f(*d, *rest), *args[:num_diff])

    def call(*args: jax.Array) -> jax.Array:
        box: dict[str, Any] = {}

        def probe(*a: jax.Array) -> list[jax.Array]:
            leaves, box["treedef"] = jax.tree.flatten(pullback(*a)[1])
            return leaves

        shapes = jax.eval_shape(probe, *args)
        kept = tuple(math.prod(s.shape) > 0 for s in shapes)
        res = _Residuals(box["treedef"], kept, tuple(s for s, k in zip(shapes, kept, strict=True) if not k))

        def forward(*a: jax.Array) -> list[jax.Array]:
            y, vjp = pullback(*a)
            return [y, *(leaf for leaf, k in zip(jax.tree.leaves(vjp), res.kept, strict=True) if k)]

        def backward(*kept_and_g: jax.Array) -> list[jax.Array]:
            *kept_leaves, g = kept_and_g
            return list(jax.tree.unflatten(res.treedef, _merge(kept_leaves, res))(g))

        @jax.custom_vjp
        def opaque(*a: jax.Array) -> jax.Array:
            return _call_p.bind(*a, fn=lambda *x: [f(*x)])[0]

        def opaque_fwd(*a: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
            y, *kept_leaves = _call_p.bind(*a, fn=forward)
            if residual_name is not None:
                kept_leaves = [checkpoint_name(leaf, residual_name) for leaf in kept_leaves]
            return y, tuple(kept_leaves)

        def opaque_bwd(kept_leaves: tuple[jax.Array, ...], g: jax.Array) -> tuple[jax.Array | None, ...]:
            grads = _call_p.bind(*kept_leaves, g, fn=backward)
            return (*grads, *([None] * (len(args) - num_diff)))

        opaque.defvjp(opaque_fwd, opaque_bwd)
        return opaque(*args)

    return call


def _merge(kept_leaves: Sequence[jax.Array], res: _Residuals) -> list[jax.Array]:
    """The residual leaves in `jax.vjp`'s order: the kept ones, and zeros for the zero-size ones."""
    kept, empty = iter(kept_leaves), iter(res.empty)
    leaves = []
    for k in res.kept:
        s = None if k else next(empty)
        leaves.append(next(kept) if s is None else jnp.zeros(s.shape, s.dtype))
    return leaves
