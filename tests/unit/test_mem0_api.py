"""Mem0's HTTP API (services/gateway/mem0_http.py) with Mem0's own client, the installed `mem0ai` package's (>= 2.2, < 3)
`MemoryClient(api_key=<InferScale token>, host=<InferScale URL>)` (and AsyncMemoryClient), unchanged, over real HTTP:
the HTTP front door's FastAPI app in uvicorn on 127.0.0.1, a GatewayCore with JWT auth on and its registry in a real
redis-server; one more without authentication (--insecure-no-auth).

No Ray here (registry-only mode, seconds): every call that needs no engine, and every call the client knows that
this server does not serve (501 naming the call, never 404), checked against docs/mem0.md's compatibility table,
itself checked against the installed client's source. Search with filters and threshold and add with inference run
on the whole service in tests/service/one_app/test_service_e2e.py (test_mem0_client_search_filters_and_threshold_on_the_running_service
and the infer=true test). Also here: the registry's history of a fact (both backends), filters / scopes / DeleteUser
on gRPC (the core, and the light client over a real grpc server), and CORS preflights for the API's methods.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from support.auth_fixture import token_for, token_gateway
from support.http_thread import HttpThread
from support.mem0_table import doc_table, norm_route
from support.paths import REPO

from inferscale_server.api import pb2
from inferscale_server.gateway import build_http_app, mem0_http
from inferscale_server.limits import Limits
from inferscale_server.registry import EmbeddedRegistry, NewFact, RedisRegistry

os.environ.setdefault("MEM0_TELEMETRY", "false")  # mem0ai's client would post telemetry events
mem0 = pytest.importorskip("mem0")
from mem0 import AsyncMemoryClient, MemoryClient  # noqa: E402
from mem0.exceptions import AuthenticationError, MemoryNotFoundError, ValidationError  # noqa: E402

LIMITS = Limits(max_request_bytes=64 << 10)


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
    assert c.delete_all(user_id=user)["deleted"] == 0  # nothing left: still a success, as Mem0's delete_all
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
    with pytest.raises(AuthenticationError):  # nor erase another user
        b.delete_users(user_id=alice)
    for call in (lambda: b.batch_update([{"memory_id": secret, "text": "mine now"}]),
                 lambda: b.feedback(secret, "NEGATIVE")):
        with pytest.raises(MemoryNotFoundError):
            call()
    assert b.batch_delete([{"memory_id": secret}])["results"] == [{"memory_id": secret, "status": "not_found"}]
    assert [(e["type"], e["name"]) for e in b.users()["results"]] == [("user", bob)]  # no other user listed
    assert b.delete_all(user_id=bob)["deleted"] == 1
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
        (lambda: c.delete("f" * 8, delete_linked=True), "delete_linked is not supported"),
        # Mem0's options with a value: refused by name, with why.
        (lambda: c.update("f" * 8, text="x", timestamp=5), "`timestamp` is not supported by this server: an update "
                                                           "does not change when a memory was created"),
        (lambda: c.batch_update([{"memory_id": "f" * 8, "text": "x", "expiration_date": "2030-01-01"}]),
         "`memories.0.expiration_date` is not supported by this server: batch_update changes text and metadata"),
        (lambda: c.search("tea", keyword_search=True), "keyword_search"),
        (lambda: c.search("tea", categories=["food"]), "`categories` is not supported by this server: memories here"),
        (lambda: c.get_all(start_date="2026-01-01"), "filters={\"created_at\": {\"gte\": ...}}"),
        (lambda: c.batch_update([{"memory_id": "f" * 8}]), "memories[0]: nothing to update"),
        (lambda: c.batch_update([{"memory_id": "f" * 8, "text": "a"}, {"memory_id": "f" * 8, "text": "b"}]),
         "memories[1].memory_id repeats memories[0].memory_id"),
        (lambda: c.batch_delete([{"memory_id": "f" * 8, "text": "a"}]), "`memories.0.text` is not supported"),
        (lambda: c.batch_delete([]), "memories: List should have at least 1 item"),
        (lambda: c.delete_all(filters={"priority": {"between": [1, 2]}}), "unknown operator 'between'"),
    ]
    for call, message in cases:
        with pytest.raises((ValidationError, ValueError)) as e:
            call()
        if message is not None:
            assert isinstance(e.value, ValidationError) and message in e.value.message, (message, e.value)
    with pytest.raises(mem0.exceptions.MemoryQuotaExceededError):  # 413, refused from Content-Length
        c.add("y" * (70 << 10), infer=False)
    with pytest.raises(mem0.exceptions.MemoryQuotaExceededError) as e:  # a batch is bounded like AddFacts
        c.batch_delete([{"memory_id": f"m{i}"} for i in range(LIMITS.max_facts_per_request + 1)])
    assert "the limit is 256" in e.value.message
    # Options sent with their "not set" values are no refusal: the client's expiration_date=None (clearing an
    # expiry the memory does not have: no new version), nulls from raw HTTP, the default values of search and get_all.
    (mid,) = [e["id"] for e in c.add("I like tea.", infer=False)["results"]]
    assert c.update(mid, text="I like green tea.", expiration_date=None)["version"] == 2
    assert c.update(mid, expiration_date=None)["version"] == 2  # nothing else asked: the memory as it is
    assert c.get_all(show_expired=True, latest_only=False)["count"] == 1
    with pytest.raises(mem0.exceptions.NetworkError) as e:  # search needs the engine; the options were accepted
        c.search("tea", rerank=False, keyword_search=False, show_expired=False, latest_only=True)
    assert "registry-only mode" in e.value.message
    token = {"authorization": f"Token {c.api_key}"}
    r = httpx.post(f"{server.url}/v3/memories/add/", headers=token, json={
        "messages": [{"role": "user", "content": "I like oolong."}], "infer": False, "timestamp": None,
        "expiration_date": None, "custom_instructions": None})
    assert r.status_code == 200, r.text
    r = httpx.put(f"{server.url}/v1/memories/{mid}/", headers=token, json={"text": "x", "timestamp": 17})
    assert r.status_code == 400 and "`timestamp` is not supported" in r.json()["detail"]


# ------------------------------------------------------------------------------ expiration_date and timestamp
def _days_from_today(n: int) -> str:
    """A date n days from today, UTC (Mem0 evaluates expiration dates in UTC)."""
    return (datetime.now(timezone.utc).date() + timedelta(days=n)).isoformat()


def test_an_expired_memory_is_kept_but_not_listed_or_searched(server, jwt_secret):
    """Mem0's expiration_date: YYYY-MM-DD in UTC, the day itself included. A memory whose date has passed is stored
    (get by id answers it, with its date) but get_all leaves it out, filtered or not, count included, unless
    show_expired=True; update sets an expiry or clears it (null) and the memory is listed again."""
    c = _client(server, jwt_secret, _user())
    yesterday, today, later = _days_from_today(-1), _days_from_today(0), _days_from_today(30)
    (gone,) = _ids(c.add("My trial ended.", infer=False, expiration_date=yesterday, metadata={"k": 1}))
    (last_day,) = _ids(c.add("My trial ends today.", infer=False, expiration_date=today, metadata={"k": 1}))
    (plain,) = _ids(c.add("I like figs.", infer=False, metadata={"k": 2}))
    (soon,) = _ids(c.add("My plan renews next month.", infer=False, expiration_date=later, metadata={"k": 2}))
    listed = c.get_all()
    assert listed["count"] == 3 and _ids(listed) == [last_day, plain, soon]
    assert [m["expiration_date"] for m in listed["results"]] == [today, None, later]
    assert _ids(c.get_all(page=2, page_size=2)) == [soon] and c.get_all(page_size=2)["count"] == 3
    assert _ids(c.get_all(filters={"k": 1})) == [last_day]  # a filter and the expiry together
    shown = c.get_all(show_expired=True)
    assert shown["count"] == 4 and _ids(shown) == [gone, last_day, plain, soon]
    got = c.get(gone)  # by id it answers, as on Mem0's platform
    assert got["memory"] == "My trial ended." and got["expiration_date"] == yesterday
    back = c.update(gone, expiration_date=None)  # cleared: listed again
    assert back["expiration_date"] is None and back["version"] == 2 and gone in _ids(c.get_all())
    c.update(plain, expiration_date=yesterday)
    assert plain not in _ids(c.get_all()) and c.get(plain)["expiration_date"] == yesterday
    assert c.update(plain, text="I love figs.")["expiration_date"] == yesterday  # a text update keeps it
    assert [h["new_memory"] for h in c.history(plain)] == ["I like figs.", "I love figs."]
    with pytest.raises(ValidationError) as e:  # search serves what answers may inject: never an expired memory
        c.search("trial", show_expired=True)
    assert "show_expired=true is not supported on search" in e.value.message
    for call in (lambda: c.add("x", infer=False, expiration_date="2030-13-01"),
                 lambda: c.add("x", infer=False, expiration_date="tomorrow"),
                 lambda: c.add("x", infer=False, expiration_date="2030-01-01T00:00:00Z"),
                 lambda: c.update(soon, expiration_date="31/01/2030"),
                 lambda: c.update("f" * 8, expiration_date="2030-02-30")):  # checked before the memory is looked up
        with pytest.raises(ValidationError) as e:
            call()
        assert re.match(r"expiration_date (must be a date YYYY-MM-DD|'.*' is not a date)", e.value.message), \
            e.value.message
    r = httpx.post(f"{server.url}/v3/memories/add/", headers={"authorization": f"Token {c.api_key}"},
                   json={"messages": [{"role": "user", "content": "x"}], "infer": False, "expiration_date": 20300101})
    assert r.status_code == 400 and r.json()["detail"].startswith("expiration_date"), r.text
    assert c.get_all(show_expired=True)["count"] == 4  # nothing refused was stored


def test_timestamp_sets_created_at(server, jwt_secret):
    """Mem0's add(timestamp=<Unix seconds>): the memories' created_at (and updated_at: not updated since), which
    the created_at filter reads too; a value that is no past time, or no integer, is a 400 naming it."""
    c = _client(server, jwt_secret, _user())
    (old,) = _ids(c.add("I lived in Oslo.", infer=False, timestamp=1_600_000_000))
    (new,) = _ids(c.add("I live in Lyon.", infer=False))
    got = c.get(old)
    assert got["created_at"] == got["updated_at"] == "2020-09-13T12:26:40+00:00"
    assert c.get(new)["created_at"] > "2025"
    assert _ids(c.get_all(filters={"created_at": {"lt": "2021-01-01T00:00:00Z"}})) == [old]
    assert c.history(old)[0]["created_at"] == "2020-09-13T12:26:40+00:00"
    assert c.update(old, text="I lived in Bergen.")["created_at"] == "2020-09-13T12:26:40+00:00"
    soon = int(time.time()) + 60  # within the clock skew allowed
    (skewed,) = _ids(c.add("Just now.", infer=False, timestamp=soon))
    assert c.get(skewed)["created_at"] == datetime.fromtimestamp(soon, timezone.utc).isoformat()
    for bad in (int(time.time()) + 2 * 86400, -5, 10 ** 20):
        with pytest.raises(ValidationError) as e:
            c.add("x", infer=False, timestamp=bad)
        assert e.value.message.startswith(f"timestamp {bad} is not a time a memory was created"), e.value.message
    token = {"authorization": f"Token {c.api_key}"}
    for bad in (1.6e9, "1600000000", True):
        r = httpx.post(f"{server.url}/v3/memories/add/", headers=token,
                       json={"messages": [{"role": "user", "content": "x"}], "infer": False, "timestamp": bad})
        assert r.status_code == 400 and r.json()["detail"].startswith("timestamp: "), (bad, r.text)
    assert c.get_all()["count"] == 3  # nothing refused was stored


def test_an_extraction_adds_its_memories_with_adds_timestamp_and_expiry():
    """add(infer=true, timestamp=..., expiration_date=...): Mem0's extraction stores the memories it adds through
    the gateway's sink (GatewaySink.add), which gives them the call's created_at and expires_at (the extraction
    itself, with the serving LLM, runs in test_service_e2e.py)."""
    from inferscale_server.auth import Authenticator
    from inferscale_server.gateway import GatewayCore
    from inferscale_server.gateway.core import ExtractionCall, GatewaySink

    core = GatewayCore(EmbeddedRegistry(), backends=None, limits=LIMITS, auth=Authenticator.insecure())
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        sink = GatewaySink(core, loop)
        stamped = ExtractionCall({"created_at": 1_600_000_000.0, "expires_at": 1_900_000_000.0})
        (rec,) = sink.running(stamped, sink.add)("ann", [NewFact("Lives in Oslo")])
        assert (rec.created_at, rec.updated_at, rec.expires_at) == (1_600_000_000.0, 1_600_000_000.0, 1_900_000_000.0)
        (plain,) = sink.running(ExtractionCall(), sink.add)("ann", [NewFact("Likes tea")])
        assert plain.expires_at == float("inf") and plain.created_at > 1_700_000_000
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()



FIRST_EXTRACTOR = """
import asyncio, importlib.abc, json, sys, threading
if sys.argv[1] == "without_mem0":
    sys.modules["mem0"] = None  # as if mem0ai were not installed: importing it raises ImportError
