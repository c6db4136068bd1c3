"""`pip install .` as a user does it: an sdist, a wheel built from it (the build hook generates the gRPC code),
installed (not editable) into a fresh virtualenv, used from outside the source tree. The same for the client-only
distribution (client/): installed where neither torch nor the server's packages can be imported, it talks to a
real gRPC server with its blocking client, its asyncio client and its `inferscale` commands.

The fresh venv sees the test venv's site-packages through a .pth file (torch, grpc, ray ... are not
downloaded again) but NOT its editable install of this checkout: a .pth line adds a folder, the .pth files
inside that folder (the editable finder) are not run. The wheel is installed with --no-deps
--ignore-installed, so the editable install next door is never touched.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

from support.wheel_build import ROOT, run

GENERATED = ("inferscale_client/_generated/memory_pb2.py", "inferscale_client/_generated/memory_pb2_grpc.py",
             "inferscale_client/_generated/memory.proto")
# `wheel` and `client_wheel`: built once per session from a copy of the checkout (tests/conftest.py)


def test_wheel_carries_the_generated_grpc_code(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(GENERATED) <= names
    assert "inferscale_server/app.py" in names and "inferscale_core/cli.py" in names
    # the server package is installed as inferscale_server, never as a generic top-level `services`
    assert not any(n.startswith("services/") for n in names), sorted(n for n in names if n.startswith("services/"))
    assert not any("/_generated/" in n and not n.startswith("inferscale_client/") for n in names), "one copy of the generated code"
    assert not any(n.startswith(("tests/", "bench/", "protos/")) for n in names)
    # benchmark-only code (LoCoMo loading, scoring, statistics, reports) lives in bench/eval, never in the product
    assert not any("/eval/" in n or n.startswith("eval/") for n in names), sorted(n for n in names if "eval/" in n)
    assert not any(n.endswith(".lock") for n in names)
    # what only the tests and benchmarks use lives in bench/ (a local Redis, the transformers injection reference);
    # the local Mooncake Store is the product's (`inferscale serve --local-mooncake`)
    assert not any(n.endswith(("/local_redis.py", "/hf_inject.py")) for n in names)
    assert "inferscale_server/local_mooncake.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "inferscale = inferscale_core.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


ROUND_TRIP = textwrap.dedent("""
    import asyncio, importlib.util, sys
    from pathlib import Path

    import grpc
    import inferscale_server
    from inferscale_client import codegen
    from inferscale_server.api import pb2, pb2_grpc
    from inferscale_server.auth import AuthConfig, Authenticator, mint
    from inferscale_server.gateway import GatewayCore, start_grpc_server
    from inferscale_server.registry import RedisRegistry

    # the installed copy, not the checkout
    assert Path(inferscale_server.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), inferscale_server.__file__
    assert not codegen.PROTO_ROOT.exists()
    assert importlib.util.find_spec("services") is None, "a top-level `services` package is installed"

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


def test_installed_wheel_serves_grpc_outside_the_checkout(wheel, tmp_path, redis_url):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    py = venv / "bin" / "python"
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path).strip())
    (site / "_shared_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--no-index", str(wheel)],
         tmp_path)
    assert (site / "inferscale_client" / "_generated" / "memory_pb2.py").exists()

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run_dir = tmp_path / "elsewhere"  # cwd is not the checkout, so `import inferscale_server` cannot pick it up
    run_dir.mkdir()
    secret = os.urandom(32).hex()
    (tmp_path / "jwt-secret").write_text(secret)
    out = run([str(py), "-c", ROUND_TRIP, redis_url, secret, str(tmp_path / "jwt-secret")], run_dir, timeout=120,
               env=env)
    assert "HEALTH SERVING ok" in out, out
    assert "FACTS True ['Installed from a wheel.']" in out, out

    # the console script of the wheel, from that venv
    help_text = run([str(venv / "bin" / "inferscale"), "--help"], run_dir, env=env)
    assert "serve" in help_text and "ask" in help_text
    # the benchmarks are not in the wheel: `inferscale bench` says so and where to run it
    bench = subprocess.run([str(venv / "bin" / "inferscale"), "bench", "ttft"], cwd=run_dir, env=env,
                           capture_output=True, text=True, timeout=120)
    assert bench.returncode == 2 and "source checkout" in bench.stderr, (bench.returncode, bench.stderr[-2000:])

    # docs/deploy.md's step for a Ray cluster: the Serve config generated from the installed wheel (no charts/
    # beside it) is the chart's committed one
    run([str(py), "-m", "inferscale_server.app", "--emit-serve-config", str(run_dir / "serve.yaml")], run_dir, env=env)
    assert (run_dir / "serve.yaml").read_text() == (ROOT / "charts/inferscale/files/serve-config.yaml").read_text()

    # the chart's secret-init Job (secrets.generateInCluster) runs this module of the installed wheel; outside a
    # pod it says what it needs, with exit status 1 (the hook fails, the install stops)
    init = subprocess.run([str(py), "-m", "inferscale_server.k8s_secrets", "rel-jwt/secret"], cwd=run_dir,
                          env={k: v for k, v in env.items() if k != "KUBERNETES_SERVICE_HOST"},
                          capture_output=True, text=True, timeout=120)
    assert init.returncode == 1 and "KUBERNETES_SERVICE_HOST" in init.stderr, (init.returncode, init.stderr[-2000:])


