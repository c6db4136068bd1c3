"""Mem0's HTTP API (services/gateway/mem0_http.py) with Mem0's own client, the installed `mem0ai` package's (>= 2.2, < 3)
`MemoryClient(api_key=<InferScale token>, host=<InferScale URL>)`, unchanged, over real HTTP: the HTTP front door's
FastAPI app in uvicorn on 127.0.0.1, a GatewayCore with JWT auth on and its registry in a real redis-server.

No Ray here (registry-only mode, seconds): every call that needs no engine. Search with filters and threshold
and add with inference run on the whole service in tests/test_service_e2e.py
(test_mem0_client_search_filters_and_threshold_on_the_running_service and the infer=true test). Also here: the
registry's history of a fact (both backends), and filters / scopes / DeleteUser on gRPC (the core, and the light
client over a real grpc server).
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid

import httpx
import pytest
from auth_fixture import token_for, token_gateway

from inferscale_server.api import Limits, pb2
from inferscale_server.gateway import build_http_app
from inferscale_server.registry import EmbeddedRegistry, NewFact, RedisRegistry

os.environ.setdefault("MEM0_TELEMETRY", "false")  # mem0ai's client would post telemetry events
mem0 = pytest.importorskip("mem0")
from mem0 import MemoryClient  # noqa: E402
from mem0.exceptions import AuthenticationError, MemoryNotFoundError, ValidationError  # noqa: E402

LIMITS = Limits(max_request_bytes=64 << 10)


class HttpThread:
    """The HTTP front door's app in uvicorn on a free loopback port, in a thread."""

    def __init__(self, app):
        import uvicorn

        from inferscale_server.registry.local_redis import free_port

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def registry(redis_url):
    reg = RedisRegistry(redis_url, prefix=f"mem0{uuid.uuid4().hex[:8]}:")
    yield reg
    reg.close()


@pytest.fixture(scope="module")
def core(registry, jwt_secret):
    return token_gateway(registry, jwt_secret, LIMITS)


@pytest.fixture(scope="module")
def server(core):
    srv = HttpThread(build_http_app(lambda: core))
    yield srv
    srv.stop()


def _user() -> str:
    return f"u{uuid.uuid4().hex[:8]}"


def _client(server, jwt_secret, user: str) -> MemoryClient:
    return MemoryClient(api_key=token_for(jwt_secret[1], user), host=server.url)