from inferscale_server.auth import Authenticator
from inferscale_server.errors import ApiError
from inferscale_server.gateway import GatewayCore
from inferscale_server.limits import Limits
from inferscale_server.registry import EmbeddedRegistry


class ImportedOn(importlib.abc.MetaPathFinder):  # notes the thread that imports mem0ai, then lets Python import it
    threads = []

    def find_spec(self, name, path=None, target=None):
        if name == "mem0":
            self.threads.append(threading.current_thread().name)
        return None


loaded_before = "mem0" in sys.modules and sys.modules["mem0"] is not None
sys.meta_path.insert(0, ImportedOn())
core = GatewayCore(EmbeddedRegistry(), backends=None, limits=Limits(), auth=Authenticator.insecure())
core.build_extractor()  # what the Gateway replica's constructor does
built = core._extractor


async def main():
    try:
        same = await core._extractor_built() is built  # the request's path: built already, nothing imported again
        return {"same": same}
    except ApiError as e:
        return {"refused": [e.code.name, e.message]}
out = asyncio.run(main())
print(json.dumps({"loaded_before": loaded_before, "imported_on": ImportedOn.threads, "built": built is not None,
                  "torch_loaded": "torch" in sys.modules, **out}))
"""


def _first_extractor(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FIRST_EXTRACTOR, mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_extractor_is_built_before_requests_on_its_thread_without_torch():
    """The Gateway replica builds mem0's extractor in its constructor (GatewayCore.build_extractor), seconds the
    first AddMemory with infer=true would otherwise wait for. In a fresh interpreter: mem0ai is imported once, on
    the extraction thread, never on the event loop; a request's path finds the extractor built; and no torch is
    loaded: mem0 embeds through the retrieval replicas (ServiceEmbedder), where a copy of the embedder in the
    gateway cost its start ~13 s and ~540 MB (BENCHMARKS.md, "The first extraction's build, before requests")."""
    r = _first_extractor("with_mem0")
    assert not r["loaded_before"] and len(r["imported_on"]) == 1, r
    assert r["imported_on"][0].startswith("mem0-extract"), r
    assert r["built"] and r["same"] and not r["torch_loaded"], r


def test_without_mem0ai_the_gateway_starts_and_infer_true_is_refused_by_name():
    r = _first_extractor("without_mem0")
    assert not r["built"], r
    code, message = r["refused"]
    assert code == "UNIMPLEMENTED" and message.startswith("AddMemory with infer=true needs mem0ai 2.2"), r
    assert "send infer=false or use AddFacts" in message, r


def test_openapi_schema_documents_the_mem0_routes(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    mem0_paths = {p: sorted(ops) for p, ops in doc["paths"].items() if any("mem0" in o.get("tags", [])
                                                                        for o in ops.values())}
    assert mem0_paths == {"/v1/ping/": ["get"], "/v3/memories/add/": ["post"], "/v3/memories/": ["post"],
                          "/v3/memories/search/": ["post"], "/v1/memories/": ["delete"],
                          "/v1/memories/{memory_id}/": ["delete", "get", "put"],
                          "/v1/memories/{memory_id}/history/": ["get"], "/v1/batch/": ["delete", "put"],
                          "/v1/entities/": ["get"], "/v2/entities/{entity_type}/{entity_id}/": ["delete"],
                          "/v1/feedback/": ["post"]}
    add = doc["paths"]["/v3/memories/add/"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert add["required"] == ["messages"] and "infer" in add["properties"]
    assert add["properties"]["messages"]["items"]["properties"]["role"]["enum"] == ["system", "user", "assistant"]
    assert add["additionalProperties"] is False  # what is not implemented is not in the schema
    search = doc["paths"]["/v3/memories/search/"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"query", "filters", "top_k", "threshold"} <= set(search["properties"])
    json.dumps(doc)


# ------------------------------------------------------------------------ batches, delete_all, entities, feedback
def test_batch_update_and_batch_delete_check_every_item_first(server, jwt_secret):
    user = _user()
    c = _client(server, jwt_secret, user)
    a, b, d = (c.add(t, infer=False, agent_id="chef")["results"][0]["id"] for t in ("likes leeks", "likes kale",
                                                                                    "likes figs"))
    out = c.batch_update([{"memory_id": a, "text": "loves leeks"}, {"memory_id": b, "metadata": {"stars": 5}}])
    assert out["updated"] == 2 and [(r["memory_id"], r["status"]) for r in out["results"]] == [(a, "updated"),
                                                                                              (b, "updated")]
    assert c.get(a)["memory"] == "loves leeks" and c.get(b)["metadata"] == {"stars": 5}
    assert c.get(b)["agent_id"] == "chef"  # the metadata is replaced, the scope stays (as update)
    # One unknown id: nothing is written, and the error names it (the client's MemoryNotFoundError).
    before = c.get(d)
    with pytest.raises(MemoryNotFoundError) as e:
        c.batch_update([{"memory_id": d, "text": "hates figs"}, {"memory_id": "nope", "text": "x"}])
    assert "'nope'" in e.value.message and "nothing was updated" in e.value.message
    with pytest.raises(mem0.exceptions.MemoryQuotaExceededError):  # a text over the limit: checked first too
        c.batch_update([{"memory_id": d, "text": "ok"}, {"memory_id": a, "text": "x" * 2001}])
    assert c.get(d) == before
    # batch_delete: an unknown id (or one already gone) is reported, not an error: it is gone either way.
    out = c.batch_delete([{"memory_id": a}, {"memory_id": "gone1"}, {"memory_id": d}])
    assert out["deleted"] == 2 and [r["status"] for r in out["results"]] == ["deleted", "not_found", "deleted"]
    assert _ids(c.get_all()) == [b]
    with pytest.raises(MemoryNotFoundError):
        c.history(a)


def test_delete_all_takes_filters_and_wants_the_whole_memory_asked_for(server, jwt_secret):
    """delete_all(filters=...) sends the filter as a query parameter (MemoryClient writes str() of the dict): the
    same filter language and limits as get_all. Without any filter or scope it would wipe the user's memory: as on
    Mem0's platform that is refused unless asked for by naming the user (user_id=<id> or "*")."""
    from mem0.client.types import DeleteAllMemoryOptions

    user = _user()
    c = _client(server, jwt_secret, user)
    for i in range(6):
        c.add(f"note {i}", infer=False, metadata={"n": i, "tag": "even" if i % 2 == 0 else "odd"},
              **({"run_id": "r1"} if i < 2 else {}))
    assert c.delete_all(DeleteAllMemoryOptions(filters={"tag": "odd", "n": {"gte": 3}}))["deleted"] == 2
    assert sorted(m["metadata"]["n"] for m in c.get_all()["results"]) == [0, 1, 2, 4]
    assert c.delete_all(filters={"AND": [{"user_id": user}, {"run_id": "*"}]})["deleted"] == 2  # "*": has a run
    assert c.delete_all(run_id="*")["deleted"] == 0
    with pytest.raises(ValidationError) as e:
        c.delete_all()
    assert f"delete_all(user_id={user!r})" in e.value.message and "delete_all(user_id=\"*\")" in e.value.message
    with pytest.raises(ValidationError) as e:  # the filter is checked as get_all's
        c.delete_all(filters={"AND": []})
    assert "must be a non-empty list" in e.value.message
    assert c.get_all()["count"] == 2 and c.get_all(filters={"user_id": "*"})["count"] == 2  # "*": this user
    with pytest.raises(AuthenticationError):  # a user_id in the filters is checked as everywhere
        c.delete_all(filters={"user_id": "someone-else", "tag": "even"})
    with pytest.raises(ValidationError) as e:
        c.delete_all(filters={"OR": [{"user_id": user}]})
    assert "user_id may only be named" in e.value.message
    token = {"authorization": f"Token {c.api_key}"}
    r = httpx.delete(f"{server.url}/v1/memories/", headers=token, params={"filters": json.dumps({"n": 2})})
    assert r.status_code == 200 and r.json()["deleted"] == 1  # JSON in the query works as well
    for bad, words in (("{'n': __import__('os')}", "must be a JSON object"), ("[1]", "must be an object"),
                       ("{" * 5000, "must be a JSON object"), (json.dumps({"n": "x" * 20_000}), "the limit is")):
        r = httpx.delete(f"{server.url}/v1/memories/", headers=token, params={"filters": bad})
        assert r.status_code in (400, 413) and words in r.json()["detail"], (bad[:20], r.text)
    assert c.delete_all(user_id="*")["deleted"] == 1  # Mem0's explicit form: every memory of this user
    assert c.get_all()["count"] == 0


