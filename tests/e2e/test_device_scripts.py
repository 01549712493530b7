"""The one-call device scripts' own logic, run by bash here with stand-ins for nvidia-smi and python3:
one-GPU rungs go side by side, one per GPU; two-GPU runs start one process per GPU (or one for both);
everything lands in one archive under $OUT. A shell mistake there would cost lent device time."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from conftest import REPO

FAKE_SMI = """#!/bin/bash
if [ "$1" = -L ]; then echo "GPU 0: NVIDIA H200"; echo "GPU 1: NVIDIA H200"; else echo "index, name"; fi
"""
# Logs each call with the variables the scripts set; `bench` also logs when it starts and ends (1 s later).
FAKE_PYTHON = """#!/bin/bash
echo "CVD=${CUDA_VISIBLE_DEVICES-unset} PID=${JAX_PROCESS_ID-unset} N=${JAX_NUM_PROCESSES-unset} $*" >> "$CALLS"
echo "$PYTHONPATH $*" >> "$CALLS.pythonpath"
case "$*" in
  *" bench "*fails=1*) for a in "$@"; do case $a in base_output_directory=*) d=${a#*=};; esac; done
               mkdir -p "$d/run"; echo "last MaxText line: compiling" > "$d/run/maxtext.log"; exit 3;;
  *" bench "*) echo "start $(date +%s.%N) $*" >> "$CALLS.times"; sleep 1
               echo "end $(date +%s.%N) $*" >> "$CALLS.times"
               echo "step time            median 0.459 s (min 0.451, max 0.483)";;
  *" plan "*2gpu-fsdp*) echo "maxtext-moe: error: boom" >&2; exit 2;;
  *" plan "*) echo "start $(date +%s.%N) $*" >> "$CALLS.times"; sleep 0.3
              echo "end $(date +%s.%N) $*" >> "$CALLS.times"; echo '{"route": "gpu"}';;
esac
exit 0
"""


def run_script(
    tmp_path: Path, script: str, *args: str, python: str = FAKE_PYTHON, **extra_env: str
) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    bin_dir, out, te = tmp_path / "bin", tmp_path / "out", tmp_path / "te"
    for d in (bin_dir, out, te):
        d.mkdir()
    (te / "activate.sh").write_text("")
    for name, text in (("nvidia-smi", FAKE_SMI), ("python3", python)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        OUT=str(out),
        TE_ROOT=str(te),
        CALLS=str(calls),
        DEVICE_RESULTS=str(tmp_path / "results"),
        **{
            "FA3_ARCHIVE": str(tmp_path / "no-fa3.tar.xz"),  # the checkout's own .device/ stays out of the test
            "FA3_ROOT": str(tmp_path / "fa3"),
            **extra_env,
        },
    )
    for name in ("CUDA_VISIBLE_DEVICES", "JAX_PROCESS_ID", "JAX_NUM_PROCESSES"):  # as the scripts would find them
        env.pop(name, None)
    proc = subprocess.run(
        ["bash", f"scripts/device/{script}", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    return proc, calls.read_text().splitlines() if calls.exists() else [], out / "results.tgz"


def intervals(tmp_path: Path, name: object) -> dict[str, dict[str, float]]:
    """When each fake run started and ended, keyed by `name(call line)`."""
    times: dict[str, dict[str, float]] = {}
    for line in (tmp_path / "calls.txt.times").read_text().splitlines():
        what, t = line.split()[:2]
        times.setdefault(name(line), {})[what] = float(t)
    return times


def rung_name(call: str) -> str:
    return re.search(r"base_output_directory=/tmp/runs/(\w+)", call).group(1)


def packed(archive: Path) -> set[str]:
    with tarfile.open(archive) as t:
        return {Path(n).name for n in t.getnames()}


def test_ladder_runs_one_rung_per_gpu_side_by_side(tmp_path: Path) -> None:
    proc, calls, archive = run_script(tmp_path, "proxy_ladder_h200.sh", "8", "a x=1", "b --profile y=2", "c z=3")
    assert proc.returncode == 0, proc.stderr
    bench = {rung_name(c): c for c in calls if " bench " in c}
    assert sorted(bench) == ["a", "b", "c"]
    assert bench["a"].startswith("CVD=0 ") and bench["b"].startswith("CVD=1 ") and bench["c"].startswith("CVD=0 ")
    assert all("--steps 8 --warmup 3" in c for c in bench.values())
    assert bench["a"].endswith("x=1") and bench["b"].endswith("--profile y=2")
    assert proc.stdout.count("step time            median 0.459 s") == 3
    assert {"a.summary", "b.summary", "c.summary", "a.log", "gpu.txt"} <= packed(archive)
    times = intervals(tmp_path, rung_name)
    assert times["b"]["start"] < times["a"]["end"] and times["a"]["start"] < times["b"]["end"]  # side by side
    assert times["c"]["start"] >= max(times["a"]["end"], times["b"]["end"])  # the next round waits for both


def test_a_failed_rung_summary_ends_with_its_maxtext_log(tmp_path: Path) -> None:
    """A rung that fails or is stopped at its time limit says where MaxText was (its log's tail)."""
    name = f"failing_{os.getpid()}"
    try:
        proc, _, archive = run_script(tmp_path, "proxy_ladder_h200.sh", "6", f"{name} fails=1")
        assert proc.returncode == 0, proc.stderr
        summary = proc.stdout[proc.stdout.index(f"=== {name}") :]
        assert "rc=3" in summary and "last MaxText line: compiling" in summary, summary
        assert f"{name}.summary" in packed(archive)
    finally:
        shutil.rmtree(f"/tmp/runs/{name}", ignore_errors=True)


def test_a_ladder_rung_can_run_another_source_tree(tmp_path: Path) -> None:
    """NAME@DIR: the rung's maxtext_moe comes from DIR (an older commit carried in .device, for an A/B)."""
    proc, calls, archive = run_script(tmp_path, "proxy_ladder_h200.sh", "6", "now x=1", "base@maxtext_moe x=1")
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "calls.txt.pythonpath").read_text().splitlines()
    paths = {rung_name(line): line.split()[0].split(":")[0] for line in lines if " bench " in line}
    assert paths == {"now": str(REPO), "base": str(REPO / "maxtext_moe")}
    assert {"now.summary", "base.summary"} <= packed(archive)


