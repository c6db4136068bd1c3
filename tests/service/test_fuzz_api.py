"""A bounded fuzz pass over every RPC's fields (tests/support/fuzz_inputs.py) and the HTTP chat body, against a real grpc
server on loopback with auth on and the registry in a real redis-server. Asserted for every input: the status is
never INTERNAL or UNKNOWN (HTTP never 5xx but 503 for the missing engine) and no message carries a traceback;
afterwards the service still answers and every other user's facts are unchanged. The same pass, smaller, runs
on the real service in tests/service/test_service_safety.py."""
from __future__ import annotations

import json
import random
import time
import uuid

import pytest
from support.auth_fixture import token_channel, token_for
from support.fuzz_inputs import fuzz_grpc, snapshot
from support.grpc_thread import ServerThread

from inferscale_server.api import pb2, pb2_grpc
from inferscale_server.auth import AuthConfig, Authenticator
from inferscale_server.gateway import GatewayCore, build_http_app
from inferscale_server.limits import Limits
from inferscale_server.registry import NewFact, RedisRegistry

MAX_INPUTS, MAX_SECONDS, SEED = 2000, 45.0, 20261123


@pytest.fixture(scope="module")
def served(redis_url, jwt_secret):
    reg = RedisRegistry(redis_url, prefix=f"fuzz{uuid.uuid4().hex[:8]}:")
    # A work budget no fuzz pass exhausts: a caller in debt is refused before its request is parsed, so the pass
    # would stop reaching the handlers it fuzzes (the budget itself: tests/unit/test_work_budget.py).
    limits = Limits(work_units_per_s_per_caller=1e6, work_burst_per_caller=1e9)
    core = GatewayCore(reg, limits=limits, auth=Authenticator(AuthConfig(hs256_secret_file=str(jwt_secret[0]))))
    srv = ServerThread(core)
    ch = srv.channel()
    yield ch, core, reg, jwt_secret[1]
    ch.close()
    srv.stop()
    reg.close()


def test_fuzz_every_rpc(served):
    ch, _, reg, secret = served
    fuzz_user = f"fuzz-{uuid.uuid4().hex[:6]}"
    bystanders = {u: reg.create(u, [NewFact(f"{u} keeps a fact {i}") for i in range(3)])
                  for u in ("alice-fz", "bob-fz")}
    own = reg.create(fuzz_user, [NewFact("the fuzz user's first fact")])
    before = snapshot(reg, bystanders)
    # As the fuzz user (refusals for other users are part of the pass), then with no token at all.
    n, counts = fuzz_grpc(token_channel(ch, token_for(secret, fuzz_user)), fuzz_user, [own[0].fact_id],
                          SEED, MAX_INPUTS, MAX_SECONDS)
    m, counts_anon = fuzz_grpc(ch, fuzz_user, [own[0].fact_id], SEED + 1, 300, 15.0)
    print(f"\nfuzz: {n} inputs with a token, {m} without; status counts {counts} / {counts_anon}")
    # Without a token: refused, except Health (open: OK, or INVALID_ARGUMENT for bytes that are no message)
    # and messages over gRPC's 4 MiB receive limit, which the transport refuses before any handler runs.
    assert n >= 500 and set(counts_anon) <= {"UNAUTHENTICATED", "OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
    assert counts_anon["UNAUTHENTICATED"] > 0.7 * m
    assert snapshot(reg, bystanders) == before
    stub = pb2_grpc.MemoryStub(token_channel(ch, token_for(secret, fuzz_user)))
    assert stub.Health(pb2.HealthRequest()).status == "SERVING"
    assert stub.ListMemories(pb2.ListMemoriesRequest(user_id=fuzz_user)).facts  # still served
    stub.AddFacts(pb2.AddFactsRequest(user_id=fuzz_user, facts=[pb2.FactInput(text="still writable")]))


def _rand_json(rng: random.Random, depth: int = 0):
    """A random JSON value: wrong types, huge numbers, long strings, nested lists and objects."""
    makers = [
        lambda: None, lambda: rng.random() < 0.5,
        lambda: rng.choice([0, -1, 7, 2**31, 2**64, 10**400]),
        lambda: rng.choice([0.5, -1e308, 1e308, float("nan"), float("inf")]),
        lambda: "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(30))),
        lambda: "x" * rng.choice([0, 5000]),
        lambda: [_rand_json(rng, depth + 1) for _ in range(rng.randrange(4))],
        lambda: {rng.choice(["role", "content", "user", "k"]): _rand_json(rng, depth + 1) for _ in range(rng.randrange(4))},
    ]
    return makers[rng.randrange(len(makers) if depth < 2 else 6)]()


def test_fuzz_http_chat(served):
    from fastapi.testclient import TestClient

    _, core, _, secret = served
    client = TestClient(build_http_app(lambda: core), headers={"authorization": f"Bearer {token_for(secret, 'hz')}"})
    rng = random.Random(SEED)
    fields = ["user", "messages", "k", "max_tokens", "max_completion_tokens", "temperature", "stream", "model",
              "inferscale_mode"]
    n, deadline = 0, time.monotonic() + 30
    while n < 600 and time.monotonic() < deadline:
        body = {f: _rand_json(rng) for f in fields if rng.random() < 0.5}
        if rng.random() < 0.5:
            body["messages"] = [{"role": "user", "content": _rand_json(rng)}]
        raw = json.dumps(body, allow_nan=True).encode() if rng.random() < 0.9 else bytes(rng.randrange(256) for _ in range(40))
        r = client.post("/v1/chat/completions", content=raw)
        assert r.status_code < 500 or r.json()["error"]["code"] == "unavailable", (body, r.text)
        assert "Traceback" not in r.text
        n += 1
    print(f"\nHTTP chat fuzz: {n} bodies")
    assert n >= 100