def test_users_delete_users_and_reset(server, core, jwt_secret, admin_token):
    """users(): a user's token sees itself (once it has memories) and the agents, apps and runs of its memories;
    delete_users(user_id=) is DeleteUser's erasure; reset() erases the caller's memory. An admin's token is
    refused a listing of every user (no index of users) and so reset(): InferScale does not wipe every user."""
    user = _user()
    c = _client(server, jwt_secret, user)
    assert c.users()["results"] == []
    with pytest.raises(ValueError, match="No entities to delete"):  # the client's own answer to an empty memory
        c.reset()
    c.add("a", infer=False, agent_id="chef")
    c.add("b", infer=False, agent_id="chef", run_id="s1")
    c.add("c", infer=False, app_id="web")
    listed = c.users()
    assert [(e["type"], e["name"], e["total_memories"]) for e in listed["results"]] == [
        ("user", user, 3), ("agent", "chef", 2), ("run", "s1", 1), ("app", "web", 1)]
    assert listed["count"] == 4 and listed["results"][0]["owner"] == user
    assert c.delete_users(run_id="s1") == {"message": "Entity deleted successfully."}  # the run's memories
    assert sorted(m["memory"] for m in c.get_all()["results"]) == ["a", "c"]
    assert c.delete_users(agent_id="no-such-agent")["message"] == "Entity deleted successfully."
    assert c.reset() == {"message": "Client reset successful. All users and memories deleted."}
    assert c.get_all()["count"] == 0 and c.users()["results"] == []
    # DeleteUser's erasure through delete_users(user_id=...): registry rows and the tombstone every replica reads.
    reg = core.registry
    c.add("x", infer=False)
    cursor = reg.tombstones_after(None)[1]
    assert c.delete_users(user_id=user)["message"] == "Entity deleted successfully."
    assert reg.count(user) == 0 and [(t.user_id, t.fact_id, t.gone) for t in reg.tombstones_after(cursor)[0]] == [
        (user, "", True)]
    assert c.delete_users(user_id=user)["message"] == "Entity deleted successfully."  # nothing left: still done
    # An admin: may erase any user, but not list or wipe every user.
    victim = _client(server, jwt_secret, _user())
    victim.add("v", infer=False)
    admin = MemoryClient(api_key=admin_token, host=server.url)
    admin.delete_users(user_id=victim.users()["results"][0]["name"])
    assert victim.get_all()["count"] == 0
    for call in (admin.users, admin.reset, admin.delete_users):
        with pytest.raises(mem0.exceptions.MemoryError) as e:
            call()
        assert e.value.error_code == "HTTP_501" and "keeps no index of users" in e.value.message
        assert "does not delete every user at once" in e.value.message
    with pytest.raises(ValidationError) as e:
        admin.delete_all(user_id="*")
    assert "names every user" in e.value.message
    r = httpx.get(f"{server.url}/v1/entities/", params={"user_id": user}, headers={"authorization": f"Token {admin_token}"})
    assert r.status_code == 200 and r.json()["results"] == []


