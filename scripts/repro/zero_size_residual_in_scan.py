"""XLA crashes (SIGSEGV) compiling the gradient of a `jax.shard_map` over two or more devices when a zero-size
array crosses its boundary as a residual of the differentiation (JAX 0.11.2; JAX 0.12.0.1 compiles it).

Transformer Engine's grouped GEMM passes zero-size placeholders for its optional operands. Unrolled, they stay
inside the shard_map; inside `jax.lax.scan`, JAX's partial evaluation moves them out of the loop body and
feeds them back in as operands. So MaxText's scanned decoder layers with our expert-parallel block crashed
XLA:GPU while unrolled ones compiled.

    python zero_size_residual_in_scan.py [--unrolled] [--forward-only] [--kernel te] [--target-config FILE]

`--kernel placeholder` (the default): a custom VJP that keeps a zero-size residual; JAX alone, on the CPU
(two host devices); it crashes scanned and unrolled. `--kernel te`: TE's `grouped_dense`, compiled for two
GPUs (those visible, or deviceless for the GPU an XLA:GPU target config describes); it crashes scanned only.
Prints "compiled" and exits 0 when XLA compiles the step; the crash kills the process with SIGSEGV.
docs/UPSTREAM.md has what was found.
"""

from __future__ import annotations

import argparse
import os
import sys

GROUPS, ROWS, K, N, LAYERS = 2, 64, 32, 32, 2  # per device: [ROWS, K] rows in GROUPS equal groups


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--unrolled", action="store_true", help="a Python loop over the layers instead of scan")
    ap.add_argument("--forward-only", action="store_true", help="compile the loss, not its gradient")
    ap.add_argument("--kernel", choices=("placeholder", "te"), default="placeholder")
    ap.add_argument("--target-config", help="with --kernel te: XLA:GPU target config, to compile without GPUs")
    args = ap.parse_args(argv)
    if args.kernel == "placeholder":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if args.kernel == "placeholder":

        @jax.custom_vjp
        def gemm(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
            return jax.lax.ragged_dot(x, w, sizes)

        def gemm_fwd(x, w, sizes):
            return jax.lax.ragged_dot(x, w, sizes), (x, w, sizes, jnp.zeros((0,), jnp.int32))

        def gemm_bwd(res, g):
            x, w, sizes, placeholder = res  # used, so it stays a residual
            _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes + jnp.sum(placeholder)), x, w)
            return (*vjp(g), None)

        gemm.defvjp(gemm_fwd, gemm_bwd)
        devices = jax.devices()[:2]
    else:
        import transformer_engine.jax.cpp_extensions.gemm as te_gemm
        import transformer_engine.jax.dense as te_dense

        gemm = te_dense.grouped_dense
        if args.target_config:
            from jax.experimental import topologies

            with open(args.target_config, encoding="utf-8") as f:
                target = f.read()
            devices = topologies.get_topology_desc(platform="cuda", target_config=target, topology="1x1x2").devices
            for module in list(sys.modules.values()):  # TE asks the (absent) GPU for its compute capability
                if getattr(module, "__name__", "").startswith("transformer_engine") and hasattr(
                    module, "get_device_compute_capability"
                ):
                    module.get_device_compute_capability = lambda *a, **k: 90
            te_gemm._v2_grouped_gemm_available = False  # the per-group path TE takes with cuBLAS < 13.4
        else:
            devices = [d for d in jax.devices() if d.platform == "gpu"][:2]
            if len(devices) < 2:
                ap.error("--kernel te needs two GPUs, or --target-config to compile without them")
    mesh = Mesh(np.array(devices), ("e",))
    dtype = jnp.float32 if args.kernel == "placeholder" else jnp.bfloat16

    def per_device(w: jax.Array, x: jax.Array) -> jax.Array:
        return gemm(x, w, jnp.full((GROUPS,), ROWS // GROUPS, jnp.int32))

    def layer(x: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        y = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("e")), out_specs=P("e"), check_vma=False)(w, x)
        return y, None

    def loss(ws: jax.Array, x: jax.Array) -> jax.Array:
        if args.unrolled:
            for i in range(LAYERS):
                x, _ = layer(x, ws[i])
        else:
            x, _ = jax.lax.scan(layer, x, ws)
        return jnp.sum(x.astype(jnp.float32))

    ws = jax.ShapeDtypeStruct((LAYERS, GROUPS, K, N), dtype, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((2 * ROWS, K), dtype, sharding=NamedSharding(mesh, P("e")))
    jax.jit(loss if args.forward_only else jax.grad(loss)).lower(ws, x).compile()
    print("compiled", " ".join(argv), "JAX", jax.__version__, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
