"""`maxtext-moe doctor`: real runs on this machine, and the comparison logic on described machines."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from maxtext_moe.cli import resolve
from maxtext_moe.tools import doctor, library_versions

H200_RECIPE = "deepseek3-671b-h200-128"


def _h200(**changes) -> doctor.Machine:
    """An H200 node as the lent machine is (shared/device/README.md), with TE loaded from the archive."""
    base = dict(
        jax_version="0.11.2",
        backend="gpu",
        device_kind="NVIDIA H200",
        local_devices=8,
        compute_capability=(9, 0),
        te_version="2.20.2",
        te_error=None,
        te_compiled_v2=True,
        cublaslt=130100,
        nccl=(2, 28, 9),
        host_mem_gib=2000.0,
        nccl_ep_lib="/opt/te/site-packages/transformer_engine/wheel_lib/libnccl_ep.so",
    )
    return doctor.Machine(**(base | changes))


def _gaps(lines: list[doctor.Line]) -> dict[str, str]:
    return {x.item: x.fix for x in lines if x.status == "gap"}


def test_default_cpu_recipe_can_run_here():
    r = run_cli("doctor", timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "deepseek3-tiny-cpu: can run here"
    assert any(line.startswith("ok   jax") and "backend cpu" in line for line in lines)
    assert any(line.startswith("info transformer-engine") for line in lines)
    assert any(line.startswith("info host memory") and "GiB" in line for line in lines)


def test_json_reports_devices_seen_with_the_recipes_environment():
    # Two CPU devices per process only exist if doctor applies the recipe's env before jax starts.
    r = run_cli("doctor", "topology.gpus_per_node=2", "ici_fsdp_parallelism=-1", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["can_run"] is True
    assert report["machine"]["backend"] == "cpu" and report["machine"]["local_devices"] == 2
    assert {c["item"] for c in report["checks"]} >= {
        "jax",
        "gpu",
        "devices",
        "transformer-engine",
        "nccl",
        "host memory",
    }


def test_gpu_recipe_on_this_cpu_machine_exits_nonzero_with_fixes():
    r = run_cli("doctor", H200_RECIPE, timeout=120)
    report = json.loads(run_cli("doctor", H200_RECIPE, "--json", timeout=120).stdout)
    if report["machine"]["backend"] == "gpu":
        pytest.skip("this machine has a GPU")
    assert r.returncode == 1
    gap_lines = [line for line in r.stdout.splitlines() if line.startswith("GAP")]
    assert any("jax" in line and "Fix:" in line for line in gap_lines)
    assert any(
        "transformer-engine" in line and "moe.gemm=te" in line and "pip install '.[gpu]'" in line for line in gap_lines
    )
    assert r.stdout.splitlines()[-1].startswith(f"{H200_RECIPE}: cannot run here")
    compile_line = next(c for c in report["checks"] if c["item"] == "plan --compile")["have"]
    assert compile_line.startswith("XLA:GPU for 128" if report["machine"]["cuda_plugin"] else "XLA:CPU stand-in")


TE_BLOCK = ["moe.impl=maxtext", "te_moe_block=true", "prefuse_moe_weights=true", "te_gmm_quantization=te_no_quant"]
TE_BLOCK += ["routed_bias_update_rate=0.0", "training.bias_update_rate={0: 0}", "n_routing_groups=-1"]


def test_h200_with_old_nccl_runs_our_block_and_takes_the_v1_grouped_gemm():
    """The lent H200's image (NCCL 2.28.9): our block needs no NCCL EP; MaxText's TE block would."""
    lines = doctor.compare(_h200(), resolve(H200_RECIPE, []))
    assert _gaps(lines) == {}
    gemm = next(x for x in lines if x.item == "te grouped gemm")
    assert gemm.have.startswith("V1 per-group") and "130100" in gemm.have
    te_block = _gaps(doctor.compare(_h200(), resolve(H200_RECIPE, TE_BLOCK)))
    assert set(te_block) == {"nccl"} and "2.30.4" in te_block["nccl"]


def test_plan_compile_line_names_the_compiler_this_machine_gives() -> None:
    """A login node without GPUs: XLA:GPU deviceless when JAX's CUDA plugin is there, else the CPU stand-in."""
    login = dict(backend="cpu", device_kind="cpu", local_devices=1, compute_capability=None)
    r = resolve(H200_RECIPE, [])

    def line(m: doctor.Machine, recipe=r) -> str:
        return next(x.have for x in doctor.compare(m, recipe) if x.item == "plan --compile")

    assert line(_h200(**login, cuda_plugin=True)) == "XLA:GPU for 128 h200 GPUs without them (deviceless)"
    assert line(_h200(**login)).startswith("XLA:CPU stand-in")
    assert line(_h200()) == "XLA:GPU on a mock topology of this machine's GPUs"
    te_block = resolve(H200_RECIPE, TE_BLOCK)
    assert line(_h200(), te_block) == "refused here (te_moe_block)"
    refused = next(x for x in doctor.compare(_h200(), te_block) if x.item == "plan --compile")
    assert refused.status == "info" and refused.fix.startswith("compile it without GPUs")
    assert line(_h200(**login, cuda_plugin=True), te_block).startswith("XLA:CPU stand-in")  # the block switched off