# ---------------------------------------------------------------------------------------------- client-only
def test_client_wheel_carries_only_the_client(wheel, client_wheel):
    names = set(zipfile.ZipFile(client_wheel).namelist())
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"inferscale_client"}, tops  # no generic top-level name, nothing of the server
    assert set(GENERATED) <= names
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [ln.split(":", 1)[1].strip() for ln in zipfile.ZipFile(client_wheel).read(meta).decode().splitlines()
                if ln.startswith("Requires-Dist:")]
    assert sorted(r.split(">")[0].split("<")[0].split("=")[0] for r in requires) == ["grpcio", "protobuf"], requires
    version = [ln for ln in zipfile.ZipFile(client_wheel).read(meta).decode().splitlines()
               if ln.startswith("Version:")]
    full_meta = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
    assert version[0] in zipfile.ZipFile(wheel).read(full_meta).decode().splitlines()  # released together
    # the same client files in both distributions (built from one source)
    full = zipfile.ZipFile(wheel)
    for n in names:
        if n.startswith("inferscale_client/") and not n.endswith(".stamp.json"):
            assert full.read(n) == zipfile.ZipFile(client_wheel).read(n), n


def _link_distributions(requirements: list[str], into: Path) -> None:
    """Make `into` a site folder holding exactly the installed distributions `requirements` need (their
    dependencies too), linked from the test venv: what `pip install inferscale-client` would bring, no more."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        dist = distribution(req.name)
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        todo += [Requirement(r) for r in dist.requires or ()]
        site = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files if not str(f).startswith("..")}:
            if not (into / top).exists() and (site / top).exists():
                (into / top).symlink_to(site / top)


CLIENT_ROUND_TRIP = textwrap.dedent("""
    import asyncio, importlib.util, sys, sysconfig
    from pathlib import Path

    import inferscale_client
    from inferscale_client import AsyncMemoryClient, MemoryClient

    site = Path(sysconfig.get_path("purelib"))
    assert Path(inferscale_client.__file__).resolve().is_relative_to(site.resolve()), inferscale_client.__file__
    for name in ("torch", "vllm", "ray", "redis", "services", "inferscale_server", "inferscale_core"):
        assert importlib.util.find_spec(name) is None, f"{name} is importable in the client-only venv"
    assert not (site / "services").exists()

    with MemoryClient() as c:  # target and token from INFERSCALE_TARGET / INFERSCALE_TOKEN
        (f,) = c.add_facts("pkg-client", ["Installed without torch."], metadata={"src": "sync"})
        assert [g.fact_id for g in c.list("pkg-client")] == [f.fact_id]

    async def main():
        async with AsyncMemoryClient() as c:
            got = await c.get("pkg-client", f.fact_id)
            upd = await c.update("pkg-client", f.fact_id, text="Installed without torch, twice.")
            listed = [g.text async for g in c.list("pkg-client")]
            health = await c.health()
            print("ASYNC", got.text, upd.version, listed, health.status)

    asyncio.run(main())
    print("SYNC", f.fact_id, dict(f.metadata), "torch" in sys.modules)
