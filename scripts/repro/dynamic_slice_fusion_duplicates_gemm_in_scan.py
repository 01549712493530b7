"""XLA:GPU's dynamic-slice fusion runs a custom-call GEMM twice in a scanned loop whose output is both used and
saved for the backward (JAX 0.11.2).

In a differentiated `jax.lax.scan` whose remat policy saves a GEMM's output, the forward loop writes that output
into the stacked residual buffer (a dynamic-update-slice) and also feeds it to the next operation. The
dynamic-slice fusion pass fuses the custom call with its dynamic-update-slice and leaves the original call for
the other user, so the forward loop's body holds each saved GEMM twice. For Transformer Engine's grouped GEMM in
MaxText's scanned decoder layers that is every saved expert GEMM of every layer. With
`--xla_gpu_enable_dynamic_slice_fusion=false` each runs once.

    python dynamic_slice_fusion_duplicates_gemm_in_scan.py [--no-dynamic-slice-fusion] [--target-config FILE]

TE's `grouped_dense` on one GPU (the one visible, or deviceless for the GPU an XLA:GPU target config describes).
Prints one JSON line: the grouped GEMMs each while loop's body runs per iteration, forward loop first.
docs/UPSTREAM.md has what was found.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

GROUPS, ROWS, K, N, LAYERS = 4, 256, 128, 128, 3


def gemms_per_loop(hlo: str) -> list[int]:
    """Grouped GEMMs each while body runs, whether called directly or inside a fusion it calls."""
    computation = re.compile(r"^(?:ENTRY )?(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", re.S | re.M)
    comps = {m.group(1): m.group(2) for m in computation.finditer(hlo)}

    def count(name: str) -> int:
        body = comps.get(name, "")
        own = len(re.findall(r'custom_call_target="te_grouped_gemm(_v2)?_ffi"', body))
        return own + sum(count(c) for c in re.findall(r"fusion\([^\n]*calls=(%[\w.\-]+)", body))

    bodies = re.findall(r"while\([^\n]*body=(%[\w.\-]+)", hlo)
    return [count(b) for b in bodies]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-dynamic-slice-fusion", action="store_true", help="turn XLA's dynamic-slice fusion off")
    ap.add_argument("--target-config", help="XLA:GPU target config, to compile without a GPU")
    args = ap.parse_args(argv)
    if args.no_dynamic_slice_fusion:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_dynamic_slice_fusion=false"

    import jax
    import jax.numpy as jnp
    import transformer_engine.jax.dense as te_dense
    from jax.ad_checkpoint import checkpoint_name
    from jax.sharding import SingleDeviceSharding

    if args.target_config:
        from jax.experimental import topologies

        with open(args.target_config, encoding="utf-8") as f:
            target = f.read()
        device = topologies.get_topology_desc(platform="cuda", target_config=target, topology="1x1x1").devices[0]
        for module in list(sys.modules.values()):  # TE asks the (absent) GPU for its compute capability
            if getattr(module, "__name__", "").startswith("transformer_engine") and hasattr(
                module, "get_device_compute_capability"
            ):
                module.get_device_compute_capability = lambda *a, **k: 90
    else:
        device = next((d for d in jax.devices() if d.platform == "gpu"), None)
        if device is None:
            ap.error("needs a GPU, or --target-config to compile without one")

    sizes = jnp.full((GROUPS,), ROWS // GROUPS, jnp.int32)
    policy = jax.checkpoint_policies.save_only_these_names("gemm_out")

    def layer(x: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        y = checkpoint_name(te_dense.grouped_dense(x, w, sizes), "gemm_out")
        return jnp.tanh(y), None

    def loss(ws: jax.Array, x: jax.Array) -> jax.Array:
        x, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, ws)
        return jnp.sum(x.astype(jnp.float32))

    on = SingleDeviceSharding(device)
    ws = jax.ShapeDtypeStruct((LAYERS, GROUPS, K, N), jnp.bfloat16, sharding=on)
    x = jax.ShapeDtypeStruct((ROWS, K), jnp.bfloat16, sharding=on)
    hlo = jax.jit(jax.grad(loss)).lower(ws, x).compile().as_text()
    print(json.dumps({"gemms_per_loop_body": gemms_per_loop(hlo), "jax": jax.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
