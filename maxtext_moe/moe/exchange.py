"""One ragged all-to-all over the expert-parallel axis, three ways, and its adjoint.

"all_to_all"         XLA's dense all-to-all of fixed per-destination blocks: every backend, any number of
                     processes (the default: `settings.MoeSettings.exchange_impl`).
"ragged_all_to_all"  `jax.lax.ragged_all_to_all`: no padding on the wire; GPUs only.
"emulated"           `all_gather` + gathers: the reference for the bookkeeping, also under `vmap`.
Offsets and sizes mean what they mean for `jax.lax.ragged_all_to_all`; the EP layer runs one exchange to
send rows, and the same exchange backwards to return results (and as the gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtext_moe.errors import UserError
from maxtext_moe.moe.settings import IMPLS, Impl

__all__ = ["IMPLS", "Impl", "exchange", "transpose"]


def transpose(v: jax.Array, axis_name: str) -> jax.Array:
    """[R] per rank -> [R] per rank with element s = rank s's element for me (counts, offsets).

    An all_gather of R*R int32 (what MaxText does for its group sizes), not `all_to_all`: under `vmap`,
    all_to_all of a value that is the same on every rank (not batched) returns the wrong shape in JAX 0.11.
    """
    return jax.lax.all_gather(v, axis_name)[:, jax.lax.axis_index(axis_name)]


def _received(
    output_rows: int, output_offsets: jax.Array, recv_sizes: jax.Array, axis_name: str
) -> tuple[jax.Array, jax.Array]:
    """Which rows of my output buffer sender s writes ([R, output_rows] bool), and where its rows start
    ([R]): the receive side of one exchange, from the senders' `output_offsets` and my `recv_sizes`."""
    dst_off = transpose(output_offsets, axis_name)  # where sender s's rows land in my output
    pos = jnp.arange(output_rows)
    return (pos >= dst_off[:, None]) & (pos < (dst_off + recv_sizes)[:, None]), dst_off


def _emulated_ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    axis_name: str,
) -> jax.Array:
    """`ragged_all_to_all` from all_gather + gathers: every rank sees all senders' buffers on an explicit
    leading ranks axis and picks its rows. R times the traffic: a reference for the bookkeeping, not a path
    to train on. `send_sizes` enters through its transpose, which by contract equals `recv_sizes`."""
    del send_sizes  # the receiver's view of it is recv_sizes
    senders = jax.lax.all_gather(operand, axis_name)  # [R, N, ...]
    src_off = transpose(input_offsets, axis_name)  # where sender s's rows for me start in its buffer
    inside, dst_off = _received(output.shape[0], output_offsets, recv_sizes, axis_name)
    sender = jnp.argmax(inside, axis=0)
    row = jnp.clip(src_off[sender] + jnp.arange(output.shape[0]) - dst_off[sender], 0, operand.shape[0] - 1)
    got = jnp.any(inside, axis=0).reshape(-1, *([1] * (output.ndim - 1)))
    return jnp.where(got, senders[sender, row], output)


def _dense_ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    axis_name: str,
    block: int,
) -> jax.Array:
    """`ragged_all_to_all` over XLA's plain all-to-all: each destination's rows go in a block of `block`
    rows (at least every send size), the blocks cross in one all-to-all, and each receiver scatters the
    rows that arrived into its output. It sends R * block rows, padding included.

    Why: with one process per GPU, XLA's ragged all-to-all between processes does not complete a step
    (JAX 0.11.2), and its decomposer (`xla_gpu_unsupported_enable_ragged_all_to_all_decomposer`) trains but sends
    R blocks of the whole operand to every peer. The plain all-to-all is NCCL's own collective, and XLA:CPU
    implements it too, so this path runs in the CPU tests as it does on GPUs. With dedup a destination
    gets at most T rows from a source, so `block` = T: EP - 1 rows per token on the wire. At EP2 a token
    nearly always needs the other rank, so that is what dedup sends anyway; at EP8 it is as much as
    MaxText's once-per-expert volume (a token reaches about 5.3 of 8 ranks; docs/PLAN.md), so there the
    saving stays in the plan until blocks are sized from the routing or the ragged exchange runs."""
    ranks, j = input_offsets.shape[0], jnp.arange(block)
    src = jnp.clip(input_offsets[:, None] + j, 0, operand.shape[0] - 1)  # [R, block] rows for destination d
    mask = (j < send_sizes[:, None]).reshape(ranks, block, *([1] * (operand.ndim - 1)))
    blocks = jnp.where(mask, operand[src], 0)
    got = jax.lax.all_to_all(blocks, axis_name, 0, 0)  # got[s] = sender s's block for me
    dst = transpose(output_offsets, axis_name)[:, None] + j  # where sender s's row j lands in my output
    dst = jnp.where(j < recv_sizes[:, None], dst, output.shape[0])  # rows past a sender's size are dropped
    return output.at[dst.reshape(-1)].set(got.reshape(ranks * block, *operand.shape[1:]), mode="drop")