def test_h200_with_new_nccl_and_cublas_has_no_gaps_and_v2():
    lines = doctor.compare(_h200(nccl=(2, 30, 4), cublaslt=130400), resolve(H200_RECIPE, []))
    assert _gaps(lines) == {}
    assert next(x for x in lines if x.item == "te grouped gemm").have.startswith("V2 single-kernel")


def test_te_that_fails_to_import_is_a_gap_with_its_error():
    lines = doctor.compare(_h200(nccl=(2, 30, 4), te_error="ImportError: libcudnn.so.9"), resolve(H200_RECIPE, []))
    assert set(_gaps(lines)) == {"transformer-engine"}
    assert "libcudnn.so.9" in next(x for x in lines if x.item == "transformer-engine").have


def test_older_gpu_and_fewer_devices_are_gaps():
    lines = doctor.compare(
        _h200(nccl=(2, 30, 4), compute_capability=(8, 0), device_kind="NVIDIA A100", local_devices=4),
        resolve(H200_RECIPE, []),
    )
    gaps = _gaps(lines)
    assert {"gpu", "devices"} <= set(gaps)
    assert "SM90" in next(x for x in lines if x.item == "gpu").have
    assert "gpus_per_node=4" in gaps["devices"]


@pytest.mark.parametrize("name", ["deepseek3-671b-published-gb200-128", "deepseek3-671b-gb200-128"])
def test_blackwell_mxfp8_recipe_needs_sm100(name: str):
    """MXFP8 experts, in TE's block (te_gmm_quantization) or ours (moe.fp8: mxfp8), need SM100."""
    r = resolve(name, [])
    gaps = _gaps(doctor.compare(_h200(nccl=(2, 30, 4)), r))
    assert "gpu" in gaps and "SM100" in gaps["gpu"]
    assert "gpu" not in _gaps(doctor.compare(_h200(nccl=(2, 30, 4), compute_capability=(10, 0)), r))


def test_nccl_ep_exchange_needs_new_nccl_and_tes_library():
    """Our block with moe.exchange=nccl_ep on the two-H200 proxy: the lent image's NCCL 2.28.9 is a gap, NCCL
    2.30.7 (the carry) is not, and neither is enough without TE's libnccl_ep.so."""
    r = resolve("deepseek3-proxy-h200-2gpu", ["moe.exchange=nccl_ep"])
    old = next(x for x in doctor.compare(_h200(), r) if x.item == "nccl")
    assert old.status == "gap" and "lacks libnccl.so.2 >= 2.30.4" in old.have
    assert "needed by moe.exchange=nccl_ep" in old.have and "moe.exchange=auto" in old.fix
    new = next(x for x in doctor.compare(_h200(nccl=(2, 30, 7)), r) if x.item == "nccl")
    assert new.status == "info" and "2.30.7; NCCL EP usable; needed by moe.exchange=nccl_ep" in new.have
    no_lib = _gaps(doctor.compare(_h200(nccl=(2, 30, 7), nccl_ep_lib=None), r))
    assert set(no_lib) == {"nccl"}
    default = next(x for x in doctor.compare(_h200(), resolve("deepseek3-proxy-h200-2gpu", [])) if x.item == "nccl")
    assert default.status == "info" and "NCCL EP not usable" in default.have and "needed by" not in default.have


@pytest.mark.parametrize("code,version", [(22809, (2, 28, 9)), (23004, (2, 30, 4)), (2804, (2, 8, 4))])
def test_nccl_version_codes(code, version):
    assert library_versions.nccl_version(code) == version


def test_fa3_kernel_needs_its_build_and_names_the_script():
    proxy = resolve("deepseek3-proxy-h200-1gpu", ["attention.kernel=fa3"])
    missing = doctor.compare(_h200(local_devices=1), proxy)
    assert "build_fa3_carry.sh" in _gaps(missing)["flashattention-3"]
    built = doctor.compare(_h200(local_devices=1, fa3="flash-attn3-jax dccfc16; kernels: BF16 sm_90a"), proxy)
    assert "flashattention-3" not in _gaps(built)
    line = next(x for x in built if x.item == "flashattention-3")
    assert line.status == "ok" and "needed by attention.kernel=fa3" in line.have
    cudnn = doctor.compare(_h200(local_devices=1), resolve("deepseek3-proxy-h200-1gpu", []))
    assert next(x for x in cudnn if x.item == "flashattention-3").status == "info"


def test_fa3_build_is_found_on_the_path_without_importing_it(tmp_path, monkeypatch):
    from maxtext_moe.upstream import fa3_attention

    assert fa3_attention.build_info() is None  # this machine has no FA3 build on its path
    (tmp_path / "flash_attn3_jax_lib").mkdir()
    (tmp_path / "flash_attn3_jax_lib" / "flash_api.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    (tmp_path / "BUILD_INFO").write_text("flash-attn3-jax dccfc16\nkernels: BF16 sm_90a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert fa3_attention.build_info() == "flash-attn3-jax dccfc16; kernels: BF16 sm_90a"