# ------------------------------------------------------------------------------------------ the client's calls
def test_every_memory_client_call_round_trips(server, jwt_secret):
    user = _user()
    c = _client(server, jwt_secret, user)
    added = c.add([{"role": "system", "content": "be brief"},
                   {"role": "user", "content": "I am vegetarian and I live in Lyon."},
                   {"role": "assistant", "content": "Noted: vegetarian, Lyon."}],
                  infer=False, metadata={"source": "chat", "priority": 3}, agent_id="chef", run_id="s1")
    assert [e["event"] for e in added["results"]] == ["ADD", "ADD"]  # the system message is not stored
    veg, note = (e["id"] for e in added["results"])
    (other,) = [e["id"] for e in c.add("My bike is orange.", infer=False, filters={"agent_id": "mechanic"},
                                      metadata={"priority": 9})["results"]]

    got = c.get(veg)
    assert got["memory"] == "I am vegetarian and I live in Lyon." and got["user_id"] == user
    assert got["agent_id"] == "chef" and got["run_id"] == "s1" and got["app_id"] is None
    assert got["metadata"] == {"source": "chat", "priority": 3, "role": "user"} and got["version"] == 1

    everything = c.get_all(filters={"user_id": user})
    assert everything["count"] == 3 and [m["id"] for m in everything["results"]] == [veg, note, other]
    assert _ids(c.get_all(filters={"agent_id": "chef"})) == [veg, note]
    assert _ids(c.get_all(filters={"AND": [{"user_id": user}, {"run_id": "s1"}, {"role": "user"}]})) == [veg]
    assert _ids(c.get_all(filters={"priority": {"gte": 5}})) == [other]
    assert _ids(c.get_all(filters={"OR": [{"agent_id": "mechanic"}, {"metadata": {"role": "assistant"}}]})) == [note, other]
    assert _ids(c.get_all(filters={"NOT": [{"agent_id": "chef"}]})) == [other]
    assert _ids(c.get_all(filters={"memory_source": "*"})) == []
    assert _ids(c.get_all(filters={"created_at": {"gte": "2020-01-01T00:00:00Z"}, "source": {"icontains": "CHA"}})) \
        == [veg, note]
    page = c.get_all(filters={"user_id": user}, page=2, page_size=2)
    assert page["count"] == 3 and _ids(page) == [other] and page["next"] is None and "page=1" in page["previous"]

    updated = c.update(veg, text="I am vegan and I live in Lyon.")
    assert updated["memory"] == "I am vegan and I live in Lyon." and updated["version"] == 2
    c.update(veg, metadata={"source": "settings"})  # replaces the metadata; the scope stays
    after = c.get(veg)
    assert after["metadata"] == {"source": "settings"} and after["agent_id"] == "chef" and after["version"] == 3
    history = c.history(veg)
    assert [(h["event"], h["old_memory"], h["new_memory"], h["version"]) for h in history] == [
        ("ADD", None, "I am vegetarian and I live in Lyon.", 1),
        ("UPDATE", "I am vegetarian and I live in Lyon.", "I am vegan and I live in Lyon.", 2),
        ("UPDATE", "I am vegan and I live in Lyon.", "I am vegan and I live in Lyon.", 3)]
    assert history[0]["metadata"] == {"source": "chat", "priority": 3, "role": "user"}
    assert history[2]["metadata"] == {"source": "settings"}

    assert c.delete(note) == {"message": "Memory deleted successfully!"}
    with pytest.raises(MemoryNotFoundError):
        c.get(note)
    with pytest.raises(MemoryNotFoundError):  # the history went with the fact
        c.history(note)
    assert c.delete_all(agent_id="mechanic")["deleted"] == 1  # one scope only
    assert _ids(c.get_all()) == [veg]
    assert c.delete_all(user_id=user)["deleted"] == 1
    assert c.get_all()["count"] == 0
    assert c.delete_all()["deleted"] == 0  # nothing left: still a success, as Mem0's delete_all
    with pytest.raises(MemoryNotFoundError):
        c.history(veg)


def _ids(page: dict) -> list[str]:
    return [m["id"] for m in page["results"]]


def test_pages_with_and_without_a_filter_and_an_oversized_filter(server, jwt_secret):
    """get_all pages the same with a filter (matched off the event loop, 1000 facts a read) and without one (the
    page alone from the registry, the count from the user's counter); a filter over the size limit on this door
    (a 1 MiB body's `in` list) is refused (413) as on gRPC, before any fact is read."""
    user = _user()
    c = _client(server, jwt_secret, user)
    ids = [c.add(f"fact number {i}", infer=False, metadata={"n": i % 2})["results"][0]["id"] for i in range(7)]
    for page, want in ((1, ids[:3]), (2, ids[3:6]), (3, ids[6:]), (4, [])):
        got = c.get_all(page=page, page_size=3)
        assert got["count"] == 7 and _ids(got) == want, page
        assert (got["next"] is None) == (page >= 3)
    odd = [f for i, f in enumerate(ids) if i % 2]
    for page, want in ((1, odd[:2]), (2, odd[2:]), (3, [])):
        got = c.get_all(filters={"n": {"in": [1, 3]}}, page=page, page_size=2)
        assert got["count"] == 3 and _ids(got) == want, page
    r = httpx.post(f"{server.url}/v3/memories/", json={"filters": {"n": {"in": list(range(8_000))}}},
                   headers={"authorization": f"Token {token_for(jwt_secret[1], user)}"})
    assert r.status_code == 413 and "more than 256 conditions and list items" in r.text, r.text
    assert c.get_all(filters={"n": {"in": list(range(250))}})["count"] == 7