def test_a_rung_of_another_source_tree_runs_that_trees_package_from_the_repository_root(tmp_path: Path) -> None:
    """The rung's Python itself (not a stand-in) starts from the repository root, whose own `maxtext_moe` Python
    finds first for `-m` unless told not to: the other tree's package must be the one that runs."""
    tree = tmp_path / "tree" / "maxtext_moe"
    tree.mkdir(parents=True)
    (tree / "__init__.py").write_text("")
    (tree / "__main__.py").write_text("print('maxtext_moe of the other tree')\n")
    real_bench = f"""#!/bin/bash
case "$*" in *" bench "*) exec {sys.executable} "$@";; esac
"""
    proc, _, archive = run_script(tmp_path, "proxy_ladder_h200.sh", "6", f"base@{tree.parent}", python=real_bench)
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(archive) as t:
        log = t.extractfile(next(m for m in t.getmembers() if m.name.endswith("base.log"))).read().decode()
    assert "maxtext_moe of the other tree" in log, log[-2000:]


def test_a_ladder_rung_can_name_another_recipe(tmp_path: Path) -> None:
    """A word without "=" after the rung's name is the recipe it benches (the FP8 proxy beside upstream's best
    on the BF16 one, in one call); without it the one-GPU proxy."""
    proc, calls, _ = run_script(tmp_path, "proxy_ladder_h200.sh", "6", "fp8 deepseek3-proxy-h200-1gpu-fp8", "up x=1")
    assert proc.returncode == 0, proc.stderr
    bench = {rung_name(c): c.split(" bench ")[1].split()[0] for c in calls if " bench " in c}
    assert bench == {"fp8": "deepseek3-proxy-h200-1gpu-fp8", "up": "deepseek3-proxy-h200-1gpu"}
    assert "=== fp8 (GPU 0," in proc.stdout and ": deepseek3-proxy-h200-1gpu-fp8 rc=0" in proc.stdout


