"""Which device route `plan --compile` takes, on real resolved recipes (no jax, nothing compiled)."""

from __future__ import annotations

import re

import pytest

from maxtext_moe.cli import resolve
from maxtext_moe.errors import UserError
from maxtext_moe.plan import compile_route, compiled


def test_gpu_machine_mocks_one_process_per_gpu_of_the_recipe() -> None:
    r = resolve("deepseek3-671b-h200-128", [])
    route = compile_route.choose_route(r, gpus_here=1)
    assert route.name == "gpu" and route.mock_gpu_topology == "1x128x1"
    assert route.overrides == ("dataset_type=synthetic",)  # no corpus named yet: the batch shapes are the same
    assert route.env["XLA_FLAGS"].endswith(compile_route.MOCK_GPU_FLAGS)
    assert compile_route.choose_route(r, gpus_here=8).mock_gpu_topology == "1x16x8"
    with pytest.raises(UserError, match="whole number of hosts"):
        compile_route.choose_route(r, gpus_here=3)
    assert compile_route.choose_route(resolve("deepseek3-proxy-h200-1gpu", []), gpus_here=1).overrides == ()


def test_without_a_gpu_the_recipe_is_switched_to_cpu_kernels_and_large_counts_refused() -> None:
    route = compile_route.choose_route(resolve("deepseek3-proxy-h200-2gpu", []), gpus_here=0)
    assert route.name == "cpu" and route.mock_gpu_topology is None
    assert {"topology.hardware=cpu", "moe.gemm=ragged_dot", "topology.gpus_per_node=2"} <= set(route.overrides)
    assert route.env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    tiny = compile_route.choose_route(resolve("deepseek3-tiny-cpu", []), gpus_here=1)  # a CPU recipe stays on the CPU
    assert tiny.name == "cpu" and "moe.impl=ours" not in tiny.overrides
    with pytest.raises(UserError, match="refused") as e:
        compile_route.choose_route(resolve("deepseek3-671b-gb300-1024", []), gpus_here=0)
    assert e.value.fix


def test_without_a_gpu_but_with_jax_cuda_plugin_the_recipe_compiles_deviceless_for_its_own_gpus() -> None:
    route = compile_route.choose_route(resolve("deepseek3-671b-h200-128", []), gpus_here=0, deviceless_ok=True)
    assert route.name == "gpu-aot" and route.deviceless_topology == "1x16x8" and route.mock_gpu_topology is None
    assert route.overrides == ("dataset_type=synthetic",)  # the recipe as is, but for the corpus stand-in
    assert route.env["JAX_PLATFORMS"] == "cpu" and route.env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] == "1"
    assert route.env["XLA_FLAGS"].endswith(f"{compile_route.MOCK_GPU_FLAGS} --xla_force_host_platform_device_count=128")
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in route.env["XLA_FLAGS"]  # the recipe's own flags
    one = compile_route.choose_route(resolve("deepseek3-proxy-h200-1gpu", []), gpus_here=0, deviceless_ok=True)
    assert one.deviceless_topology == "1x1x1" and "H200" in one.description
    gpu_here = compile_route.choose_route(resolve("deepseek3-proxy-h200-1gpu", []), gpus_here=1, deviceless_ok=True)
    assert gpu_here.name == "gpu"  # a GPU here compiles on it, kernels as that GPU picks them
    cpu_recipe = compile_route.choose_route(resolve("deepseek3-tiny-cpu", []), gpus_here=0, deviceless_ok=True)
    assert cpu_recipe.name == "cpu"


def test_deviceless_route_stands_jax_cudnn_attention_in_for_tes() -> None:
    """TE's attention asks the GPU driver for its fused kernel while the step is traced; deviceless, the GB200
    recipe's compile stopped there ("CUDA driver version is insufficient", 2026-12-01). JAX's cuDNN flash
    attention, the Hopper recipes' kernel, compiles without a driver and is listed as an override."""
    gb200 = compile_route.choose_route(resolve("deepseek3-671b-gb200-128", []), gpus_here=0, deviceless_ok=True)
    assert gb200.name == "gpu-aot" and "attention=cudnn_flash_jax" in gb200.overrides
    assert "TE's attention" in gb200.description
    on_gpu = compile_route.choose_route(resolve("deepseek3-671b-gb200-128", []), gpus_here=8, deviceless_ok=True)
    assert "attention=cudnn_flash_jax" not in on_gpu.overrides  # a GPU here answers TE itself