def test_feedback_is_acknowledged_not_stored(server, jwt_secret):
    c = _client(server, jwt_secret, _user())
    (mid,) = [e["id"] for e in c.add("I like tea.", infer=False)["results"]]
    out = c.feedback(mid, "negative", feedback_reason="wrong tea")
    assert out["memory_id"] == mid and out["feedback"] == "NEGATIVE" and "does not store" in out["message"]
    assert c.get(mid)["version"] == 1 and [h["event"] for h in c.history(mid)] == ["ADD"]  # nothing changed
    with pytest.raises(MemoryNotFoundError):
        c.feedback("no-such-memory", "POSITIVE")


# ------------------------------------------------------------------ every client call: served, or 501 by name
def test_every_call_this_server_does_not_serve_answers_501_naming_it(server, jwt_secret):
    """Each client call the table in docs/mem0.md marks 501 is made with Mem0's client: it raises the client's base
    MemoryError (HTTP 501: not MemoryNotFoundError, which a GDPR erasure could take for "already gone"), the body
    naming the call. Real not-founds on served routes stay 404, and OpenAI's /v1 namespace keeps FastAPI's 404."""
    c = _client(server, jwt_secret, _user())
    calls = {
        "create_memory_export": lambda: c.create_memory_export(schema="{}", filters={"user_id": "x"}),
        "get_memory_export": lambda: c.get_memory_export(),
        "get_summary": lambda: c.get_summary(),
        "get_profile": lambda: c.get_profile("alice"),
        "generate_profile": lambda: c.generate_profile("alice"),
        "sample_profiles": lambda: c.sample_profiles(limit=2),
        "get_profile_job": lambda: c.get_profile_job("job-1"),
        "get_profile_settings": lambda: c.get_profile_settings(),
        "update_profile_settings": lambda: c.update_profile_settings(enabled=True),
        "get_project": lambda: c.get_project(),
        "update_project": lambda: c.update_project(custom_instructions="be terse"),
        "get_webhooks": lambda: c.get_webhooks("inferscale"),
        "create_webhook": lambda: c.create_webhook("https://hook.example", "h", "inferscale", ["memory_add"]),
        "update_webhook": lambda: c.update_webhook(1, name="h2"),
        "delete_webhook": lambda: c.delete_webhook(1),
        "project.get": lambda: c.project.get(),
        "project.create": lambda: c.project.create("p2"),
        "project.update": lambda: c.project.update(decay=True),
        "project.delete": lambda: c.project.delete(),
        "project.get_members": lambda: c.project.get_members(),
        "project.add_member": lambda: c.project.add_member("a@b.example"),
        "project.update_member": lambda: c.project.update_member("a@b.example", "OWNER"),
        "project.remove_member": lambda: c.project.remove_member("a@b.example"),
    }
    assert set(calls) == {name for name, (_, status) in doc_table().items() if status == "501"}
    for name, call in calls.items():
        with pytest.raises(mem0.exceptions.MemoryError) as e:
            call()
        assert type(e.value) is mem0.exceptions.MemoryError and e.value.error_code == "HTTP_501", name
        assert e.value.details["code"] == "unimplemented" and name in e.value.details["call"].split(", "), name
        assert "is not supported by InferScale" in e.value.message, name
    token = {"authorization": f"Token {c.api_key}"}
    for method, path in (("GET", "/v3/memories/"), ("POST", "/v1/memories/abc/"), ("GET", "/v2/anything/"),
                         ("GET", "/v1/memories/abc/versions/")):
        r = httpx.request(method, server.url + path, headers=token)
        assert r.status_code == 501 and "no such route" in r.json()["detail"], (method, path, r.text)
    assert httpx.get(f"{server.url}/v1/embeddings", headers=token).status_code == 404  # OpenAI's namespace
    with pytest.raises(MemoryNotFoundError):  # a served route's not-found stays 404
        c.get("no-such-memory")
    with pytest.raises(NotImplementedError):  # chat() never reaches a server
        c.chat()


