"""Idempotent adds through the gateway: an add's idempotency key (AddFacts' field, Mem0's Idempotency-Key header,
sent by inferscale_client on its own) makes a repeated add answer with the facts the first one stored.

The registry's side (key -> fact ids kept atomically with the facts, per user, with a TTL, in the byte quota) is
tests/unit/test_registry.py's contract tests on every backend; here the gateway runs in registry-only mode on a real
redis-server, with the registry's or the replicas' failure injected where a test needs one."""
from __future__ import annotations

import asyncio
import uuid

import grpc
import httpx
import pytest
from support.grpc_thread import ServerThread

from inferscale_server.api import pb2
from inferscale_server.auth import Authenticator
from inferscale_server.errors import ApiError, unavailable
from inferscale_server.gateway import GatewayCore, build_http_app
from inferscale_server.registry import IdempotentRepeatError, RedisRegistry, UnconfirmedWriteError


class _LostConfirmation(RedisRegistry):
    """Fault injection: the first write is applied on the master but not confirmed (what WAIT timing out, or a
    master failing after it applied the write, answers): UnconfirmedWriteError, UNAVAILABLE WRITE_UNCONFIRMED at
    the API, with the 1 s retry hint the client's retry policy follows."""

    unconfirmed = 1

    def _confirm(self, node, conn):
        if self.unconfirmed:
            self.unconfirmed -= 1
            raise UnconfirmedWriteError("the write was applied, its confirmation lost (injected)")
        super()._confirm(node, conn)


class _PushFailsOnce:
    """Fault injection: the replicas' push after the registry write fails the first time (a replica died
    mid-write), so the gateway undoes the add; check_facts says what registry-only mode says (nothing to encode:
    0 KV bytes) and counts its calls, as index_facts does: a repeated add must call neither."""

    def __init__(self):
        self.checks = self.pushes = 0
        self.forgotten: list = []

    async def check_facts(self, texts):
        self.checks += 1
        return [0] * len(texts)

    async def index_facts(self, user_id, records):
        self.pushes += 1
        if self.pushes == 1:
            raise ConnectionError("engine replica went away")

    async def forget(self, user_id, facts):
        self.forgotten += facts


def _prefix() -> str:
    return f"idem{uuid.uuid4().hex[:8]}:"


def _add(core: GatewayCore, user: str, texts: list[str], key: str, **meta) -> list[str]:
    caller = asyncio.run(core.authenticate("AddFacts", None))
    req = pb2.AddFactsRequest(user_id=user, idempotency_key=key,
                              facts=[pb2.FactInput(text=t, metadata=meta) for t in texts])
    return [f.fact_id for f in asyncio.run(core.AddFacts(req.SerializeToString(), caller)).facts]


def test_the_clients_retry_after_an_unconfirmed_add_stores_the_facts_once(redis_url):
    """The retry the client's channel makes after WRITE_UNCONFIRMED repeats the request, key included: the answer
    is the facts the first try stored, not a second copy (without the key: 4 facts)."""
    from inferscale_client import MemoryClient

    reg = _LostConfirmation(redis_url, prefix=_prefix())
    srv = ServerThread(GatewayCore(reg, auth=Authenticator.insecure()))
    client = MemoryClient(target=f"127.0.0.1:{srv.port}", token="")  # its own channel, with its retry policy
    try:
        facts = client.add_facts("ada", ["Ada keeps bees.", "Ada lives in Turin."])
        assert reg.unconfirmed == 0  # the first try was applied and answered UNAVAILABLE WRITE_UNCONFIRMED
        stored = reg.list("ada")[0]
        assert [f.fact_id for f in facts] == [r.fact_id for r in stored] and len(stored) == 2
        assert [f.text for f in facts] == ["Ada keeps bees.", "Ada lives in Turin."]
    finally:
        client.close()
        srv.stop()
        reg.close()