def test_fa3_recipes_compile_with_cudnn_attention_where_no_gpu_runs_fa3() -> None:
    """FA3's library may be absent where the plan compiles; deviceless, cuDNN's kernel (same residuals) stands in,
    and the XLA:CPU route's switches leave a recipe that still resolves."""
    fa3 = ["attention.kernel=fa3"]
    aot = compile_route.choose_route(resolve("deepseek3-proxy-h200-1gpu", fa3), gpus_here=0, deviceless_ok=True)
    assert aot.name == "gpu-aot" and "attention.kernel=cudnn" in aot.overrides and "FlashAttention-3" in aot.description
    cpu = compile_route.choose_route(resolve("deepseek3-proxy-h200-1gpu", fa3), gpus_here=0, deviceless_ok=False)
    assert cpu.name == "cpu"
    assert resolve("deepseek3-proxy-h200-1gpu", [*fa3, *cpu.overrides]).attention["kernel"] == "cudnn"
    plain = compile_route.choose_route(resolve("deepseek3-proxy-h200-1gpu", []), gpus_here=0, deviceless_ok=True)
    assert "attention.kernel=cudnn" not in plain.overrides


def test_deviceless_target_describes_the_recipes_gpu_kind() -> None:
    from maxtext_moe.recipe.hardware import profile
    from maxtext_moe.upstream import deviceless

    h200, gb300 = deviceless.target_config(profile("h200")), deviceless.target_config(profile("gb300"))
    assert "cuda_compute_capability { major: 9 minor: 0 }" in h200 and "core_count: 132" in h200
    assert "cuda_compute_capability { major: 10 minor: 3 }" in gb300 and "core_count: 160" in gb300


def test_deviceless_target_has_the_memory_cuda_reports() -> None:
    """XLA sizes its scheduler budget from the device description's memory, which a GPU gives as
    cuDeviceTotalMem: 150,109,880,320 bytes on the lent H200, where nvidia-smi says 143,771 MiB
    (docs/results/h200_device_memory_2026-12-02.txt). Blackwell's: the total PyTorch prints on one (184.31 GiB on
    a GB200, 276.50 on a GB300), not the vendors' 186 and 288 GB."""
    from maxtext_moe.recipe.hardware import profile
    from maxtext_moe.upstream import deviceless

    def described(kind: str) -> int:
        config = deviceless.target_config(profile(kind))
        return int(re.search(r"device_memory_size: (\d+)", config).group(1))

    assert described("h200") == pytest.approx(150_109_880_320, rel=1e-4)
    assert described("gb200") / 2**30 == pytest.approx(184.31, abs=0.01)
    assert described("gb300") / 2**30 == pytest.approx(276.50, abs=0.01)


def test_device_total_counts_donated_buffers_once() -> None:
    mem = {"argument_size": 10, "output_size": 10, "alias_size": 10, "temp_size": 5, "generated_code_size": 1}
    assert compiled.device_total(mem) == 16
    assert compiled.device_total({"host_temp_size": 3}, "host_") == 3


def test_local_gpus_are_the_visible_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU of four given to the compile: the mock topology repeats one GPU per host, as jax will see it."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert compile_route.local_gpus() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert compile_route.local_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert compile_route.local_gpus() == 0


def test_te_moe_block_recipes_are_sent_to_the_cpu_route_not_a_gpu_one() -> None:
    """MaxText bootstraps TE's NCCL EP before a te_moe_block step; under the mock topology the compile stopped
    with "TE MoE EP has not been bootstrapped yet" (H200, 2026-12-01). Refused up front with the way round."""
    published = resolve("deepseek3-671b-published-gb200-128", [])
    with pytest.raises(UserError, match="NCCL EP") as e:
        compile_route.choose_route(published, gpus_here=1)
    assert e.value.key == "te_moe_block" and "CUDA_VISIBLE_DEVICES=''" in e.value.fix
    for deviceless_ok in (False, True):  # not the deviceless compile either: it would bootstrap the same way
        route = compile_route.choose_route(published, gpus_here=0, deviceless_ok=deviceless_ok)
        assert route.name == "cpu" and "te_moe_block=false" in route.overrides