def test_the_async_client_uses_the_same_routes(server, jwt_secret):
    user = _user()

    async def run():
        async with AsyncMemoryClient(api_key=token_for(jwt_secret[1], user), host=server.url) as c:
            (mid,) = [e["id"] for e in (await c.add("I like tea.", infer=False))["results"]]
            assert (await c.get(mid))["memory"] == "I like tea."
            assert (await c.batch_update([{"memory_id": mid, "text": "I like coffee."}]))["updated"] == 1
            assert [e["name"] for e in (await c.users())["results"]] == [user]
            with pytest.raises(mem0.exceptions.MemoryError) as e:
                await c.get_summary()
            assert e.value.error_code == "HTTP_501" and e.value.details["call"] == "get_summary"
            await c.reset()
            assert (await c.get_all())["count"] == 0
    asyncio.run(run())


VERBS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_CALL = re.compile(r"self\.(?:client|async_client|_client)\.(get|post|put|patch|delete)\(\s*(f?\"[^\"]*\"|\w+)")
_REQUEST = re.compile(r"self\.(?:client|async_client|_client)\.request\(\s*\"(\w+)\",\s*(f?\"[^\"]*\")")


def _client_routes(cls) -> dict[str, frozenset[tuple[str, str]]]:
    """Public method -> the (method, path) requests its source sends (following its calls of its own class's
    methods: reset() -> delete_users() -> users()), placeholders as {}."""
    module = inspect.getmodule(cls)

    def path_of(arg: str, src: str) -> str:
        if not arg.startswith(("f\"", "\"")):
            if arg.isupper():
                return norm_route(getattr(module, arg))
            arg = re.search(rf"{arg} = (f?\"[^\"]*\")", src).group(1)  # a local, as get_profile_job's
        text = re.sub(r"\{([A-Z_]+)\}", lambda m: getattr(module, m.group(1)), arg.lstrip("f").strip("\""))
        return norm_route(text)

    direct, uses = {}, {}
    methods = dict(inspect.getmembers(cls, inspect.isfunction))
    for name, fn in methods.items():
        src = inspect.getsource(fn)
        direct[name] = {(v.upper(), path_of(a, src)) for v, a in _CALL.findall(src)} | {
            (v, path_of(a, src)) for v, a in _REQUEST.findall(src)}
        uses[name] = set(re.findall(r"self\.(\w+)\(", src)) & set(methods) - {name}

    def closure(name, seen):
        out = set(direct[name])
        for other in uses[name] - seen:
            out |= closure(other, seen | {name})
        return out
    return {name: frozenset(closure(name, {name})) for name in methods if not name.startswith("_")}


