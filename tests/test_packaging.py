"""`pip install .` as a user does it: an sdist, a wheel built from it (the build hook generates the gRPC code),
installed (not editable) into a fresh virtualenv, used from outside the source tree.

The fresh venv sees the test venv's site-packages through a .pth file (torch, grpc, ray ... are not
downloaded again) but NOT its editable install of this checkout: a .pth line adds a folder, the .pth files
inside that folder (the editable finder) are not run. The wheel is installed with --no-deps
--ignore-installed, so the editable install next door is never touched.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from redis_fixture import redis_url  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent
# What an sdist is made from; everything else in the checkout (tests, bench, docs) stays out of the package.
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "protos", "services", "inferscale_core")
GENERATED = ("services/_generated/memory_pb2.py", "services/_generated/memory_pb2_grpc.py",
             "services/_generated/memory.proto")


def _run(cmd: list[str], cwd: Path, timeout: float = 300, env: dict | None = None) -> str:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """sdist of a copy of the checkout (no generated code in it), then a wheel built from that sdist."""
    work = tmp_path_factory.mktemp("pkg")
    src = work / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "_generated", "*.egg-info", "build", "dist")
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=ignore)
        else:
            shutil.copy2(p, src / name)
    # --no-build-isolation: the build requirements (setuptools, grpcio-tools) come from the test venv.
    _run([sys.executable, "-c", "from setuptools import build_meta as b; print(b.build_sdist('../sdist'))"], src)
    (sdist,) = (work / "sdist").glob("inferscale-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
        assert any(n.endswith("protos/inferscale/v1/memory.proto") for n in names)
        assert not any("_generated" in n for n in names), "the sdist must not carry generated code"
        tf.extractall(work / "unpacked", filter="data")
    (unpacked,) = (work / "unpacked").iterdir()
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"),
          str(unpacked)], work)
    (whl,) = (work / "dist").glob("inferscale-*.whl")
    return whl


def test_wheel_carries_the_generated_grpc_code(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(GENERATED) <= names
    assert "services/codegen.py" in names and "inferscale_core/cli.py" in names
    assert not any(n.startswith(("tests/", "bench/", "protos/")) for n in names)
    assert not any(n.endswith(".lock") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "inferscale = inferscale_core.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


ROUND_TRIP = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path

    import grpc
    import services, services.codegen
    from services.api import pb2, pb2_grpc
    from services.auth import AuthConfig, Authenticator, mint
    from services.gateway import GatewayCore, start_grpc_server
    from services.registry import RedisRegistry

    # the installed copy, not the checkout
    assert Path(services.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), services.__file__
    assert not services.codegen.PROTO_ROOT.exists()

    async def main(url):
        reg = RedisRegistry(url, prefix="pkgtest:")
        secret = sys.argv[2].encode()
        auth = Authenticator(AuthConfig(hs256_secret_file=sys.argv[3]))
        server, port = await start_grpc_server(GatewayCore(reg, backends=None, auth=auth))
        kw = {"timeout": 30, "metadata": (("authorization", "Bearer " + mint(secret, "pkg-user")),)}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb2_grpc.MemoryStub(ch)
                health = await stub.Health(pb2.HealthRequest(), timeout=30)
                added = await stub.AddFacts(pb2.AddFactsRequest(
                    user_id="pkg-user", facts=[pb2.FactInput(text="Installed from a wheel.")]), **kw)
                listed = await stub.ListMemories(pb2.ListMemoriesRequest(user_id="pkg-user"), **kw)
                print("HEALTH", health.status, health.components["registry"])
                print("FACTS", [f.fact_id for f in added.facts] == [f.fact_id for f in listed.facts],
                      [f.text for f in listed.facts])
                await stub.DeleteUser(pb2.DeleteUserRequest(user_id="pkg-user"), **kw)
        finally:
            await server.stop(None)
            reg.close()

    asyncio.run(main(sys.argv[1]))
""")


def test_installed_wheel_serves_grpc_outside_the_checkout(wheel, tmp_path, redis_url):  # noqa: F811
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path).strip())
    (site / "_shared_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--no-index", str(wheel)],
         tmp_path)
    assert (site / "services" / "_generated" / "memory_pb2.py").exists()

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run_dir = tmp_path / "elsewhere"  # cwd is not the checkout, so `import services` cannot pick it up
    run_dir.mkdir()
    secret = os.urandom(32).hex()
    (tmp_path / "jwt-secret").write_text(secret)
    out = _run([str(py), "-c", ROUND_TRIP, redis_url, secret, str(tmp_path / "jwt-secret")], run_dir, timeout=120,
               env=env)
    assert "HEALTH SERVING ok" in out, out
    assert "FACTS True ['Installed from a wheel.']" in out, out

    # the console script of the wheel, from that venv
    help_text = _run([str(venv / "bin" / "inferscale"), "--help"], run_dir, env=env)
    assert "serve" in help_text and "ask" in help_text
