"""A gRPC client that shares nothing with the project (tests/unit/test_grpc_interop.py, tests/service/test_grpc_serve_proxy.py): its
modules compiled at test time with grpcio-tools (memory.proto from protos/, grpc.health.v1 written here from the
standard's message shapes), run in an interpreter of its own that never imports `services`. A pytest plugin
(tests/conftest.py): ask for `client_dir` by name."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .paths import REPO as ROOT

# grpc.health.v1 as the gRPC health-checking protocol defines it (message and method shapes, field numbers).
HEALTH_PROTO = """syntax = "proto3";
package grpc.health.v1;
message HealthCheckRequest { string service = 1; }
message HealthCheckResponse {
  enum ServingStatus { UNKNOWN = 0; SERVING = 1; NOT_SERVING = 2; SERVICE_UNKNOWN = 3; }
  ServingStatus status = 1;
}
service Health {
  rpc Check(HealthCheckRequest) returns (HealthCheckResponse);
  rpc Watch(HealthCheckRequest) returns (stream HealthCheckResponse);
}
"""

# The independent client: prints one JSON object with what it saw.
CLIENT = textwrap.dedent('''
    import json, os, sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the modules compiled next to this script
    import grpc
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    from interop import health_pb2, health_pb2_grpc
    from inferscale.v1 import memory_pb2, memory_pb2_grpc

    target, token, user, checkout = sys.argv[1:5]
    out = {"health_pb2": health_pb2.__file__}
    with grpc.insecure_channel(target) as ch:
        grpc.channel_ready_future(ch).result(timeout=60)
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "inferscale.v1.Memory"):
            out["check:" + service] = health_pb2.HealthCheckResponse.ServingStatus.Name(
                health.Check(health_pb2.HealthCheckRequest(service=service), timeout=60).status)
        try:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=60)
        except grpc.RpcError as e:
            out["check:unknown"] = e.code().name
        watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=60)
        out["watch:first"] = health_pb2.HealthCheckResponse.ServingStatus.Name(next(watch).status)
        watch.cancel()
        memory = memory_pb2_grpc.MemoryStub(ch)
        md = [("authorization", "Bearer " + token)]
        fact = memory.AddFacts(memory_pb2.AddFactsRequest(user_id=user, facts=[
            memory_pb2.FactInput(text="compiled elsewhere")]), metadata=md, timeout=60).facts[0]
        out["get"] = memory.GetMemory(memory_pb2.GetMemoryRequest(user_id=user, fact_id=fact.fact_id),
                                      metadata=md, timeout=60).text
        try:
            memory.GetMemory(memory_pb2.GetMemoryRequest(user_id=user, fact_id=fact.fact_id), timeout=60)
        except grpc.RpcError as e:
            out["get:no token"] = e.code().name
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        asks = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="inferscale.v1.Memory"),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.health.v1.Health")]
        answers = list(refl.ServerReflectionInfo(iter(asks), timeout=60))
        out["services"] = sorted(s.name for s in answers[0].list_services_response.service)
        for key, ans in (("memory", answers[1]), ("health", answers[2])):
            files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                     for b in ans.file_descriptor_response.file_descriptor_proto]
            out[key + ":methods"] = sorted(m.name for f in files for s in f.service for m in s.method)
            out[key + ":AnswerRequest"] = sorted(fd.name for f in files for m in f.message_type
                                                 if m.name == "AnswerRequest" for fd in m.field)
    out["from_checkout"] = sorted(name for name, m in sys.modules.items()
                                  if (getattr(m, "__file__", None) or "").startswith(checkout))
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def client_dir(tmp_path_factory) -> Path:
    """memory.proto and the health service compiled here, into a folder of their own. The health proto's file
    is interop/health.proto (its package, what the wire sees, is grpc.health.v1): a `grpc/` folder would be
    shadowed by the installed grpc package."""
    from grpc_tools import protoc

    work = tmp_path_factory.mktemp("interop")
    src, out = work / "protos", work / "gen"
    (src / "interop").mkdir(parents=True)
    (src / "interop/health.proto").write_text(HEALTH_PROTO)
    (src / "inferscale/v1").mkdir(parents=True)
    (src / "inferscale/v1/memory.proto").write_bytes((ROOT / "protos/inferscale/v1/memory.proto").read_bytes())
    out.mkdir()
    for proto in ("interop/health.proto", "inferscale/v1/memory.proto"):
        rc = protoc.main(["grpc_tools.protoc", f"-I{src}", f"--python_out={out}", f"--grpc_python_out={out}",
                          str(src / proto)])
        assert rc == 0, proto
    (out / "client.py").write_text(CLIENT)
    return out


def run_client(client_dir: Path, target: str, token: str, user: str) -> dict:
    """The client in an isolated interpreter (-I: no PYTHONPATH, no current directory on the path), from the
    folder it was compiled into."""
    r = subprocess.run([sys.executable, "-I", str(client_dir / "client.py"), target, token, user, str(ROOT)],
                       cwd=client_dir, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    # nothing of the checkout was imported: the stubs are the ones compiled for this test
    assert seen["from_checkout"] == [] and seen["health_pb2"].startswith(str(client_dir))
    return seen


def check_interop(seen: dict) -> None:
    assert seen["check:"] == "SERVING" and seen["check:inferscale.v1.Memory"] == "SERVING"
    assert seen["check:unknown"] == "NOT_FOUND" and seen["watch:first"] == "SERVING"
    assert seen["get"] == "compiled elsewhere" and seen["get:no token"] == "UNAUTHENTICATED"
    assert {"inferscale.v1.Memory", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(
        seen["services"])
    assert seen["memory:methods"] == sorted(["AddMemory", "AddFacts", "Search", "Answer", "GetMemory", "ListMemories",
                                             "UpdateMemory", "DeleteMemory", "DeleteUser", "Health"])
    assert "messages" in seen["memory:AnswerRequest"]
    assert seen["health:methods"] == ["Check", "Watch"]