def test_two_users_are_isolated(server, jwt_secret):
    alice, bob = _user(), _user()
    a, b = _client(server, jwt_secret, alice), _client(server, jwt_secret, bob)
    (secret,) = [e["id"] for e in a.add("My locker code is 4711.", infer=False)["results"]]
    b.add("I like jazz.", infer=False)
    for call in (lambda: b.get(secret), lambda: b.history(secret), lambda: b.update(secret, text="mine now"),
                 lambda: b.delete(secret)):
        with pytest.raises(MemoryNotFoundError):  # another user's fact looks like no fact at all
            call()
    assert [m["memory"] for m in b.get_all()["results"]] == ["I like jazz."]
    for call in (lambda: b.get_all(filters={"user_id": alice}),
                 lambda: b.add("planted", infer=False, user_id=alice),
                 lambda: b.delete_all(user_id=alice),
                 lambda: b.get_all(filters={"AND": [{"user_id": alice}, {"agent_id": "x"}]})):
        with pytest.raises(AuthenticationError) as e:  # 403: a token acts for its own subject only
            call()
        assert "own subject" in e.value.message
    assert b.delete_all()["deleted"] == 1
    assert a.get(secret)["memory"] == "My locker code is 4711."  # untouched by all of bob's calls
    assert [h["event"] for h in a.history(secret)] == ["ADD"]


def test_a_wrong_token_is_refused(server, jwt_secret):
    for key in ("not-a-jwt", token_for(b"another-secret-" * 4, "mallory"), token_for(jwt_secret[1], "old", ttl_s=-60)):
        with pytest.raises(ValueError, match="Error: "):  # MemoryClient's own check (GET /v1/ping/) refuses it
            MemoryClient(api_key=key, host=server.url)
    # Authentication comes before the body is read (a bad token with a bad body is 401, not 400); only a
    # declared size over the limit is refused first, from the headers alone (413).
    for headers, body, status in (({"Authorization": "Token not-a-jwt"}, b"{not json", 401), ({}, b"{}", 401),
                                  ({"Authorization": "Token not-a-jwt"}, b"x" * (70 << 10), 413)):
        r = httpx.post(f"{server.url}/v3/memories/add/", headers=headers, content=body)
        assert r.status_code == status and r.json()["detail"], r.text
        if status == 401:
            assert r.headers["WWW-Authenticate"] == "Token"
    ok = token_for(jwt_secret[1], _user())
    r = httpx.get(f"{server.url}/v1/ping/", headers={"Authorization": f"Bearer {ok}"})  # Bearer works as well
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_bad_input_is_a_clear_400(server, jwt_secret):
    c = _client(server, jwt_secret, _user())
    cases = [
        (lambda: c.add("x", infer=False, custom_instructions="be terse"), "`custom_instructions` is not supported"),
        (lambda: c.add("x", infer=False, metadata={"agent_id": "a"}), "set the agent_id field"),
        (lambda: c.add([{"role": "robot", "content": "x"}], infer=False), "messages.0.role"),
        (lambda: c.add("x", infer=False, filters={"priority": 1}), "filters.priority"),
        (lambda: c.get_all(filters={"priority": {"between": [1, 2]}}), "unknown operator 'between'"),
        (lambda: c.get_all(filters={"OR": [{"user_id": "x"}]}), "user_id may only be named"),
        (lambda: c.get_all(filters={"created_at": {"gte": "last week"}}), "ISO-8601"),
        (lambda: c.get_all(filters={"categories": {"in": ["food"]}}), "'categories' is not supported"),
        (lambda: c.get_all(page=0), "page must be an integer"),
        (lambda: c.search("tea", top_k=0), "top_k must be in [1, 200]"),
        (lambda: c.search("tea", rerank=True), "rerank"),
        (lambda: c.update("f" * 8), None),  # the client itself refuses an empty update
        (lambda: c.update("f" * 8, text="x", timestamp=5), "`timestamp` is not supported"),
        (lambda: c.delete("f" * 8, delete_linked=True), "delete_linked is not supported"),
    ]
    for call, message in cases:
        with pytest.raises((ValidationError, ValueError)) as e:
            call()
        if message is not None:
            assert isinstance(e.value, ValidationError) and message in e.value.message, (message, e.value)
    with pytest.raises(mem0.exceptions.MemoryQuotaExceededError):  # 413, refused from Content-Length
        c.add("y" * (70 << 10), infer=False)


