"""The gRPC API through Ray Serve's own gRPC and HTTP proxies: the Gateway deployment in registry-only mode on a
2-CPU local Ray, auth on. Its own module on purpose: Ray starts its GCS with fork(), and a fork while this process
runs an in-process gRPC server (tests/test_grpc_api.py's module fixture) can hang the child before exec ("Other
threads are currently calling into gRPC, skipping fork() handlers"; a clean-clone CI run timed out that way)."""
from __future__ import annotations

import uuid

import grpc
import pytest

from auth_fixture import admin_token, jwt_secret, one_call_per_rpc, refused, token_channel, token_for  # noqa: F401  (fixtures)
from redis_fixture import redis_url  # noqa: F401  (fixture)
from services import api
from services.api import pb2, pb2_grpc
from services.registry.local_redis import free_port


def _user() -> str:
    return f"user-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def serve_ports(redis_url, jwt_secret):  # noqa: F811
    """The Gateway deployment (registry-only) behind Serve's own proxies, on a 2-CPU local Ray."""
    ray = pytest.importorskip("ray")
    from ray import serve
    from ray.serve.config import gRPCOptions

    from services.gateway import Gateway, http_app

    grpc_port, http_port = free_port(), free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[api.SERVICER_FUNCTION]))
        gateway = serve.deployment(serve.ingress(http_app)(Gateway), name="Gateway",
                                   ray_actor_options={"num_cpus": 0.5})
        serve.run(gateway.bind(registry_url=redis_url, auth={"hs256_secret_file": str(jwt_secret[0])}),
                  name="inferscale", route_prefix="/")
        yield grpc_port, http_port
    finally:
        serve.shutdown()
        ray.shutdown()


def test_serve_grpc_proxy_round_trip_and_status_codes(serve_ports, admin_token):
    grpc_port, http_port = serve_ports
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as plain:
        grpc.channel_ready_future(plain).result(timeout=60)
        ch = token_channel(plain, admin_token)
        s = pb2_grpc.MemoryStub(ch)
        uid = _user()
        (f,) = s.AddFacts(pb2.AddFactsRequest(user_id=uid, facts=[pb2.FactInput(text="served by Ray")])).facts
        assert s.GetMemory(pb2.GetMemoryRequest(user_id=uid, fact_id=f.fact_id)).text == "served by Ray"
        code, details = refused(lambda: s.GetMemory(pb2.GetMemoryRequest(user_id=_user(), fact_id=f.fact_id)))
        assert code == grpc.StatusCode.NOT_FOUND and "unknown fact" in details
        code, details = refused(lambda: s.Search(pb2.SearchRequest(user_id=uid, query="q", k=999)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "k must be in" in details
        raw = ch.unary_unary("/inferscale.v1.Memory/GetMemory", request_serializer=None,
                             response_deserializer=pb2.Fact.FromString)
        code, details = refused(lambda: raw(b"\x0a\xff\xff\xff\xff\x0f"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in details
        code, details = refused(lambda: list(s.Answer(pb2.AnswerRequest(user_id=uid, query="q", k=-1))))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "k must be in" in details
        assert s.Health(pb2.HealthRequest()).components["registry"] == "ok"
    import httpx

    r = httpx.post(f"http://127.0.0.1:{http_port}/v1/chat/completions", timeout=60,
                   headers={"authorization": f"Bearer {admin_token}"},
                   json={"user": "", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "`user` is required" in r.json()["error"]["message"]


def test_serve_proxies_refuse_missing_expired_and_foreign_tokens(serve_ports, jwt_secret):  # noqa: F811
    """Auth through Ray Serve's own gRPC proxy (the metadata reaches the deployment in its RayServegRPCContext)
    and HTTP proxy: every RPC but Health."""
    from services.auth import mint

    grpc_port, http_port = serve_ports
    secret = jwt_secret[1]
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=60)
        s = pb2_grpc.MemoryStub(ch)
        alice = _user()
        own = [("authorization", f"Bearer {token_for(secret, alice)}")]
        (fact,) = s.AddFacts(pb2.AddFactsRequest(user_id=alice, facts=[pb2.FactInput(text="alice's secret")]),
                             metadata=own).facts
        bad = {"missing": ([], grpc.StatusCode.UNAUTHENTICATED),
               "expired": ([("authorization", f"Bearer {mint(secret, alice, ttl_s=-600)}")],
                           grpc.StatusCode.UNAUTHENTICATED),
               "other user": ([("authorization", f"Bearer {token_for(secret, 'mallory')}")],
                              grpc.StatusCode.PERMISSION_DENIED)}
        for rpc, call in one_call_per_rpc(alice, fact.fact_id).items():
            for name, (md, want) in bad.items():
                code, details = refused(lambda: call(s, md))
                assert code == want, (rpc, name, code, details)
                assert "secret" not in details and alice not in details and "Traceback" not in details
        assert s.GetMemory(pb2.GetMemoryRequest(user_id=alice, fact_id=fact.fact_id), metadata=own).version == 1
        assert s.Health(pb2.HealthRequest()).status == "SERVING"  # no token needed
    import httpx

    url = f"http://127.0.0.1:{http_port}/v1/chat/completions"
    body = {"user": alice, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(url, json=body, timeout=60, headers={"authorization": f"Bearer {token_for(secret, 'mallory')}"})
    assert r.status_code == 403 and alice not in r.text