""")


def test_client_only_install_imports_without_torch_and_talks_to_a_real_server(client_wheel, tmp_path, redis_url,
                                                                                jwt_secret):
    """inferscale-client in a venv that sees only grpcio and protobuf (and what they need): its clients and
    commands against the gateway's real gRPC server (registry-only, Redis, auth on)."""
    from support.grpc_thread import ServerThread

    from inferscale_server.auth import AuthConfig, Authenticator
    from inferscale_server.gateway import GatewayCore
    from inferscale_server.registry import RedisRegistry

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    py = venv / "bin" / "python"
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path).strip())
    deps = tmp_path / "deps"
    deps.mkdir()
    _link_distributions(["grpcio", "protobuf"], deps)
    assert not (deps / "torch").exists()
    (site / "_client_deps.pth").write_text(f"{deps}\n")
    # with its dependencies resolved (no index: they must be satisfied by what `deps` holds)
    run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-index", str(client_wheel)],
         tmp_path)

    reg = RedisRegistry(redis_url, prefix=f"pkgclient{os.getpid()}:")
    core = GatewayCore(reg, backends=None, auth=Authenticator(AuthConfig(hs256_secret_file=str(jwt_secret[0]))))
    srv = ServerThread(core)
    try:
        from support.auth_fixture import token_for

        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(INFERSCALE_TARGET=f"127.0.0.1:{srv.port}", INFERSCALE_TOKEN=token_for(jwt_secret[1], "pkg-client"))
        run_dir = tmp_path / "elsewhere"
        run_dir.mkdir()
        out = run([str(py), "-c", CLIENT_ROUND_TRIP], run_dir, timeout=120, env=env)
        assert "ASYNC Installed without torch. 2 ['Installed without torch, twice.'] SERVING" in out, out
        assert "{'src': 'sync'} False" in out, out

        cli = str(venv / "bin" / "inferscale")
        listed = json.loads(run([cli, "list", "pkg-client", "--json"], run_dir, env=env))
        assert [f["text"] for f in listed] == ["Installed without torch, twice."] and listed[0]["version"] == "2"
        fid = listed[0]["fact_id"]
        got = json.loads(run([cli, "update", "pkg-client", fid, "--meta", "k=v", "--json"], run_dir, env=env))
        assert got["metadata"] == {"src": "sync", "k": "v"} and got["version"] == "3"
        assert json.loads(run([cli, "get", "pkg-client", fid, "--json"], run_dir, env=env))["metadata"]["k"] == "v"
        status = json.loads(run([cli, "status", "--json"], run_dir, env=env))
        assert status["status"] == "SERVING" and status["target"] == env["INFERSCALE_TARGET"]
        assert json.loads(run([cli, "delete", "pkg-client", fid, "--json"], run_dir, env=env)) == {
            "user_id": "pkg-client", "deleted_fact_ids": [fid]}
        assert json.loads(run([cli, "list", "pkg-client", "--json"], run_dir, env=env)) == []
        # an error is one line naming the status code, exit 1, no traceback
        bad = subprocess.run([cli, "get", "pkg-client", fid], cwd=run_dir, env=env, capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 1 and bad.stderr.startswith("error: NOT_FOUND: ") and "Traceback" not in bad.stderr
        other = {**env, "INFERSCALE_TOKEN": token_for(jwt_secret[1], "someone-else")}
        bad = subprocess.run([cli, "list", "pkg-client"], cwd=run_dir, env=other, capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 1 and "PERMISSION_DENIED" in bad.stderr, bad.stderr
    finally:
        srv.stop()
        reg.close()


def test_the_server_package_has_one_name():
    """services/ is imported only as inferscale_server (the wheel's name): a second name would load a second copy of
    every module in one process (two registries of Serve classes, two metrics registries)."""
    pattern = re.compile(r"^\s*(from|import)\s+services\b|[\"'`]services\.[a-z_]+[.:]", re.M)
    offenders = [str(p.relative_to(ROOT)) for top in ("services", "inferscale_core", "inferscale_client", "tests", "bench",
                                                       "scripts", "charts", "docker", "docs")
                 for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in (".py", ".sh", ".yaml", ".tpl", ".md")
                 and "_generated" not in p.parts and pattern.search(p.read_text(errors="replace"))]
    assert not offenders, offenders
    assert (ROOT / "inferscale_server").resolve() == (ROOT / "services").resolve()
