"""Compile MaxText's training step for a device count this machine does not have, and read XLA's memory.

Run as `python -m maxtext_moe.upstream.aot REQUEST.json RESULT.json` in a process whose environment
(XLA_FLAGS, JAX_PLATFORMS, ...) was set before start: `plan.compiled` builds both. Nothing executes on a
device; the step is only lowered and compiled from abstract shapes.

What is MaxText's own (maxtext 0.2.5, `maxtext.trainers.pre_train.train_compile`): `get_shaped_inputs`
(the abstract train state, batch and their shardings), `jit_and_compile`, and the step itself with
its shardings (`maxtext_utils.get_functional_train_with_signature`, ZeRO-1 sharding updates), called in
the order its `main` calls them.

The gaps, filled here: its `get_topology_mesh` either asks for a TPU topology or, for GPUs, sets
`mock_num_gpu_processes` from `compile_topology_num_slices` and looks `compile_topology` up in a table
of TPU/A3-style systems with 8 GPUs per host. We instead turn on JAX's `jax_mock_gpu_topology`
("slices x hosts x GPUs per host", GPUs per host = this machine's real count) before the first device
use; or, without a GPU, describe the recipe's GPUs deviceless (`deviceless.py`; N XLA:CPU host devices
stand in for MaxText's device count, and the compile gets the allocator's limit a GPU would give it) or run
on N XLA:CPU host devices; then build the mesh from those devices with MaxText's `create_device_mesh`, as
`get_topology_mesh` does after choosing its devices. And
MaxText's `train.run` runs its step inside `max_utils.maybe_get_transformer_engine_context` (TE's global
`MeshResource`) and under the mesh, while `train_compile.jit_and_compile` calls `compile()` outside both:
TE's FP8 dense GEMMs, partitioned during `compile()`, then find no mesh resource or an empty mesh. We
compile inside both, and report the error that context hides (`maxtext_errors`).
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any


def _mesh(config: Any, devices: list[Any]) -> Any:
    """`train_compile.get_topology_mesh` after its device choice: MaxText's mesh over `devices`."""
    import jax
    from jax.sharding import AxisType, Mesh
    from maxtext.common.common_types import ShardMode
    from maxtext.utils import maxtext_utils

    jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
    devices = maxtext_utils.create_device_mesh(config, devices)
    kind = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
    return Mesh(devices, config.mesh_axes, axis_types=(kind,) * len(config.mesh_axes))


def _shard_bytes(tree: Any, shardings: Any) -> int:
    """Bytes one device holds of an abstract tree under its shardings (the largest shard of each leaf)."""
    import jax
    import numpy as np

    total = 0
    for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        shape = sharding.shard_shape(leaf.shape) if hasattr(sharding, "shard_shape") else leaf.shape
        total += int(np.prod(shape, dtype=np.int64)) * leaf.dtype.itemsize
    return total


def memory_fields(analysis: Any) -> dict[str, int]:
    """Every byte count XLA's `CompiledMemoryStats` has in this jaxlib (host/offloaded ones included)."""
    return {
        name.removesuffix("_in_bytes"): int(getattr(analysis, name))
        for name in sorted(dir(analysis))
        if name.endswith("_in_bytes") and isinstance(getattr(analysis, name), int)
    }


@contextmanager
def _te_context(config: Any) -> Iterator[None]:
    """MaxText's TE context, raising the error it would turn into a re-yield."""
    from maxtext.utils import max_utils

    from maxtext_moe.upstream import maxtext_errors

    try:
        with max_utils.maybe_get_transformer_engine_context(config):
            yield
    except RuntimeError as e:
        raise maxtext_errors.underlying(e) from None


def compile_step(request: dict[str, Any]) -> dict[str, Any]:
    """Lower and compile the training step that `train` would run for `request`; return XLA's figures."""
    import time

    import jax

    if request.get("mock_gpu_topology"):
        jax.config.update("jax_mock_gpu_topology", request["mock_gpu_topology"])
    chatter = io.StringIO()
    with redirect_stdout(chatter):
        from flax.core.spmd import logical_axis_rules
        from maxtext.trainers.pre_train import train, train_compile
        from maxtext.utils import maxtext_utils, sharding

        from maxtext_moe.moe.settings import MoeSettings
        from maxtext_moe.upstream import maxtext_config, model_patches

        settings = MoeSettings.from_dict(request["moe"])
        if settings.ours:
            from maxtext_moe.upstream import deepseek_layer

            deepseek_layer.install(settings)
        model_patches.install(request["attention"])
        config = maxtext_config.check(request["maxtext"], request["sources"])
        # MaxText's train sets the partitioner from its `shardy` key in main(), which this compile skips.
        jax.config.update("jax_use_shardy_partitioner", config.shardy)
        devices = jax.devices()  # on the deviceless route: stand-ins for MaxText's device count, not compiled for
        if request.get("deviceless"):
            from maxtext_moe.recipe.hardware import profile
            from maxtext_moe.upstream import deviceless

            hw = profile(request["deviceless"]["hardware"])
            deviceless.patch(hw.compute_capability)
            deviceless.pass_memory_size(request["deviceless"]["memory_bytes"])
            devices = deviceless.devices(hw, request["deviceless"]["topology"])
        if len(jax.devices()) != request["num_devices"] or len(devices) != request["num_devices"]:
            raise RuntimeError(
                f"{len(jax.devices())} devices visible, {len(devices)} to compile for, "
                f"{request['num_devices']} requested"
            )
        mesh = _mesh(config, devices)
        args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
        params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
        input_shardings = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings)
        data_sharding = sharding.get_input_data_sharding(config, mesh)
        func, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
            train.train_step, data_sharding, input_shardings, model, config, params_shardings
        )
        jax.config.update("jax_log_compiles", True)  # JAX's phase timings in the log: `plan.compiled` shows them
        start = time.monotonic()
        with _te_context(config), jax.set_mesh(mesh):
            compiled = train_compile.jit_and_compile(
                func,
                args,
                kwargs,
                mesh,
                in_shard,
                out_shard,
                static,
                donate,
                config,
                logical_axis_rules(config.logical_axis_rules),
            )
        seconds = time.monotonic() - start
    return {
        "memory": memory_fields(compiled.memory_analysis()),
        "state_bytes": _shard_bytes(args[0], input_shardings),
        "batch_bytes": _shard_bytes(args[1], jax.tree.map(lambda _: data_sharding, args[1])),
        "compile_s": seconds,
        "devices": len(devices),
        "processes": jax.process_count(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "mesh": {str(k): int(v) for k, v in mesh.shape.items()},
        "num_slices": int(config.num_slices),
        "partitioner": "shardy" if jax.config.jax_use_shardy_partitioner else "gspmd",
    }


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    Path(argv[1]).write_text(json.dumps(compile_step(request), indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