def test_the_compatibility_table_covers_every_call_of_the_installed_client():
    """docs/mem0.md's table names every public call of the installed MemoryClient (and its `project`) with the
    routes its source sends; each route is served here or is one of the 501s (mem0_http.UNSUPPORTED); the table's
    verdict matches; AsyncMemoryClient sends the same routes. Fails when the client gains a call or a route."""
    from mem0.client.project import AsyncProject, Project

    app = build_http_app(lambda: None)
    served = {(m, norm_route(r.path)) for r in app.routes if "mem0" in getattr(r, "tags", []) for m in r.methods}
    unsupported = {(m, norm_route(p)) for m, p, _, _ in mem0_http.UNSUPPORTED}
    assert not served & unsupported
    calls = _client_routes(MemoryClient) | {f"project.{k}": v for k, v in _client_routes(Project).items()}
    assert _client_routes(AsyncMemoryClient) == _client_routes(MemoryClient)
    assert _client_routes(AsyncProject) == _client_routes(Project)
    table = doc_table()
    assert sorted(set(calls) - set(table)) == [], "client calls missing from docs/mem0.md's table"
    assert sorted(set(table) - set(calls)) == [], "docs/mem0.md names calls the installed client does not have"
    for name, routes in calls.items():
        documented, status = table[name]
        assert documented == routes, (name, sorted(documented), sorted(routes))
        want = ("client-side" if not routes else "501" if routes <= unsupported
                else "supported" if routes <= served else f"unrouted {sorted(routes - served - unsupported)}")
        assert status == want, (name, status, want)
        for method, path in routes:  # each 501 route names this call
            if (method, path) in unsupported:
                concrete = path.replace("{}", "x1")
                call, message = mem0_http.unsupported(method, concrete)
                assert name in call.split(", ") and "not supported by InferScale" in message, (name, call)
    for method, path, _, _ in mem0_http.UNSUPPORTED:  # all under the prefixes the 404 handler turns into 501
        assert method in VERBS and mem0_http.is_mem0_path(path), path
    # What the page says of the client is the installed one: its version and how many calls it has.
    doc = (REPO / "docs" / "mem0.md").read_text()
    installed = importlib.metadata.version("mem0ai")
    said = re.search(r"mem0ai (\d[\w.]*): (\d+) on `MemoryClient`,\s+(\d+) on its `project`", doc)
    assert said, "docs/mem0.md no longer says which client version and how many calls the table covers"
    assert said.groups() == (installed, str(len(_client_routes(MemoryClient))), str(len(_client_routes(Project))))
    assert set(re.findall(r"(?:mem0ai|tested with) (\d+\.\d+\.\d+)", doc)) == {installed}, \
        "docs/mem0.md names a client version other than the installed one"
    pinned = re.search(r'"mem0ai([^"]*)"', (REPO / "pyproject.toml").read_text()).group(1)
    stated = re.search(r"mem0ai ([<>=~!][^(]*)\(pyproject\.toml\)", doc)
    assert stated and re.sub(r"\s", "", stated.group(1)) == pinned, (pinned, stated and stated.group(1))