def test_a_repeated_add_answers_with_the_first_adds_facts_and_writes_nothing(redis_url):
    reg = RedisRegistry(redis_url, prefix=_prefix())
    backends = _PushFailsOnce()
    backends.pushes = 1  # no failure in this test
    core = GatewayCore(reg, backends=backends, auth=Authenticator.insecure())
    ids = _add(core, "bo", ["Bo plays chess.", "Bo has a cat."], "add-1", src="chat")
    state = (reg.count("bo"), reg.user_version("bo"), reg.user_bytes("bo"), backends.checks, backends.pushes)
    assert _add(core, "bo", ["Bo plays chess.", "Bo has a cat."], "add-1", src="chat") == ids
    assert (reg.count("bo"), reg.user_version("bo"), reg.user_bytes("bo"), backends.checks,
            backends.pushes) == state  # nothing stored, checked or encoded again
    with pytest.raises(ApiError) as e:  # the key of another add
        _add(core, "bo", ["Bo plays go."], "add-1")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.reason == "IDEMPOTENCY_KEY_REUSED"
    assert e.value.field == "idempotency_key" and "one key names one add" in e.value.message
    with pytest.raises(ApiError) as e:  # the same facts, other metadata: another add too
        _add(core, "bo", ["Bo plays chess.", "Bo has a cat."], "add-1", src="mail")
    assert e.value.reason == "IDEMPOTENCY_KEY_REUSED"
    assert _add(core, "other", ["Bo plays chess.", "Bo has a cat."], "add-1", src="chat") != ids  # per user
    reg.delete("bo", ids[1])
    with pytest.raises(ApiError) as e:  # applied, then partly deleted: said, not stored again
        _add(core, "bo", ["Bo plays chess.", "Bo has a cat."], "add-1", src="chat")
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS and e.value.reason == "IDEMPOTENT_ADD_DELETED"
    assert ids[1] in e.value.message and reg.count("bo") == 1
    for bad in ("has space", "k" * 129):
        with pytest.raises(ApiError) as e:
            _add(core, "bo", ["Bo reads."], bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.field == "idempotency_key"
    assert reg.count("bo") == 1
    reg.close()


def test_an_undone_add_releases_its_key_so_the_retry_stores_the_facts(redis_url):
    """The push after the registry write fails: the add is undone and says nothing was stored, so a retry under
    the same key must store the facts (not answer with the removed ones); a repeat after that answers with them."""
    reg = RedisRegistry(redis_url, prefix=_prefix())
    backends = _PushFailsOnce()
    core = GatewayCore(reg, backends=backends, auth=Authenticator.insecure())
    with pytest.raises(ApiError) as e:
        _add(core, "cy", ["Cy sails."], "add-1")
    assert "nothing was stored" in e.value.message and reg.count("cy") == 0 and len(backends.forgotten) == 1
    assert reg.idempotent_add("cy", "add-1") is None and reg.user_bytes("cy") == 0
    ids = _add(core, "cy", ["Cy sails."], "add-1")
    assert [r.fact_id for r in reg.list("cy")[0]] == ids and backends.pushes == 2
    assert _add(core, "cy", ["Cy sails."], "add-1") == ids and backends.pushes == 2
    reg.close()


def test_mem0_add_takes_the_idempotency_key_header(redis_url):
    """Mem0's add over HTTP with Idempotency-Key (infer=false): a repeat answers with the first add's memories;
    with infer=true the key is refused, naming why (an extraction is no one write to repeat)."""
    reg = RedisRegistry(redis_url, prefix=_prefix())
    core = GatewayCore(reg, auth=Authenticator.insecure())
    app = build_http_app(lambda: core)
    body = {"user_id": "di", "infer": False, "messages": [{"role": "user", "content": "Di runs marathons."}]}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            first = await c.post("/v3/memories/add/", json=body, headers={"Idempotency-Key": "mem0-add-1"})
            again = await c.post("/v3/memories/add/", json=body, headers={"Idempotency-Key": "mem0-add-1"})
            other = await c.post("/v3/memories/add/", json={**body, "messages": [{"role": "user", "content": "x"}]},
                                 headers={"Idempotency-Key": "mem0-add-1"})
            infer = await c.post("/v3/memories/add/", json={**body, "infer": True},
                                 headers={"Idempotency-Key": "mem0-add-2"})
            return first, again, other, infer

    first, again, other, infer = asyncio.run(run())
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    assert [r.fact_id for r in reg.list("di")[0]] == [e["id"] for e in first.json()["results"]]
    assert other.status_code == 400 and "one key names one add" in str(other.json())
    assert infer.status_code == 400 and "infer=false" in str(infer.json())
    assert reg.count("di") == 1
    reg.close()


class _PushFailsAfterTheRepeat:
    """Fault injection for the race of a repeat with an add that is then undone: the first add's push waits until
    the test lets it go on (while it waits, its facts and key are stored), then fails, so the add is undone."""

    def __init__(self):
        self.pushing, self.go_on = asyncio.Event(), asyncio.Event()
        self.pushes = 0

    async def check_facts(self, texts):
        return [0] * len(texts)

    async def index_facts(self, user_id, records):
        self.pushes += 1
        if self.pushes == 1:
            self.pushing.set()
            await self.go_on.wait()
            raise unavailable("an engine replica went away; retry shortly")

    async def forget(self, user_id, facts):
        pass


def test_a_repeat_during_an_add_that_is_then_undone_answers_only_facts_that_stay(redis_url):
    """A repeat of an add (the same key, the same facts: a client's retry) that arrives while the first add is
    still pushing answers with the first add's facts; if that push then fails, the undo must not remove the facts
    the repeat answered with: they stay stored under the key, and the first add's error says so (a retry under
    the key answers with them again)."""
    reg = RedisRegistry(redis_url, prefix=_prefix())
    backends = _PushFailsAfterTheRepeat()
    core = GatewayCore(reg, backends=backends, auth=Authenticator.insecure())
    texts = ["Eve keeps a boat in Split.", "Eve teaches maths."]

    async def add() -> list[str]:
        caller = await core.authenticate("AddFacts", None)
        req = pb2.AddFactsRequest(user_id="eve", idempotency_key="add-1", facts=[pb2.FactInput(text=t) for t in texts])
        return [f.fact_id for f in (await core.AddFacts(req.SerializeToString(), caller)).facts]

    async def race():
        first = asyncio.ensure_future(add())
        await backends.pushing.wait()  # the first add's facts and key are stored, its push in flight
        repeated = await add()
        backends.go_on.set()  # now the first add's push fails
        with pytest.raises(ApiError) as e:
            await first
        return repeated, e.value

    repeated, err = asyncio.run(race())
    assert len(repeated) == 2 and backends.pushes == 1  # the repeat answered, nothing encoded twice
    assert [r.fact_id for r in reg.list("eve")[0]] == repeated  # what the repeat answered is stored
    assert err.code == grpc.StatusCode.UNAVAILABLE and "nothing was stored" not in err.message
    assert "idempotency_key" in err.message and "kept" in err.message
    assert asyncio.run(add()) == repeated and backends.pushes == 1  # a later retry: the same facts
    reg.close()


class _UndoneInBetween(RedisRegistry):
    """Fault injection, the other interleaving: another add under the same key is stored after this add looked the
    key up (the lookup finds nothing), and undone (its key released) after this add's create met the key. Armed by
    the test once the other add is stored."""

    armed = False

    create_met = None

    def idempotent_add(self, user_id, key, now=None, answering=None):
        if self.armed:
            return None  # looked up before the other add was stored
        return super().idempotent_add(user_id, key, now, answering)

    def create(self, user_id, facts, quota=None, idempotent=None):
        if not self.armed:
            return super().create(user_id, facts, quota, idempotent)
        self.armed = False
        try:
            return super().create(user_id, facts, quota, idempotent)
        except IdempotentRepeatError as e:
            self.create_met = e.earlier
            assert self.release_idempotency_key(user_id, e.earlier.key)  # the other add's undo: its key, its facts
            for fact_id in e.earlier.fact_ids:
                self.delete(user_id, fact_id)
            raise


def test_a_concurrent_add_under_the_key_undone_in_between_is_said_and_the_retry_stores(redis_url):
    """This add's create meets the key of another try of the same add, which is undone before this one can answer
    with its facts: UNAVAILABLE, retry hint, nothing stored (not IDEMPOTENT_ADD_DELETED: the add never stood); the
    retry stores the facts."""
    reg = _UndoneInBetween(redis_url, prefix=_prefix())
    core = GatewayCore(reg, auth=Authenticator.insecure())
    other = _add(core, "fy", ["Fy flies kites."], "add-1")  # the other try, stored
    reg.armed = True
    with pytest.raises(ApiError) as e:
        _add(core, "fy", ["Fy flies kites."], "add-1")
    assert reg.create_met.fact_ids == tuple(other) and e.value.code == grpc.StatusCode.UNAVAILABLE
    assert e.value.retry_after_s and "nothing was stored" in e.value.message and reg.count("fy") == 0
    ids = _add(core, "fy", ["Fy flies kites."], "add-1")
    assert reg.idempotent_add("fy", "add-1").fact_ids == tuple(ids) and reg.count("fy") == 1
    reg.close()