def _ragged_exchange(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    axis_name: str,
    impl: Impl,
    block: int,
) -> jax.Array:
    if impl == "all_to_all":
        return _dense_ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name, block
        )
    if impl == "ragged_all_to_all":
        # The collective's result takes the output buffer's type; a fresh buffer is the same on every rank,
        # while the rows arriving are not: mark it varying, or shard_map's checks reject our adjoint.
        output = jax.lax.pcast(output, axis_name, to="varying")
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name
        )
    if impl == "emulated":
        return _emulated_ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name
        )
    raise UserError(
        f"unknown EP exchange {impl!r}.",
        fix="use all_to_all, ragged_all_to_all or emulated (nccl_ep is no exchange here: see moe/nccl_ep.py).",
    )


def _fresh_buffer(after: jax.Array, rows: int, fill: float) -> jax.Array:
    """A new [rows, ...] buffer of `fill` for an exchange to write into, made only once `after` exists.

    A plain `jnp.full` is a constant: XLA hoists it to the start of the step and fuses those of every layer
    into one kernel, so all of them live from the first layer's forward to their use. The fill value passes
    through an optimization barrier with `after` instead; that data dependence keeps each buffer next to its
    exchange. Seen in the deviceless compile of the 9-layer DeepSeek-V3 H200-128 variant (docs/PLAN.md):
    one fusion made 34 buffers of [196608, 7168] BF16 at once, 89 GiB per GPU."""
    _, value = jax.lax.optimization_barrier((after, jnp.asarray(fill, after.dtype)))
    return jnp.broadcast_to(value, (rows, *after.shape[1:]))


def _exchange_into_fresh_buffer(
    operand: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    rows: int,
    pad: float,
    axis_name: str,
    impl: Impl,
    block: int,
) -> jax.Array:
    output = _fresh_buffer(operand, rows, pad)
    return _ragged_exchange(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name, impl, block
    )


_differentiable_exchange = jax.custom_vjp(_exchange_into_fresh_buffer, nondiff_argnums=(5, 6, 7, 8, 9))


def _exchange_fwd(
    operand: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    rows: int,
    pad: float,
    axis_name: str,
    impl: Impl,
    block: int,
) -> tuple[jax.Array, tuple]:
    out = _exchange_into_fresh_buffer(
        operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows, pad, axis_name, impl, block
    )
    operand_rows = jnp.zeros((operand.shape[0], 0), operand.dtype)  # carries the operand's row count
    return out, (input_offsets, send_sizes, output_offsets, recv_sizes, operand_rows)


def _exchange_bwd(rows: int, pad: float, axis_name: str, impl: Impl, block: int, res: tuple, g: jax.Array) -> tuple:
    """The adjoint: each rank sends the cotangent rows of what it received back to where they came from,
    sizes and offsets swapped, exactly as the combine sends results back. The padding is a constant."""
    input_offsets, send_sizes, output_offsets, recv_sizes, operand_rows = res
    back = _fresh_buffer(g, operand_rows.shape[0], 0)
    operand_t = _ragged_exchange(
        g,
        back,
        transpose(output_offsets, axis_name),
        recv_sizes,
        transpose(input_offsets, axis_name),
        send_sizes,
        axis_name,
        impl,
        block,
    )
    return operand_t, None, None, None, None


_differentiable_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def exchange(
    operand: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    rows: int,
    pad: float = 0,
    axis_name: str,
    impl: Impl,
    block: int,
    own_adjoint: bool = True,
) -> jax.Array:
    """One ragged all-to-all over `axis_name` into a fresh buffer of `rows` rows filled with `pad`; offsets
    and sizes mean what they mean for `jax.lax.ragged_all_to_all`; no send size exceeds `block` rows.

    Call it per rank (inside `shard_map`, or inside `vmap(axis_name=...)` for "emulated"). "all_to_all"
    (`_dense_ragged_all_to_all`) and "emulated" run anywhere; "ragged_all_to_all" is XLA's collective (GPU;
    XLA:CPU does not implement it).
    Gradients use our own adjoint (`_exchange_bwd`: the same exchange run backwards, as the combine runs),
    which gives the emulation's gradients for the whole EP layer on GPUs (tests/gpu/test_dispatch_gpu.py).
    Why not JAX 0.11.2's transpose of `ragged_all_to_all`: under shard_map's checks, with the output buffer
    typed as the same on every rank, the layer's gate-kernel gradient through it disagrees with the
    emulation's while the outputs agree, so the layer keeps the adjoint that the GPU test verifies.
    Integer operands (expert ids) have nothing to differentiate and skip the rule, as does
    `own_adjoint=False`, which `vmap` drivers need (a custom VJP's collectives lose the vmap axis name).
    """
    args = (operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows, pad, axis_name, impl, block)
    if not own_adjoint or not jnp.issubdtype(operand.dtype, jnp.inexact):
        return _exchange_into_fresh_buffer(*args)
    return _differentiable_exchange(*args)
