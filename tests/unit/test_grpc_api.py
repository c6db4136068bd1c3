"""The gRPC API `inferscale.v1.Memory` against a real grpc server on loopback, registry in a real redis-server.

The gateway runs in registry-only mode (no Ray deployments): everything here is decided by validation and by
the registry, before any engine would be involved. The same gateway behind Ray Serve's proxies is
tests/service/test_grpc_serve_proxy.py; the end-to-end test with the engine is tests/service/one_app/test_service_e2e.py.
Auth is on, as deployed: these tests call with an admin token (tests/unit/test_auth.py covers refusals).
"""
from __future__ import annotations

import asyncio
import math
import time
import uuid
from datetime import datetime, timezone

import grpc
import pytest
from support.auth_fixture import refused, rich_refusal, token_channel, token_gateway
from support.grpc_thread import ServerThread

from inferscale_client import codegen
from inferscale_server import api
from inferscale_server.api import pb2, pb2_grpc
from inferscale_server.auth import Authenticator
from inferscale_server.gateway import GatewayCore, build_http_app
from inferscale_server.limits import Limits
from inferscale_server.registry import RedisRegistry

LIMITS = Limits(max_facts_per_user=5)


@pytest.fixture(scope="module")
def registry(redis_url):
    reg = RedisRegistry(redis_url, prefix=f"grpc{uuid.uuid4().hex[:8]}:")
    yield reg
    reg.close()


@pytest.fixture(scope="module")
def core(registry, jwt_secret):
    return token_gateway(registry, jwt_secret, LIMITS)


@pytest.fixture(scope="module")
def channel(core, admin_token):
    srv = ServerThread(core)
    ch = srv.channel()
    yield token_channel(ch, admin_token)
    ch.close()
    srv.stop()


@pytest.fixture(scope="module")
def stub(channel):
    return pb2_grpc.MemoryStub(channel)


def _user() -> str:
    return f"user-{uuid.uuid4().hex[:8]}"


def test_proto_compiles_and_defines_the_service():
    out = codegen.generate(force=True)
    assert (out / "memory_pb2.py").exists() and codegen.is_current()
    methods = set(pb2.DESCRIPTOR.services_by_name["Memory"].methods_by_name)
    assert methods == {"AddMemory", "AddFacts", "Search", "Answer", "GetMemory", "ListMemories",
                       "UpdateMemory", "DeleteMemory", "DeleteUser", "Health"}
    assert pb2.DESCRIPTOR.services_by_name["Memory"].methods_by_name["Answer"].server_streaming
    assert set(api.REQUEST_TYPES) == methods


def test_fact_crud_round_trip(stub):
    uid = _user()
    added = stub.AddFacts(pb2.AddFactsRequest(user_id=uid, facts=[
        pb2.FactInput(text="  likes green tea ", metadata={"src": "chat"}),
        pb2.FactInput(text="has a dog named Rex", window=["user: I walked Rex today"])]))
    a, b = added.facts
    assert a.text == "likes green tea" and a.metadata == {"src": "chat"} and a.version == 1 and a.user_id == uid
    got = stub.GetMemory(pb2.GetMemoryRequest(user_id=uid, fact_id=b.fact_id))
    assert got.text == "has a dog named Rex"
    upd = stub.UpdateMemory(pb2.UpdateMemoryRequest(user_id=uid, fact_id=a.fact_id, text="likes black tea",
                                                    expected_version=1))
    assert upd.version == 2 and upd.text == "likes black tea" and upd.metadata == {"src": "chat"}
    page1 = stub.ListMemories(pb2.ListMemoriesRequest(user_id=uid, page_size=1))
    page2 = stub.ListMemories(pb2.ListMemoriesRequest(user_id=uid, page_size=1, page_token=page1.next_page_token))
    assert [f.fact_id for f in [*page1.facts, *page2.facts]] == [a.fact_id, b.fact_id]
    assert page2.next_page_token == ""
    assert stub.DeleteMemory(pb2.DeleteMemoryRequest(user_id=uid, fact_id=a.fact_id)).fact_id == a.fact_id
    assert stub.DeleteUser(pb2.DeleteUserRequest(user_id=uid)).deleted == 1
    assert len(stub.ListMemories(pb2.ListMemoriesRequest(user_id=uid)).facts) == 0