# --------------------------------------------------------------------------- without authentication (demos)
@pytest.mark.parametrize("backend", ["redis", "embedded"])
def test_without_authentication_the_memory_id_is_enough(backend, registry):
    """--insecure-no-auth (Authenticator.insecure(): every caller may act for every user): the client sends no
    user_id with get / update / delete / history / feedback / batches, so the memory's owner is looked up by its
    id (Registry.owners_of; in Redis an index written with the fact, read in every bucket). Redis' fact ids are per
    user: an id two users' memories have needs the user_id query parameter, which always narrows to that user."""
    from inferscale_server.auth import Authenticator
    from inferscale_server.gateway import GatewayCore

    # the registry as a gateway without authentication opens it (serve_ingress: index_owners)
    reg = RedisRegistry(registry.url, prefix=registry.prefix, index_owners=True) if backend == "redis" else (
        EmbeddedRegistry())
    core = GatewayCore(reg, backends=None, limits=LIMITS, auth=Authenticator.insecure())
    srv = HttpThread(build_http_app(lambda: core))
    ann, bo, cy = _user(), _user(), _user()
    try:
        c = MemoryClient(api_key="no-auth-demo", host=srv.url)
        (a,) = _ids(c.add("Ann likes tea.", infer=False, user_id=ann))
        (b,) = _ids(c.add("Bo likes jazz.", infer=False, user_id=bo))
        assert c.get(a)["user_id"] == ann and c.get(b)["user_id"] == bo
        assert c.update(a, text="Ann likes green tea.")["version"] == 2
        assert [h["event"] for h in c.history(a)] == ["ADD", "UPDATE"]
        assert c.update(a, expiration_date="2999-12-31")["expiration_date"] == "2999-12-31"
        assert c.feedback(b, "POSITIVE")["memory_id"] == b
        assert c.batch_update([{"memory_id": a, "metadata": {"k": 1}}, {"memory_id": b, "text": "Bo likes blues."}])[
            "updated"] == 2
        assert c.get(b)["memory"] == "Bo likes blues." and c.get(a)["metadata"] == {"k": 1}
        assert c.delete(a) == {"message": "Memory deleted successfully!"}
        for call in (lambda: c.get(a), lambda: c.history(a), lambda: c.update(a, text="x"), lambda: c.delete(a),
                     lambda: c.get("never-written")):
            with pytest.raises(MemoryNotFoundError):
                call()
        assert reg.owners_of(a) == [] and reg.owners_of(b) == [bo]  # the index went with the memory
        assert [r["status"] for r in c.batch_delete([{"memory_id": a}, {"memory_id": b}])["results"]] == [
            "not_found", "deleted"]
        with pytest.raises(ValidationError) as e:  # whose memory: a list or a delete_all names the user
            c.get_all()
        assert "user_id is required" in e.value.message
        c.add("Cy likes rain.", infer=False, user_id=cy)
        with pytest.raises(ValidationError):
            c.delete_all()
        assert c.delete_all(user_id=cy)["deleted"] == 1
        for call in (c.users, c.reset):  # every user: not listed, not wiped
            with pytest.raises(mem0.exceptions.MemoryError) as e:
                call()
            assert e.value.error_code == "HTTP_501"
        if backend == "redis":  # one id, two users' memories (ids chosen by their writers, on gRPC say)
            reg.create(ann, [NewFact("Ann's note", fact_id="note-1")])
            reg.create(bo, [NewFact("Bo's note", fact_id="note-1")])
            with pytest.raises(ValidationError) as e:
                c.get("note-1")
            assert "names a memory of 2 users here" in e.value.message and "user_id" in e.value.message
            r = httpx.get(f"{srv.url}/v1/memories/note-1/", params={"user_id": bo})
            assert r.status_code == 200 and r.json()["memory"] == "Bo's note"
            assert reg.delete_user(bo) == 1 and c.get("note-1")["memory"] == "Ann's note"
            reg.delete_user(ann)
            assert reg.owners_of("note-1") == []  # DeleteUser takes the index entries too
    finally:
        srv.stop()


