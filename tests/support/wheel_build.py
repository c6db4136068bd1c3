"""The sdist -> wheel build of this checkout, as pip does it, shared by the packaging and image tests.

tests/conftest.py builds each distribution once per test session (fixtures `wheel`, `client_wheel`): the
packaging and image tests only read or install the files, so one build serves both."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What an sdist is made from; everything else in the checkout (tests, bench, docs) stays out of the package.
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "protos", "services", "inferscale_server", "inferscale_core",
           "inferscale_client", "client", "charts/inferscale/values.yaml")


def run(cmd: list[str], cwd: Path, timeout: float = 300, env: dict | None = None) -> str:
    """cmd's stdout; a failure shows the end of its output."""
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def copy_sources(src: Path) -> Path:
    """A copy of the checkout's package sources in `src` (no generated code; client/'s links kept as links)."""
    src.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "_generated", "*.egg-info", "build", "dist")
    for name in SOURCES:
        p = ROOT / name
        if p.is_symlink():  # inferscale_server -> services: the package's name, the repository's folder
            (src / name).symlink_to(p.readlink())
        elif p.is_dir():
            shutil.copytree(p, src / name, ignore=ignore, symlinks=True)
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, src / name)
    return src


def sdist_then_wheel(project: Path, dist_name: str) -> Path:
    """sdist of `project` (no generated code in it), then a wheel built from that sdist, as pip does."""
    work = project.parent / f"build-{dist_name}"
    # --no-build-isolation: the build requirements (setuptools, grpcio-tools) come from the test venv.
    build = f"from setuptools import build_meta as b; print(b.build_sdist({str(work / 'sdist')!r}))"
    run([sys.executable, "-c", build], project)
    (sdist,) = (work / "sdist").glob(f"{dist_name}-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
        assert any(n.endswith("protos/inferscale/v1/memory.proto") for n in names)
        assert not any("_generated" in n for n in names), "the sdist must not carry generated code"
        tf.extractall(work / "unpacked", filter="data")
    (unpacked,) = (work / "unpacked").iterdir()
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"),
         str(unpacked)], work)
    (whl,) = (work / "dist").glob(f"{dist_name}-*.whl")
    return whl