def test_facts_are_encoded_behind_the_users_latest_facts(stub, registry):
    """The shipped default (inferscale_core.defaults), through gRPC with the Redis registry: a fact without a
    window of its own is stored (and so encoded) behind the NEIGHBOUR_WINDOW facts its user stored most recently,
    whatever call they came in, as memory lines; a caller's window wins; deleting a neighbour takes its line out
    of the windows behind it."""
    from inferscale_core.defaults import NEIGHBOUR_WINDOW
    from inferscale_core.template import PromptTemplate

    uid = _user()
    texts = ["likes green tea", "has a dog named Rex", "lives in Oslo", "plays chess"]
    first = stub.AddFacts(pb2.AddFactsRequest(user_id=uid, facts=[pb2.FactInput(text=t) for t in texts[:3]] + [
        pb2.FactInput(text=texts[3], window=["user: I won at chess today"])])).facts
    windows = [registry.get(uid, f.fact_id).window for f in first]
    lines = [PromptTemplate.render_fact(t) for t in texts]
    assert NEIGHBOUR_WINDOW >= 4 and windows[:3] == [(), (lines[0],), (lines[0], lines[1])]
    assert windows[1] == ("- likes green tea\n",)
    assert windows[3] == ("user: I won at chess today",)
    (later,) = stub.AddFacts(pb2.AddFactsRequest(user_id=uid, facts=[pb2.FactInput(text="owns a bike")])).facts
    assert registry.get(uid, later.fact_id).window == tuple(lines)  # added alone: the earlier calls' facts
    stub.DeleteMemory(pb2.DeleteMemoryRequest(user_id=uid, fact_id=first[1].fact_id))
    assert registry.get(uid, later.fact_id).window == (lines[0], lines[2], lines[3])
    assert registry.get(uid, first[2].fact_id).window == (lines[0],)
    stub.DeleteUser(pb2.DeleteUserRequest(user_id=uid))


def test_add_memory_without_inference_stores_messages(stub):
    uid = _user()
    res = stub.AddMemory(pb2.AddMemoryRequest(user_id=uid, infer=False, metadata={"session": "s1"}, messages=[
        pb2.Message(role="system", content="be nice"), pb2.Message(role="user", content="I am vegan"),
        pb2.Message(role="assistant", content="Noted!")]))
    assert [(e.event, e.text) for e in res.results] == [("ADD", "I am vegan"), ("ADD", "Noted!")]
    got = stub.GetMemory(pb2.GetMemoryRequest(user_id=uid, fact_id=res.results[0].fact_id))
    assert got.metadata == {"session": "s1", "role": "user"}


EMPTY_USER_CALLS = {
    "AddFacts": lambda s: s.AddFacts(pb2.AddFactsRequest(facts=[pb2.FactInput(text="x")])),
    "AddMemory": lambda s: s.AddMemory(pb2.AddMemoryRequest(messages=[pb2.Message(role="user", content="x")])),
    "Search": lambda s: s.Search(pb2.SearchRequest(query="x")),
    "Answer": lambda s: list(s.Answer(pb2.AnswerRequest(query="x"))),
    "GetMemory": lambda s: s.GetMemory(pb2.GetMemoryRequest(fact_id="f")),
    "ListMemories": lambda s: s.ListMemories(pb2.ListMemoriesRequest()),
    "UpdateMemory": lambda s: s.UpdateMemory(pb2.UpdateMemoryRequest(fact_id="f", text="x")),
    "DeleteMemory": lambda s: s.DeleteMemory(pb2.DeleteMemoryRequest(fact_id="f")),
    "DeleteUser": lambda s: s.DeleteUser(pb2.DeleteUserRequest()),
}


@pytest.mark.parametrize("rpc", sorted(EMPTY_USER_CALLS))
def test_empty_user_is_invalid_argument(stub, rpc):
    code, details = refused(lambda: EMPTY_USER_CALLS[rpc](stub))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "user_id" in details and "empty" in details