def test_openapi_schema_documents_the_mem0_routes(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    mem0_paths = {p: sorted(ops) for p, ops in doc["paths"].items() if any("mem0" in o.get("tags", [])
                                                                        for o in ops.values())}
    assert mem0_paths == {"/v1/ping/": ["get"], "/v3/memories/add/": ["post"], "/v3/memories/": ["post"],
                          "/v3/memories/search/": ["post"], "/v1/memories/": ["delete"],
                          "/v1/memories/{memory_id}/": ["delete", "get", "put"],
                          "/v1/memories/{memory_id}/history/": ["get"]}
    add = doc["paths"]["/v3/memories/add/"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert add["required"] == ["messages"] and "infer" in add["properties"]
    assert add["properties"]["messages"]["items"]["properties"]["role"]["enum"] == ["system", "user", "assistant"]
    assert add["additionalProperties"] is False  # what is not implemented is not in the schema
    search = doc["paths"]["/v3/memories/search/"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"query", "filters", "top_k", "threshold"} <= set(search["properties"])
    json.dumps(doc)


# ------------------------------------------------------------------------------------- a fact's history
@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_history_keeps_earlier_versions_and_goes_with_the_fact(backend, redis_url):
    from inferscale_core.errors import UnknownFactError
    from inferscale_server.registry import fact_bytes
    from inferscale_server.registry.base import MAX_HISTORY

    reg = EmbeddedRegistry() if backend == "embedded" else RedisRegistry(redis_url, prefix=f"h{uuid.uuid4().hex[:8]}:")
    (f,) = reg.create("u", [NewFact("v1", {"k": "a"})])
    assert reg.history("u", f.fact_id) == []
    reg.update("u", f.fact_id, window=("- neighbour\n",))  # a re-windowing is no new version for the user
    reg.update("u", f.fact_id, text="v3")
    reg.update("u", f.fact_id, metadata={"k": "b"})
    hist = reg.history("u", f.fact_id)
    assert [(v.version, v.text, v.metadata) for v in hist] == [(2, "v1", {"k": "a"}), (3, "v3", {"k": "a"})]
    assert hist[0].replaced_at == hist[1].updated_at
    cur = reg.get("u", f.fact_id)
    assert reg.user_bytes("u") == fact_bytes(cur) + sum(len(v.to_json()) for v in hist)  # counted in the quota
    with pytest.raises(UnknownFactError):
        reg.history("someone-else", f.fact_id)
    for i in range(MAX_HISTORY + 5):
        reg.update("u", f.fact_id, text=f"t{i}")
    hist = reg.history("u", f.fact_id)
    assert len(hist) == MAX_HISTORY and hist[-1].text == f"t{MAX_HISTORY + 3}"  # the oldest were dropped
    assert reg.user_bytes("u") == fact_bytes(reg.get("u", f.fact_id)) + sum(len(v.to_json()) for v in hist)
    reg.delete("u", f.fact_id)
    assert reg.user_bytes("u") == 0
    with pytest.raises(UnknownFactError):
        reg.history("u", f.fact_id)
    (g,) = reg.create("u", [NewFact("w1")])
    reg.update("u", g.fact_id, text="w2")
    assert reg.delete_user("u") == 1
    (h,) = reg.create("u", [NewFact("again", fact_id=g.fact_id)])  # the id reused: no history inherited
    assert reg.history("u", h.fact_id) == []


# -------------------------------------------------------------------------------- the same on gRPC's core
def test_grpc_filters_scopes_and_delete_user(core, jwt_secret):
    user = _user()
    from inferscale_server.auth import USER_SCOPES, Principal

    me = Principal(user, frozenset(USER_SCOPES))

    async def run():
        await core.AddFacts(pb2.AddFactsRequest(user_id=user, agent_id="chef", facts=[
            pb2.FactInput(text="likes leeks", metadata={"lang": "fr"}), pb2.FactInput(text="likes kale")]), me)
        await core.AddMemory(pb2.AddMemoryRequest(user_id=user, infer=False, run_id="r9", messages=[
            pb2.Message(role="user", content="sleeps at 11")]), me)

        async def listed(**kw):
            return [f.text for f in (await core.ListMemories(pb2.ListMemoriesRequest(user_id=user, **kw), me)).facts]
        assert await listed(agent_id="chef") == ["likes leeks", "likes kale"]
        assert await listed(run_id="r9") == ["sleeps at 11"]
        assert await listed(agent_id="chef", filters=json.dumps({"lang": "fr"})) == ["likes leeks"]
        assert await listed(filters=json.dumps({"NOT": [{"agent_id": "*"}]})) == ["sleeps at 11"]
        assert await listed(page_size=1, agent_id="chef") == ["likes leeks"]  # a page of 1, then the next
        for bad in ("{nope", json.dumps({"lang": {"near": "fr"}})):
            with pytest.raises(Exception) as e:
                await listed(filters=bad)
            assert e.value.code.name == "INVALID_ARGUMENT"
        with pytest.raises(Exception) as e:  # Search needs the deployments; the filter is checked first
            await core.Search(pb2.SearchRequest(user_id=user, query="q", filters="[1]"), me)
        assert e.value.code.name == "INVALID_ARGUMENT"
    asyncio.run(run())
    # The light client over a real gRPC server: the filter travels as JSON text; DeleteUser of no facts is no error.
    from grpc_thread import ServerThread

    from inferscale_client import MemoryClient as GrpcClient

    srv = ServerThread(core)
    try:
        c = GrpcClient(channel=srv.channel(), token=token_for(jwt_secret[1], user), retry=False)
        assert [f.text for f in c.list(user, page_size=1, filters={"agent_id": "chef"})] == ["likes leeks", "likes kale"]
        assert [f.text for f in c.list(user, filters={"OR": [{"lang": "fr"}, {"run_id": "r9"}]})] == \
            ["likes leeks", "sleeps at 11"]
        assert c.delete_user(user) == 3 and c.delete_user(user) == 0
    finally:
        srv.stop()


class ScriptedSink:
    """The extractor's FactSink over an in-process registry, with the serving LLM's answer scripted (the engine's
    own extraction runs in test_service_e2e.py); what the test reads is mem0's history store, which is real."""

    def __init__(self, answer: str):
        self.registry, self.answer, self.prompts = EmbeddedRegistry(), answer, []

    def add(self, user_id, facts):
        return self.registry.create(user_id, facts)

    def search(self, user_id, vector, k):
        return []

    def get(self, user_id, fact_id):
        return self.registry.get(user_id, fact_id)

    def list(self, user_id):
        return self.registry.list(user_id)[0]

    def update(self, user_id, fact_id, text, vector, metadata):
        return self.registry.update(user_id, fact_id, text=text)

    def delete(self, user_id, fact_id):
        self.registry.delete(user_id, fact_id)

    def chat(self, messages, max_tokens, temperature, structured):
        self.prompts.append(json.dumps(messages))
        return self.answer

    def chat_room(self, messages):
        return 1 << 20


def test_the_extractor_keeps_no_text_outside_the_registry():
    """mem0 stores every message and every memory text of an extraction in its SQLite history, and reads a user's
    last messages into the next extraction: text DeleteUser cannot reach. After each call the store is empty, and
    a later extraction (a user deleted and created again) is not given earlier messages."""
    from inferscale_server.mem0_provider import Mem0Extractor

    sink = ScriptedSink('{"memory": [{"text": "Lives in Oslo"}]}')
    extractor = Mem0Extractor(sink)
    events = extractor.add("ann", [{"role": "user", "content": "I moved to Oslo, my PIN is 4711."}])
    assert [e["memory"] for e in events] == ["Lives in Oslo"] and sink.registry.count("ann") == 1
    db = extractor.memory.db.connection
    tables = {name for (name,) in db.execute("select name from sqlite_master where type = 'table'")}
    assert all(db.execute(f"select count(*) from {t}").fetchone() == (0,) for t in tables), tables
    extractor.add("ann", [{"role": "user", "content": "I like tea."}])
    assert "4711" in sink.prompts[0] and "4711" not in sink.prompts[-1]