def test_two_gpu_runs_start_one_process_per_gpu_or_one_for_both(tmp_path: Path) -> None:
    proc, calls, archive = run_script(tmp_path, "proxy_2gpu_h200x2.sh", "6", "two 2 rec k=1", "one 1 rec")
    assert proc.returncode == 0, proc.stderr
    bench = [c for c in calls if " bench " in c]
    assert sorted(c.split(" -m")[0] for c in bench[:2]) == ["CVD=unset PID=0 N=2", "CVD=unset PID=1 N=2"]
    assert bench[2].startswith("CVD=unset PID=unset N=unset") and " bench rec --steps 6 " in bench[2]
    ep = [c for c in calls if "benchmarks/bench_ep_dispatch.py" in c]
    assert sorted(c.split(" benchmarks/")[0] for c in ep) == ["CVD=unset PID=0 N=2", "CVD=unset PID=1 N=2"]
    assert all("--backend te" in c for c in ep)
    assert {
        "two.p0.log",
        "two.p1.log",
        "one.p0.log",
        "dispatch_gpu.log",
        "ep_dispatch_te_all_to_all_f-1.p0.log",
    } <= packed(archive)


def test_plan_compile_runs_every_recipe_under_a_limit_past_failures_then_the_table(tmp_path: Path) -> None:
    proc, calls, archive = run_script(tmp_path, "plan_compile_h200.sh")
    assert proc.returncode == 0, proc.stderr
    plans = [c for c in calls if " plan " in c]
    want = sorted(p.stem for p in REPO.glob("recipes/deepseek3-*.yml") if "tiny" not in p.stem)
    assert sorted(c.split(" plan ")[1].split()[0] for c in plans) == want
    assert all(c.endswith("--compile --json") for c in plans)
    assert plans[0].split(" plan ")[1].startswith("deepseek3-proxy")  # the quick ones first
    assert calls[-1].endswith(f"scripts/device/plan_compile_table.py {tmp_path / 'results' / 'plan_compile'}")
    results = tmp_path / "results" / "plan_compile"
    assert not (tmp_path / "out" / "plan_compile").exists()  # only the archive comes back from a device call
    assert sorted(p.stem for p in results.glob("*.json")) == [n for n in want if not n.endswith("2gpu-fsdp")]
    status = (results / "status.txt").read_text()
    assert "deepseek3-proxy-h200-2gpu-fsdp: rc=2" in status and status.count("rc=0") == len(want) - 1
    assert "maxtext-moe: error: boom" in proc.stdout
    assert {"deepseek3-671b-h200-128.json", "deepseek3-proxy-h200-2gpu-fsdp.log"} <= packed(archive)


def test_plan_compile_runs_plan_jobs_recipes_at_once(tmp_path: Path) -> None:
    recipes = [f"recipes/deepseek3-671b-{n}.yml" for n in ("h200-128", "h100-256", "gb200-128")]
    proc, calls, archive = run_script(tmp_path, "plan_compile_h200.sh", *recipes, PLAN_JOBS="2")
    assert proc.returncode == 0, proc.stderr
    times = intervals(tmp_path, lambda line: line.split(" plan ")[1].split()[0].removeprefix("deepseek3-671b-"))
    assert sorted(times) == ["gb200-128", "h100-256", "h200-128"]
    first, second, third = (times[n] for n in ("h200-128", "h100-256", "gb200-128"))
    assert second["start"] < first["end"] and first["start"] < second["end"]  # two at once
    assert third["start"] >= min(first["end"], second["end"])  # never three
    assert calls[-1].endswith("plan_compile_table.py " + str(tmp_path / "results" / "plan_compile"))
    assert {"deepseek3-671b-gb200-128.json", "status.txt"} <= packed(archive)


def test_plan_compile_takes_overrides_after_a_recipe_as_a_variant_of_its_own(tmp_path: Path) -> None:
    spec = "recipes/deepseek3-671b-h200-128.yml scan_layers=true per_device_batch_size=4"
    proc, calls, archive = run_script(tmp_path, "plan_compile_h200.sh", spec, "recipes/deepseek3-671b-h200-128.yml")
    assert proc.returncode == 0, proc.stderr
    plans = sorted(c.split(" plan ")[1] for c in calls if " plan " in c)
    assert plans == [
        "deepseek3-671b-h200-128 --compile --json",
        "deepseek3-671b-h200-128 scan_layers=true per_device_batch_size=4 --compile --json",
    ]
    variant = "deepseek3-671b-h200-128+scan_layers-true+per_device_batch_size-4"
    assert f"{variant}: rc=0" in proc.stdout
    assert {f"{variant}.json", "deepseek3-671b-h200-128.json"} <= packed(archive)