def test_bad_ids_are_invalid_argument(stub):
    code, details = refused(lambda: stub.GetMemory(pb2.GetMemoryRequest(user_id="a/b", fact_id="f")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "path separator" in details
    code, details = refused(lambda: stub.GetMemory(pb2.GetMemoryRequest(user_id="u", fact_id="")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "fact_id" in details


def test_oversized_fact_and_request_are_resource_exhausted(stub):
    uid = _user()
    code, details = refused(lambda: stub.AddFacts(pb2.AddFactsRequest(
        user_id=uid, facts=[pb2.FactInput(text="ok"), pb2.FactInput(text="x" * (LIMITS.max_fact_chars + 1))])))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"facts[1].text is {LIMITS.max_fact_chars + 1} characters" in details
    big = pb2.AddFactsRequest(user_id=uid, facts=[pb2.FactInput(text="y" * 1500)] * 800)
    code, details = refused(lambda: stub.AddFacts(big))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "bytes, the limit is" in details
    code, details = refused(lambda: stub.Search(pb2.SearchRequest(user_id=uid, query="q" * 5000)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "query is 5000 characters" in details
    code, details = refused(lambda: stub.AddFacts(pb2.AddFactsRequest(
        user_id=uid, facts=[pb2.FactInput(text="z")] * (LIMITS.max_facts_per_request + 1))))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "per request" in details
    # nothing was stored by any of the refused requests
    assert len(stub.ListMemories(pb2.ListMemoriesRequest(user_id=uid)).facts) == 0


def test_per_user_quota_is_resource_exhausted(stub):
    uid = _user()
    stub.AddFacts(pb2.AddFactsRequest(user_id=uid, facts=[pb2.FactInput(text=f"f{i}") for i in range(4)]))
    code, details = refused(lambda: stub.AddFacts(pb2.AddFactsRequest(
        user_id=uid, facts=[pb2.FactInput(text="a"), pb2.FactInput(text="b")])))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 5 facts per user" in details


def test_unknown_fact_is_not_found(stub):
    uid = _user()
    for call in (lambda: stub.GetMemory(pb2.GetMemoryRequest(user_id=uid, fact_id="nope")),
                 lambda: stub.UpdateMemory(pb2.UpdateMemoryRequest(user_id=uid, fact_id="nope", text="t")),
                 lambda: stub.DeleteMemory(pb2.DeleteMemoryRequest(user_id=uid, fact_id="nope"))):
        code, details = refused(call)
        assert code == grpc.StatusCode.NOT_FOUND and "'nope'" in details
    assert stub.DeleteUser(pb2.DeleteUserRequest(user_id=uid)).deleted == 0  # no facts: no error (Mem0's delete_all)


def test_another_users_fact_is_not_found(stub):
    alice, bob = _user(), _user()
    (fact,) = stub.AddFacts(pb2.AddFactsRequest(user_id=alice, facts=[pb2.FactInput(text="alice's PIN is 1234")])).facts
    for call in (lambda: stub.GetMemory(pb2.GetMemoryRequest(user_id=bob, fact_id=fact.fact_id)),
                 lambda: stub.UpdateMemory(pb2.UpdateMemoryRequest(user_id=bob, fact_id=fact.fact_id, text="x")),
                 lambda: stub.DeleteMemory(pb2.DeleteMemoryRequest(user_id=bob, fact_id=fact.fact_id))):
        code, details = refused(call)
        assert code == grpc.StatusCode.NOT_FOUND and "1234" not in details and alice not in details
    assert stub.GetMemory(pb2.GetMemoryRequest(user_id=alice, fact_id=fact.fact_id)).text == "alice's PIN is 1234"
    assert len(stub.ListMemories(pb2.ListMemoriesRequest(user_id=bob)).facts) == 0


@pytest.mark.parametrize("k", [-1, 201, 1000])
def test_k_out_of_range_is_invalid_argument(stub, k):
    code, details = refused(lambda: stub.Search(pb2.SearchRequest(user_id="u", query="q", k=k)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "k must be in [1, 200]" in details
    code, details = refused(lambda: list(stub.Answer(pb2.AnswerRequest(user_id="u", query="q", k=k))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "k must be in [1, 200]" in details


def test_other_ranges_and_enums_are_invalid_argument(stub):
    cases = [
        (lambda: list(stub.Answer(pb2.AnswerRequest(user_id="u", query="q", max_tokens=-5))), "max_tokens"),
        (lambda: list(stub.Answer(pb2.AnswerRequest(user_id="u", query="q", temperature=3.0))), "temperature"),
        (lambda: list(stub.Answer(pb2.AnswerRequest(user_id="u", query="q", mode="telepathy"))), "mode"),
        (lambda: list(stub.Answer(pb2.AnswerRequest(user_id="u", query=" "))), "query must not be empty"),
        (lambda: stub.ListMemories(pb2.ListMemoriesRequest(user_id="u", page_size=5000)), "page_size"),
        (lambda: stub.ListMemories(pb2.ListMemoriesRequest(user_id="u", page_token="abc")), "page_token"),
        (lambda: stub.AddFacts(pb2.AddFactsRequest(user_id="u")), "facts must not be empty"),
        (lambda: stub.AddFacts(pb2.AddFactsRequest(user_id="u", facts=[pb2.FactInput(text="  ")])),
         "facts[0].text must not be empty"),
        (lambda: stub.AddMemory(pb2.AddMemoryRequest(user_id="u", messages=[pb2.Message(role="bot", content="x")])),
         "messages[0].role"),
        (lambda: stub.UpdateMemory(pb2.UpdateMemoryRequest(user_id="u", fact_id="f")), "nothing to update"),
    ]
    for call, needle in cases:
        code, details = refused(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (needle, code, details)
        assert needle in details, (needle, details)


def test_malformed_request_is_invalid_argument(channel):
    raw_call = channel.unary_unary("/inferscale.v1.Memory/GetMemory", request_serializer=None,
                                   response_deserializer=pb2.Fact.FromString)
    code, details = refused(lambda: raw_call(b"\x0a\xff\xff\xff\xff\x0f"))  # field 1, length past the end
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid inferscale.v1.GetMemoryRequest" in details


def test_version_conflict_is_aborted(stub):
    uid = _user()
    (f,) = stub.AddFacts(pb2.AddFactsRequest(user_id=uid, facts=[pb2.FactInput(text="v1")])).facts
    stub.UpdateMemory(pb2.UpdateMemoryRequest(user_id=uid, fact_id=f.fact_id, text="v2"))
    code, details = refused(lambda: stub.UpdateMemory(pb2.UpdateMemoryRequest(
        user_id=uid, fact_id=f.fact_id, text="v3", expected_version=1)))
    assert code == grpc.StatusCode.ABORTED and "at version 2" in details


def test_registry_only_mode_answers_unavailable_for_serving(stub):
    code, details = refused(lambda: stub.Search(pb2.SearchRequest(user_id="u", query="q")))
    assert code == grpc.StatusCode.UNAVAILABLE and "registry-only" in details
    code, _ = refused(lambda: list(stub.Answer(pb2.AnswerRequest(user_id="u", query="q"))))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_health(stub):
    h = stub.Health(pb2.HealthRequest())
    assert h.status == "SERVING" and h.components["registry"] == "ok"


def test_python_client(channel):
    from inferscale_client import MemoryClient

    c = MemoryClient(channel=channel)
    uid = _user()
    facts = c.add_facts(uid, ["a", "b", "c"], metadata={"src": "client"})
    assert [f.fact_id for f in c.list(uid, page_size=2)] == [f.fact_id for f in facts]
    assert c.update(uid, facts[0].fact_id, text="A", expected_version=1).version == 2
    c.delete(uid, facts[1].fact_id)
    assert c.delete_user(uid) == 2
    with pytest.raises(grpc.RpcError) as e:
        c.get(uid, facts[0].fact_id)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


# ------------------------------------------------------------------ expiry (issue 34: Mem0's expiration_date)
def test_expired_facts_are_kept_dated_and_not_listed(stub, core, admin_token):
    """expires_at on AddFacts (per fact), AddMemory and UpdateMemory; every Fact carries its expiry. An expired fact
    is kept: GetMemory answers it (as Mem0's get by id), ListMemories leaves it out unless show_expired; 0 means
    never (and clears it on an update). The Mem0 API reads a gRPC expiry as the last day the fact is served."""
    from fastapi.testclient import TestClient

    uid, now = _user(), time.time()
    past, later = now - 60, now + 3600
    gone, kept, never, zero = stub.AddFacts(pb2.AddFactsRequest(user_id=uid, facts=[
        pb2.FactInput(text="had a trial subscription", expires_at=past),
        pb2.FactInput(text="is on holiday this week", expires_at=later),
        pb2.FactInput(text="likes green tea"), pb2.FactInput(text="owns a bike", expires_at=0)])).facts
    assert gone.expires_at == past and kept.expires_at == later
    assert not never.HasField("expires_at") and not zero.HasField("expires_at")  # unset and 0: never
    (event,) = stub.AddMemory(pb2.AddMemoryRequest(user_id=uid, infer=False, expires_at=later, messages=[
        pb2.Message(role="user", content="I am in Oslo until Friday")])).results

    def listed(**kw):
        return [f.fact_id for f in stub.ListMemories(pb2.ListMemoriesRequest(user_id=uid, **kw)).facts]

    assert listed() == [kept.fact_id, never.fact_id, zero.fact_id, event.fact_id]
    first = stub.ListMemories(pb2.ListMemoriesRequest(user_id=uid, page_size=1))  # as a filter: a page may be short
    assert list(first.facts) == [] and listed(page_size=1, page_token=first.next_page_token) == [kept.fact_id]
    assert listed(show_expired=True) == [gone.fact_id, kept.fact_id, never.fact_id, zero.fact_id, event.fact_id]
    got = stub.GetMemory(pb2.GetMemoryRequest(user_id=uid, fact_id=gone.fact_id))
    assert got.text == "had a trial subscription" and got.expires_at == past  # get by id: expired and dated
    assert stub.GetMemory(pb2.GetMemoryRequest(user_id=uid, fact_id=event.fact_id)).expires_at == later

    moved = stub.UpdateMemory(pb2.UpdateMemoryRequest(user_id=uid, fact_id=kept.fact_id, expires_at=past))
    assert moved.version == 2 and moved.expires_at == past and moved.text == kept.text
    cleared = stub.UpdateMemory(pb2.UpdateMemoryRequest(user_id=uid, fact_id=gone.fact_id, expires_at=0))
    assert not cleared.HasField("expires_at") and cleared.version == 2
    assert listed() == [gone.fact_id, never.fact_id, zero.fact_id, event.fact_id]
    texted = stub.UpdateMemory(pb2.UpdateMemoryRequest(user_id=uid, fact_id=event.fact_id, text="I am in Oslo"))
    assert texted.expires_at == later  # unset on an update: the expiry stays

    noon = datetime(2031, 3, 5, 12, tzinfo=timezone.utc).timestamp()
    stub.UpdateMemory(pb2.UpdateMemoryRequest(user_id=uid, fact_id=never.fact_id, expires_at=noon))
    http = TestClient(build_http_app(lambda: core), headers={"authorization": f"Bearer {admin_token}"})
    r = http.get(f"/v1/memories/{never.fact_id}/", params={"user_id": uid})
    assert r.status_code == 200 and r.json()["expiration_date"] == "2031-03-05"  # served during that day
    stub.DeleteUser(pb2.DeleteUserRequest(user_id=uid))


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, -math.inf, 253402300800.5, 1e300])
def test_a_bad_expiry_is_invalid_argument_naming_the_field(stub, bad):
    uid = _user()
    calls = {
        "facts[1].expires_at": lambda: stub.AddFacts(pb2.AddFactsRequest(user_id=uid, facts=[
            pb2.FactInput(text="fine"), pb2.FactInput(text="not fine", expires_at=bad)])),
        "expires_at": lambda: stub.AddMemory(pb2.AddMemoryRequest(user_id=uid, infer=False, expires_at=bad,
                                                                  messages=[pb2.Message(role="user", content="x")])),
    }
    for field, call in calls.items():
        code, details, _ = rich_refusal(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, field
        assert [v.field for v in details["BadRequest"].field_violations] == [field]
        assert "Unix time" in details["BadRequest"].field_violations[0].description
    assert len(stub.ListMemories(pb2.ListMemoriesRequest(user_id=uid, show_expired=True)).facts) == 0  # none stored
    (fact,) = stub.AddFacts(pb2.AddFactsRequest(user_id=uid, facts=[pb2.FactInput(text="fine")])).facts
    code, details, _ = rich_refusal(lambda: stub.UpdateMemory(pb2.UpdateMemoryRequest(
        user_id=uid, fact_id=fact.fact_id, expires_at=bad)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in details["BadRequest"].field_violations] == ["expires_at"]
    assert stub.GetMemory(pb2.GetMemoryRequest(user_id=uid, fact_id=fact.fact_id)).version == 1  # untouched
    stub.DeleteUser(pb2.DeleteUserRequest(user_id=uid))


def test_python_client_sets_and_clears_expiry(channel, core, admin_token):
    from inferscale_client import AsyncMemoryClient, MemoryClient

    c, uid, soon = MemoryClient(channel=channel), _user(), time.time() + 3600
    a, b = c.add_facts(uid, ["a", "b"], expires_at=time.time() - 1)
    (e,) = c.add_memory(uid, [{"role": "user", "content": "c"}], infer=False, expires_at=soon)
    assert c.get(uid, e.fact_id).expires_at == soon
    assert [f.fact_id for f in c.list(uid)] == [e.fact_id]
    assert [f.fact_id for f in c.list(uid, show_expired=True)] == [a.fact_id, b.fact_id, e.fact_id]
    assert not c.update(uid, a.fact_id, expires_at=math.inf).HasField("expires_at")  # inf: never expires
    assert c.update(uid, e.fact_id, text="C").expires_at == soon  # None: as it is

    async def run(port: int):
        async with AsyncMemoryClient(f"127.0.0.1:{port}", token=admin_token) as ac:
            (f,) = await ac.add_facts(uid, ["d"], expires_at=soon)
            assert (await ac.update(uid, b.fact_id, expires_at=soon)).expires_at == soon
            return f, [x.fact_id async for x in ac.list(uid)]

    srv = ServerThread(core)
    try:
        f, listed = asyncio.run(run(srv.port))
    finally:
        srv.stop()
    assert f.expires_at == soon and listed == [a.fact_id, b.fact_id, e.fact_id, f.fact_id]
    assert c.delete_user(uid) == 4


def test_health_reports_a_dead_registry():
    reg = RedisRegistry("redis://127.0.0.1:1/0")  # nothing listens on port 1
    h = asyncio.run(GatewayCore(reg, auth=Authenticator.insecure()).Health(b""))
    assert h.status == "DEGRADED" and h.components["registry"] == "error: ConnectionError"  # no internals


def test_http_chat_completions_validation(core, admin_token):
    from fastapi.testclient import TestClient

    client = TestClient(build_http_app(lambda: core), headers={"authorization": f"Bearer {admin_token}"})
    r = client.post("/v1/chat/completions", json={"user": "", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "`user` is required" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"user": "u", "k": 999,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "k must be in" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"user": "u", "messages": [{"role": "system", "content": "x"}]})
    assert r.status_code == 400 and "user message" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"user": "u", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
    assert client.get("/healthz").json()["components"]["registry"] == "ok"


# ------------------------------------------------------------------ page tokens (issue 20 item 4)
def _stored(registry, uid: str, n: int) -> list[str]:
    """n facts written straight into the registry (past this module's 5-fact quota), in creation order."""
    from inferscale_server.registry import NewFact

    return [r.fact_id for r in registry.create(uid, [NewFact(f"fact number {i}") for i in range(n)])]


def test_paging_while_deleting_returns_every_surviving_fact_exactly_once(stub, registry):
    """Deletes between pages (of facts already listed, the page's last one included) and concurrently (of facts
    not listed yet, from another thread) never make the listing skip or repeat a surviving fact: page tokens are
    cursors, not offsets."""
    import random
    import threading

    uid = _user()
    ids = _stored(registry, uid, 60)
    rng = random.Random(20)
    doomed = set(rng.sample(ids[20:], 15))  # deleted by the other thread while the listing runs
    deleted, listed, token = set(), [], ""
    started = threading.Event()

    def delete_concurrently():
        started.wait(10)
        for fid in sorted(doomed, key=ids.index):
            stub.DeleteMemory(pb2.DeleteMemoryRequest(user_id=uid, fact_id=fid))
            deleted.add(fid)

    t = threading.Thread(target=delete_concurrently)
    t.start()
    try:
        for _ in range(100):  # bounded: 60 facts in pages of 4
            page = stub.ListMemories(pb2.ListMemoriesRequest(user_id=uid, page_size=4, page_token=token))
            listed += [f.fact_id for f in page.facts]
            started.set()
            for f in page.facts[-2:]:  # facts already listed go; an offset token would now skip two facts
                if f.fact_id not in doomed:
                    stub.DeleteMemory(pb2.DeleteMemoryRequest(user_id=uid, fact_id=f.fact_id))
                    deleted.add(f.fact_id)
            token = page.next_page_token
            if not token:
                break
    finally:
        t.join(30)
    survivors = [f for f in ids if f not in deleted]
    assert len(listed) == len(set(listed)), "a fact was listed twice"
    assert [f for f in listed if f in set(survivors)] == survivors  # every survivor, once, in creation order
    assert set(listed) - set(ids) == set() and deleted >= doomed
    assert not token
    stub.DeleteUser(pb2.DeleteUserRequest(user_id=uid))


def test_page_tokens_are_opaque_and_bound_to_the_listing(stub, registry):
    alice, bob = _user(), _user()
    _stored(registry, alice, 3)
    _stored(registry, bob, 3)
    token = stub.ListMemories(pb2.ListMemoriesRequest(user_id=alice, page_size=1)).next_page_token
    assert token and not token.isdigit()  # not an offset a caller could compute or edit
    code, details = refused(lambda: stub.ListMemories(pb2.ListMemoriesRequest(user_id=bob, page_token=token)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "another listing" in details
    forged = token[:-2] + ("AA" if token[-2:] != "AA" else "BB")
    code, details = refused(lambda: stub.ListMemories(pb2.ListMemoriesRequest(user_id=alice, page_token=forged)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in details
    for bad in ("1", "x" * 500, "%%%"):
        code, details = refused(lambda: stub.ListMemories(pb2.ListMemoriesRequest(user_id=alice, page_token=bad)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a token this server issued" in details
    rest = stub.ListMemories(pb2.ListMemoriesRequest(user_id=alice, page_size=5, page_token=token))
    assert len(rest.facts) == 2 and rest.next_page_token == ""
    for u in (alice, bob):
        stub.DeleteUser(pb2.DeleteUserRequest(user_id=u))


# ------------------------------------------------------------------ google.rpc error details (issue 20 item 4)
def test_every_error_carries_google_rpc_details(stub):
    uid = _user()
    cases = [  # (call, code, reason, BadRequest field or None)
        (lambda: stub.Search(pb2.SearchRequest(user_id=uid, query="q", k=201)), "INVALID_ARGUMENT", "INVALID_ARGUMENT", "k"),
        (lambda: stub.GetMemory(pb2.GetMemoryRequest(user_id="a/b", fact_id="f")), "INVALID_ARGUMENT",
         "INVALID_ARGUMENT", "user_id"),
        (lambda: list(stub.Answer(pb2.AnswerRequest(user_id=uid, query="q", temperature=3.0))), "INVALID_ARGUMENT",
         "INVALID_ARGUMENT", "temperature"),
        (lambda: stub.AddFacts(pb2.AddFactsRequest(user_id=uid, facts=[
            pb2.FactInput(text="ok"), pb2.FactInput(text="x" * (LIMITS.max_fact_chars + 1))])),
         "RESOURCE_EXHAUSTED", "FIELD_TOO_LARGE", "facts[1].text"),
        (lambda: stub.AddFacts(pb2.AddFactsRequest(user_id=uid, facts=[pb2.FactInput(text="y" * 1500)] * 800)),
         "RESOURCE_EXHAUSTED", "REQUEST_TOO_LARGE", None),
        (lambda: stub.GetMemory(pb2.GetMemoryRequest(user_id=uid, fact_id="nope")), "NOT_FOUND", "NOT_FOUND", None),
        (lambda: stub.Search(pb2.SearchRequest(user_id=uid, query="q")), "UNAVAILABLE", "BACKENDS_NOT_DEPLOYED", None),
    ]
    for call, code, reason, field in cases:
        got, details, trailers = rich_refusal(call)
        assert got.name == code, (reason, got)
        assert details["ErrorInfo"].reason == reason and details["ErrorInfo"].domain == "inferscale.v1.Memory"
        if field is None:
            assert "BadRequest" not in details
        else:
            (violation,) = details["BadRequest"].field_violations
            assert violation.field == field and field.split("[")[0] in violation.description
        assert "RetryInfo" not in details and "QuotaFailure" not in details  # none of these is worth a retry
        if got in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
            assert trailers["grpc-retry-pushback-ms"] == "-1"  # gRPC retry policies stop here


def test_quota_is_quota_failure_and_overload_is_retry_info(core, stub, admin_token):
    uid = _user()
    stub.AddFacts(pb2.AddFactsRequest(user_id=uid, facts=[pb2.FactInput(text=f"f{i}") for i in range(5)]))
    code, details, trailers = rich_refusal(lambda: stub.AddFacts(pb2.AddFactsRequest(user_id=uid, facts=[
        pb2.FactInput(text="one too many")])))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details["ErrorInfo"].reason == "QUOTA_EXCEEDED"
    (v,) = details["QuotaFailure"].violations
    assert (v.subject, v.quota_id, v.quota_value) == (f"user:{uid}", "facts_per_user", LIMITS.max_facts_per_user)
    assert "RetryInfo" not in details and trailers["grpc-retry-pushback-ms"] == "-1"
    # Overload: this server's health Watch slots per connection are taken -> RetryInfo with the delay.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from inferscale_server.gateway.core import WATCH_RETRY_S

    srv = ServerThread(core)
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}", options=[("grpc.enable_retries", 0)])
    held = []
    try:
        health = health_pb2_grpc.HealthStub(ch)
        for _ in range(core.watches.per_peer):
            stream = health.Watch(health_pb2.HealthCheckRequest())
            next(stream)  # open: its first status arrived
            held.append(stream)
        code, details, trailers = rich_refusal(lambda: next(health.Watch(health_pb2.HealthCheckRequest())))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details["ErrorInfo"].reason == "TOO_MANY_WATCHES"
        assert details["RetryInfo"].retry_delay.ToMilliseconds() == WATCH_RETRY_S * 1000
        assert trailers["grpc-retry-pushback-ms"] == str(int(WATCH_RETRY_S * 1000)) and "QuotaFailure" not in details
    finally:
        for s in held:
            s.cancel()
        ch.close()
        srv.stop()
    stub.DeleteUser(pb2.DeleteUserRequest(user_id=uid))


def _server_attempts() -> int:
    """RPC attempts all gRPC servers of this process have started (channelz; this module's server is the only
    one receiving calls while a test runs)."""
    import json

    from grpc._cython import cygrpc  # channelz, as grpcio-channelz reads it

    return sum(int(s["data"].get("callsStarted", 0)) for s in json.loads(cygrpc.channelz_get_servers(0))["server"])


def test_the_light_client_never_retries_a_quota_failure_or_a_permanent_unavailable(core, admin_token):
    """inferscale_client's retry policy (gRPC's own, from the service config) retries RESOURCE_EXHAUSTED and
    UNAVAILABLE, but the server's retry pushback (-1 where no RetryInfo is given) stops it: each is sent once."""
    from inferscale_client import MemoryClient

    srv = ServerThread(core)
    uid = _user()
    with MemoryClient(f"127.0.0.1:{srv.port}", token=admin_token, retry=True, timeout_s=30) as c:
        c.add_facts(uid, [f"f{i}" for i in range(5)])
        before = _server_attempts()
        with pytest.raises(grpc.RpcError) as e:
            c.add_facts(uid, ["one too many"])
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _server_attempts() - before == 1, "a quota failure was retried"
        before = _server_attempts()
        with pytest.raises(grpc.RpcError) as e:
            c.search(uid, "q")  # registry-only: UNAVAILABLE that no retry can fix
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and _server_attempts() - before == 1
        c.delete_user(uid)
    srv.stop()


# ------------------------------------------------------------------ the caller's deadline (issue 20 item 4)
def test_the_callers_deadline_bounds_the_servers_work(stub, registry, redis_url):
    """The server waits for its backends (here the registry, paused with CLIENT PAUSE: a real stall) only as
    long as the gRPC caller's deadline, and answers DEADLINE_EXCEEDED itself, just before the caller's own
    timer would fire (its message, not gRPC's "Deadline Exceeded"); without a deadline the call waits the
    stall out and succeeds."""
    import time

    import redis

    uid = _user()
    ids = _stored(registry, uid, 2)
    pauser = redis.Redis.from_url(redis_url)
    pauser.execute_command("CLIENT", "PAUSE", 1500, "ALL")
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        stub.ListMemories(pb2.ListMemoriesRequest(user_id=uid), timeout=0.6)
    took = time.monotonic() - t0
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline passed before the backends answered" in e.value.details(), e.value.details()
    assert took < 1.2  # the caller is answered at its deadline, not when the registry is back
    time.sleep(max(0.0, 1.6 - took))
    pauser.execute_command("CLIENT", "PAUSE", 800, "ALL")
    t0 = time.monotonic()
    assert [f.fact_id for f in stub.ListMemories(pb2.ListMemoriesRequest(user_id=uid)).facts] == ids
    assert time.monotonic() - t0 >= 0.5  # no deadline: the server waited for the registry
    pauser.close()
    stub.DeleteUser(pb2.DeleteUserRequest(user_id=uid))


def test_backend_calls_take_the_callers_time_capped_by_the_servers():
    """ServeBackends' bound on a backend call (deadlines.within_deadline): the caller's remaining time when shorter
    than the server's cap (DEADLINE_EXCEEDED), else the cap (TimeoutError: UNAVAILABLE, retryable)."""
    import time

    from inferscale_server.deadlines import caller_deadline, within_deadline
    from inferscale_server.errors import ApiError, to_api_error

    async def run(deadline_s, cap_s):
        with caller_deadline(deadline_s):
            return await within_deadline(asyncio.sleep(5), cap_s)

    t0 = time.monotonic()
    with pytest.raises(ApiError) as e:
        asyncio.run(run(0.3, 120.0))
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 1
    with pytest.raises(TimeoutError) as t:
        asyncio.run(run(30.0, 0.2))
    assert to_api_error(t.value).code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ApiError) as e:  # already past: refused before the backend is called
        asyncio.run(run(0.0, 120.0))
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