def test_cors_preflights_allow_the_methods_of_the_api(core):
    """A browser page of a configured origin may PUT (update, batch_update) and DELETE (delete, delete_all,
    batch_delete, delete_users): the preflight names them; another origin is refused."""
    from fastapi.testclient import TestClient

    from inferscale_server.gateway.http_front import HttpConfig

    origin = "https://app.example"
    http = TestClient(build_http_app(lambda: core, config_getter=lambda: HttpConfig(cors_allow_origins=(origin,))))
    for method, path in (("PUT", "/v1/memories/abc/"), ("DELETE", "/v1/memories/"), ("DELETE", "/v1/batch/"),
                         ("POST", "/v3/memories/add/"), ("GET", "/v1/memories/abc/")):
        r = http.options(path, headers={"Origin": origin, "Access-Control-Request-Method": method,
                                        "Access-Control-Request-Headers": "authorization, content-type"})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == origin, (method, r.text)
        assert method in [m.strip() for m in r.headers["access-control-allow-methods"].split(",")]
    r = http.options("/v1/memories/abc/", headers={"Origin": "https://evil.example",
                                                   "Access-Control-Request-Method": "DELETE"})
    assert r.status_code == 403
    r = http.delete("/v1/memories/abc/", headers={"Origin": origin})  # the answer names the origin too
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin


def test_every_answer_carries_a_request_id_the_callers_when_sane(core):
    """X-Request-Id on every answer, refusals and preflights included: the caller's when it is short printable
    ASCII, else a new one; the CORS headers only for an allowed origin (the middleware is plain ASGI: no
    per-request task group around streamed answers)."""
    from fastapi.testclient import TestClient

    from inferscale_server.gateway.http_front import HttpConfig, RequestIdAndCors

    origin = "https://app.example"
    app = build_http_app(lambda: core, config_getter=lambda: HttpConfig(cors_allow_origins=(origin,)))
    assert [m.cls for m in app.user_middleware] == [RequestIdAndCors]
    http = TestClient(app)
    r = http.get("/v1/memories/abc/", headers={"X-Request-Id": "trace-1"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "trace-1"
    assert "access-control-allow-origin" not in r.headers
    for insane in ("x" * 129, "tab\there"):
        r = http.get("/v1/memories/abc/", headers={"X-Request-Id": insane})
        assert len(r.headers["x-request-id"]) == 32 and r.headers["x-request-id"] != insane
    r = http.options("/v1/memories/", headers={"Origin": "https://evil.example", "X-Request-Id": "trace-2",
                                                 "Access-Control-Request-Method": "DELETE"})
    assert r.status_code == 403 and r.headers["x-request-id"] == "trace-2"
    assert "access-control-allow-origin" not in r.headers
    r = http.get("/v1/memories/abc/", headers={"Origin": origin})
    assert r.headers["access-control-allow-origin"] == origin and r.headers["vary"] == "Origin"
    assert r.headers["access-control-expose-headers"] == "X-Request-Id"


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


def test_grpc_listing_under_the_costliest_filter_leaves_the_loop_free(core, registry):
    """A gRPC ListMemories page of 600 facts under the filter that costs the most per fact (127 `icontains` over a
    255-string metadata list: ~2 ms a fact) is matched in a worker thread: the gateway's event loop, which serves
    every other caller's requests, keeps ticking while it runs. Before, the page was matched on the loop (a 1,000-fact
    page stalled it ~2 s)."""
    from inferscale_server.auth import USER_SCOPES, Principal

    user, facts = _user(), 600
    for start in range(0, facts, 100):
        registry.create(user, [NewFact(f"scanned fact {i}", {"tags": [""] * 255})
                               for i in range(start, start + 100)])
    costliest = json.dumps({"OR": [{"tags": {"icontains": f"zz{i}"}} for i in range(127)]})
    me = Principal(user, frozenset(USER_SCOPES))

    async def run() -> tuple[float, float, int]:
        gaps, last, done = [], time.perf_counter(), False

        async def tick():
            nonlocal last
            while not done:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
        ticker = asyncio.create_task(tick())
        t0 = time.perf_counter()
        page = await core.ListMemories(pb2.ListMemoriesRequest(user_id=user, filters=costliest, page_size=facts), me)
        took = time.perf_counter() - t0
        done = True
        await ticker
        return took, max(gaps), len(page.facts)
    took, worst_gap, listed = asyncio.run(run())
    assert listed == 0  # no tag contains "zz...": every fact was read and matched, none kept
    assert took > 0.3, f"the listing took {took:.2f} s: too cheap to show where it ran"
    assert worst_gap < took / 3, f"the loop stalled {worst_gap:.2f} s of the listing's {took:.2f} s"


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
    from support.grpc_thread import ServerThread

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
        from inferscale_core.embedder import Embedder

        self.registry, self.answer, self.prompts, self.chat_users = EmbeddedRegistry(), answer, [], []
        self.embedder, self.embedded = Embedder(), []  # the service's model, as the retrieval replicas embed

    def add(self, user_id, facts):
        return self.registry.create(user_id, facts)

    def search(self, user_id, vector, k):
        return []

    def embed(self, texts, as_query):
        self.embedded.append((list(texts), as_query))
        return self.embedder.embed(list(texts)).tolist()

    def get(self, user_id, fact_id):
        return self.registry.get(user_id, fact_id)

    def list(self, user_id):
        return self.registry.list(user_id)[0]

    def update(self, user_id, fact_id, text, vector, metadata):
        return self.registry.update(user_id, fact_id, text=text)

    def delete(self, user_id, fact_id):
        self.registry.delete(user_id, fact_id)

    def chat(self, user_id, messages, max_tokens, temperature, structured):
        self.prompts.append(json.dumps(messages))
        self.chat_users.append(user_id)
        return self.answer

    def chat_room(self, user_id, messages):
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
    assert set(sink.chat_users) == {"ann"}  # generated for the user of the extraction (its cache salt)
    # mem0 embedded through the sink (the service's embedder): the messages as a search, the memories as facts
    assert {as_query for _, as_query in sink.embedded} == {True, False}, sink.embedded
    assert (["Lives in Oslo"], False) in sink.embedded, sink.embedded