def test_plan_compile_detached_then_collected_by_a_second_call(tmp_path: Path) -> None:
    """PLAN_DETACH=1 returns at once while the compiles go on detached (setsid); --collect waits for them."""
    recipes = [f"recipes/deepseek3-671b-{n}.yml" for n in ("h200-128", "h100-256")]
    proc, _, _ = run_script(tmp_path, "plan_compile_h200.sh", *recipes, PLAN_DETACH="1", PLAN_JOBS="1")
    assert proc.returncode == 0, proc.stderr
    assert "compiling 2 recipe(s) detached" in proc.stdout and "rc=0" not in proc.stdout
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", OUT=str(tmp_path / "out"))
    env |= dict(
        TE_ROOT=str(tmp_path / "te"), CALLS=str(tmp_path / "calls.txt"), DEVICE_RESULTS=str(tmp_path / "results")
    )
    collect = subprocess.run(
        ["bash", "scripts/device/plan_compile_h200.sh", "--collect"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert collect.returncode == 0, collect.stderr
    assert "deepseek3-671b-h200-128: rc=0" in collect.stdout and "deepseek3-671b-h100-256: rc=0" in collect.stdout
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls[-1].endswith("plan_compile_table.py " + str(tmp_path / "results" / "plan_compile"))
    assert {"deepseek3-671b-h100-256.json", "done"} <= packed(tmp_path / "out" / "results.tgz")


def test_plan_compile_table_rows_for_compiled_and_failed_recipes_not_for_the_detached_log(tmp_path: Path) -> None:
    shutil.copy(REPO / "docs/results/plan_compile_h200_proxy_1gpu_autotune_off.json", tmp_path / "proxy.json")
    (tmp_path / "proxy.log").write_text("compiling ...\n")
    (tmp_path / "big.json").write_text("")  # what a compile still running at the time limit leaves
    (tmp_path / "big.log").write_text("  compiling big: 1110 s; last finished: jaxpr to MLIR module conversion\n")
    (tmp_path / "detached.log").write_text("maxtext-moe: error: from another recipe\n")
    table = subprocess.run(
        [sys.executable, "scripts/device/plan_compile_table.py", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert [row.split()[0] for row in table] == ["recipe", "big", "proxy"]
    assert "failed:   compiling big: 1110 s" in table[1]
    assert table[2].split()[1:3] == ["gpu", "1"] and "52.3" in table[2].split()  # XLA's arguments, GiB


def test_a_library_cut_into_carries_is_put_together_only_when_every_part_arrived(tmp_path: Path) -> None:
    """carry_split here, then one call per part there (carry_stash), then carry_join in the call with the last
    part: the same bytes, or a clear error while a part is missing (the cuBLAS and cuDNN carries travel so)."""
    data = os.urandom(75_000_000)  # three parts: 7 MB, 63 MB, 5 MB
    (tmp_path / "lib.tar.xz").write_bytes(data)
    fetch, join = REPO / "scripts/device/carry_fetch.sh", REPO / "scripts/device/carry_join.sh"
    here = tmp_path / "here"
    split = subprocess.run(
        ["bash", "-c", f'source {fetch} && carry_split "$1" "$2" lib', "_", str(tmp_path / "lib.tar.xz"), str(here)],
        capture_output=True,
        text=True,
    )
    assert split.returncode == 0, split.stderr
    parts = sorted(p.name for p in here.iterdir())
    assert parts == [".lib_0", ".lib_1", ".lib_2"] and (here / ".lib_2/sha").exists()
    assert [(here / f".lib_{i}/p{i}").stat().st_size for i in range(3)] == [7_000_000, 63_000_000, 5_000_000]

    def call(part: int, command: str) -> subprocess.CompletedProcess:
        """A device call that carried one part: a working tree holding only that folder."""
        tree = tmp_path / f"call{part}"
        tree.mkdir(exist_ok=True)
        if not (tree / f".lib_{part}").exists():
            shutil.copytree(here / f".lib_{part}", tree / f".lib_{part}")
        env = dict(os.environ, CARRY_STASH=str(tmp_path / "opt"))
        return subprocess.run(
            ["bash", "-c", f"source {join} && {command}"], cwd=tree, env=env, capture_output=True, text=True
        )

    assert call(0, "carry_stash lib").returncode == 0
    early = call(1, "carry_join lib out.tar.xz")  # the part with the sha has not come yet
    assert early.returncode == 1 and "the last part of lib (with its sha) was not carried" in early.stderr
    (tmp_path / "opt/lib/p1").unlink()  # as if the middle call had not run
    gap = call(2, "carry_join lib out.tar.xz")
    assert gap.returncode == 1 and "carry_join: lib lacks .lib_1: carry each in a call before this one" in gap.stderr
    (tmp_path / "opt/lib/p1").write_bytes(data[7_000_000:70_000_000][::-1])  # a part that is not the one cut
    wrong = call(2, "carry_join lib out.tar.xz")
    assert wrong.returncode == 1 and "lib's parts do not make the file that was cut" in wrong.stderr
    assert call(1, "carry_stash lib").stdout.split() == ["p0", "p1", "p2"]
    done = call(2, "carry_join lib out.tar.xz")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "call2/out.tar.xz").read_bytes() == data


def test_gpu_tests_run_the_gpu_marked_tests_and_pack_their_log(tmp_path: Path) -> None:
    proc, calls, archive = run_script(tmp_path, "gpu_tests_h200.sh", "30")
    assert proc.returncode == 0, proc.stderr
    assert [c for c in calls if " pytest " in c] == [
        "CVD=unset PID=unset N=unset -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider"
    ]
    assert "gpu tests: exit 0" in proc.stdout
    assert {"gpu_tests.log", "gpu.txt"} <= packed(archive)


def test_receive_script_runs_the_gpu_tests_then_the_benchmark_in_bf16_and_fp8(tmp_path: Path) -> None:
    proc, calls, _ = run_script(tmp_path, "receive_h200.sh")
    assert proc.returncode == 0, proc.stderr
    assert all("--tokens 16384 24576 --backend" in c for c in calls if "bench_receive.py" in c)
    (tmp_path / "given").mkdir()
    proc, calls, archive = run_script(tmp_path / "given", "receive_h200.sh", "16384")
    assert proc.returncode == 0, proc.stderr
    tests = next(i for i, c in enumerate(calls) if "pytest tests/gpu/test_moe_gpu.py" in c)
    bench = [c for c in calls[tests:] if "bench_receive.py" in c]
    assert [("--fp8 none" in c, "--fp8 current_scaling" in c, "--tokens 16384 --backend te" in c) for c in bench] == [
        (True, False, True),
        (False, True, True),
    ]
    assert {"gpu_tests.log", "receive_none.log", "receive_current_scaling.log"} <= packed(archive)


def test_attention_script_times_fa3_beside_cudnn_from_the_carried_archive(tmp_path: Path) -> None:
    """With FA3's archive carried, common.sh unpacks it and puts it on PYTHONPATH; the script times it beside
    cuDNN at each shape."""
    lib = tmp_path / "build" / "flash_attn3_jax_lib"
    lib.mkdir(parents=True)
    (lib / "flash_api.so").write_bytes(b"")
    archive = tmp_path / "fa3_h200.tar.xz"
    subprocess.run(["tar", "-cJf", str(archive), "-C", str(tmp_path / "build"), "."], check=True)
    proc, calls, archive_out = run_script(
        tmp_path, "attention_h200.sh", "6", FA3_ARCHIVE=str(archive), KERNELS="cudnn fa3", SHAPES="4096:6 8192:3"
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "fa3" / "flash_attn3_jax_lib" / "flash_api.so").exists()
    runs = [
        re.search(r"--implementation (\w+) --seq (\d+) --batch (\d+)", c).groups()
        for c in calls
        if "bench_attention" in c
    ]
    assert runs == [("cudnn", "4096", "6"), ("fa3", "4096", "6"), ("cudnn", "8192", "3"), ("fa3", "8192", "3")]
    paths = (tmp_path / "calls.txt.pythonpath").read_text().splitlines()
    assert all(line.split()[0].endswith(f":{tmp_path / 'fa3'}") for line in paths if "bench_attention" in line)
    assert {"attention.txt", "attention_fa3_s8192.log"} <= packed(archive_out)
