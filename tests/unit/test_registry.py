"""The fact registry against a real redis-server, and the embedded and Ray-actor fallbacks through the same
tests."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from inferscale_core.errors import InvalidIdError, UnknownFactError
from inferscale_server.registry import (
    FACT_STORED_BYTES,
    ActorRegistry,
    DuplicateFactError,
    EmbeddedRegistry,
    NewFact,
    RedisRegistry,
    VersionConflictError,
    open_registry,
)


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


# Each Redis the registry runs on, by the fixture that starts it: plain, and over TLS only (rediss:// with the private
# CA's certificate in ?ssl_ca_certs=), a single redis-server and a cluster (over TLS: with replicas, which every write
# waits for, so replication over TLS is what confirms it).
REDIS_FIXTURES = {"redis": "redis_url", "cluster": "redis_cluster_url", "redis-tls": "redis_tls_url",
                  "cluster-tls": "redis_tls_cluster_url"}
TLS = ("redis-tls", "cluster-tls")
# The tests that also run over TLS: a write, a read, a list, an update, deletes with their tombstones, the quotas
# (also under concurrent writers), an idempotent add and a restart. TLS changes the connection, not the commands,
# so the rest of the contract runs on the plain servers only (each TLS run costs a unit-tier second or more).
TLS_CONTRACT = {"test_create_get_list_count", "test_update_versions_and_metadata_merge", "test_delete_and_delete_user",
                "test_quotas_on_facts_and_bytes", "test_tombstones_are_written_with_every_delete_and_update",
                "test_an_idempotency_key_stores_an_add_once", "test_restart_sees_the_data",
                "test_quota_holds_under_concurrent_writers", "test_tombstones_from_another_writer_reach_a_polling_reader"}


def pytest_generate_tests(metafunc):
    """`reg` on every backend and `any_redis_url` on every plain Redis; both over TLS too for TLS_CONTRACT."""
    tls = list(TLS) if metafunc.function.__name__ in TLS_CONTRACT else []
    if "reg" in metafunc.fixturenames:
        metafunc.parametrize("reg", ["redis", "cluster", *tls, "embedded", "actor"], indirect=True)
    if "any_redis_url" in metafunc.fixturenames:
        metafunc.parametrize("any_redis_url", ["redis", "cluster", *tls], indirect=True)


@pytest.fixture
def reg(request):
    if request.param in REDIS_FIXTURES:
        # A fresh key prefix per test: tests share one server (or cluster) but never see each other's keys.
        url = request.getfixturevalue(REDIS_FIXTURES[request.param])
        r = RedisRegistry(url, prefix=f"t{uuid.uuid4().hex[:8]}:")
    elif request.param == "embedded":
        r = EmbeddedRegistry()
    else:
        ray = request.getfixturevalue("local_ray")
        r = ActorRegistry(f"reg-{uuid.uuid4().hex[:8]}")  # a fresh actor per test
    yield r
    if request.param.startswith("cluster"):
        assert r.cluster is True  # it did run on the cluster
    r.close()
    if request.param == "actor":
        ray.kill(r.actor)


@pytest.fixture
def any_redis_url(request):
    """A single redis-server's URL, then a Redis Cluster node's (over TLS too for TLS_CONTRACT): tests that need a
    URL rather than a registry."""
    return request.getfixturevalue(REDIS_FIXTURES[request.param])


def test_create_get_list_count(reg):
    recs = reg.create("alice", [NewFact("likes tea", {"src": "chat"}), NewFact("lives in Oslo")])
    assert [r.text for r in recs] == ["likes tea", "lives in Oslo"]
    assert all(r.version == 1 and r.user_id == "alice" and len(r.fact_id) == 32 for r in recs)
    got = reg.get("alice", recs[0].fact_id)
    assert got.text == "likes tea" and got.metadata == {"src": "chat"} and got.embedding is None
    assert got.created_at == recs[0].created_at
    listed, nxt = reg.list("alice")
    assert [r.fact_id for r in listed] == [r.fact_id for r in recs] and nxt is None
    assert reg.count("alice") == 2 and reg.count("nobody") == 0
    assert reg.fact_versions("alice") == {r.fact_id: 1 for r in recs}
    (w,) = reg.create("alice", [NewFact("moved to Bergen", window=("user: I moved!", "assistant: where?"))])
    assert reg.get("alice", w.fact_id).window == ("user: I moved!", "assistant: where?")


def test_list_pages_in_creation_order(reg):
    ids = [r.fact_id for r in reg.create("u", [NewFact(f"fact {i}") for i in range(5)])]
    ids += [r.fact_id for r in reg.create("u", [NewFact("fact 5")])]
    page1, off = reg.list("u", 0, 4)
    page2, off2 = reg.list("u", off, 4)
    assert [r.fact_id for r in page1 + page2] == ids
    assert off == 4 and off2 is None
    with pytest.raises(ValueError):
        reg.list("u", -1, 2)


def test_list_after_is_a_cursor_that_deletes_do_not_shift(reg):
    """list_after pages by creation sequence: deleting facts already listed (or the cursor's own fact) skips no
    surviving fact, where an offset would; the other user's facts never show; the cursor is None at the end."""
    ids = [r.fact_id for r in reg.create("u", [NewFact(f"fact {i}") for i in range(7)])]
    reg.create("v", [NewFact("another user's fact")])
    page1, cur = reg.list_after("u", 0, 3)
    assert [r.fact_id for _, r in page1] == ids[:3] and cur == page1[-1][0]
    for _, r in page1:  # the whole first page, cursor's fact included, goes before the next page is read
        reg.delete("u", r.fact_id)
    reg.delete("u", ids[4])  # and one not listed yet
    page2, cur2 = reg.list_after("u", cur, 3)
    assert [r.fact_id for _, r in page2] == [ids[3], ids[5], ids[6]] and cur2 is None
    assert [s for s, _ in page2] == sorted(s for s, _ in page2) and page2[0][0] > cur
    assert reg.list_after("u", 0, 10) == (page2, None) and reg.list_after("nobody", 0, 5) == ([], None)
    with pytest.raises(ValueError):
        reg.list_after("u", -1, 2)


def test_seq_of_is_the_list_after_cursor_of_the_users_own_fact(reg):
    ids = [r.fact_id for r in reg.create("u", [NewFact(f"fact {i}") for i in range(4)])]
    (other,) = reg.create("v", [NewFact("another user's fact")])
    seqs = [reg.seq_of("u", f) for f in ids]
    assert seqs == sorted(seqs) and len(set(seqs)) == 4
    assert [r.fact_id for _, r in reg.list_after("u", seqs[1], 10)[0]] == ids[2:]
    assert reg.seq_of("u", other.fact_id) is None and reg.seq_of("u", "no-such-fact") is None
    reg.delete("u", ids[0])
    assert reg.seq_of("u", ids[0]) is None and reg.seq_of("u", ids[1]) == seqs[1]


def test_latest_is_the_users_most_recent_facts_oldest_first(reg):
    """What a new fact is encoded behind (inferscale_core/defaults.py): the user's last n facts, whatever call
    they came in, never another user's, and without the deleted ones."""
    ids = [r.fact_id for r in reg.create("u", [NewFact(f"fact {i}") for i in range(3)])]
    ids += [r.fact_id for r in reg.create("u", [NewFact("fact 3")])]
    reg.create("other", [NewFact("not yours")])
    assert [r.fact_id for r in reg.latest("u", 2)] == ids[2:]
    assert [r.fact_id for r in reg.latest("u", 10)] == ids and reg.latest("u", 0) == []
    reg.delete("u", ids[3])
    assert [r.text for r in reg.latest("u", 2)] == ["fact 1", "fact 2"]
    assert reg.latest("nobody", 5) == []


def test_update_can_change_the_window_alone(reg):
    """A re-windowed fact (a neighbour left the memory): new version, same text and embedding, new window."""
    (r,) = reg.create("u", [NewFact("likes tea", embedding=[1.0, 0.0], window=("- a\n", "- b\n"))])
    new = reg.update("u", r.fact_id, window=("- b\n",), expected_version=1)
    got = reg.get("u", r.fact_id)
    assert new.version == got.version == 2 and got.window == ("- b\n",) and got.text == "likes tea"
    assert got.embedding is not None and reg.user_bytes("u") == (len("likes tea") + 2 + len('["- b\\n"]')
                                                                 + FACT_STORED_BYTES)
    with pytest.raises(ValueError, match="window"):
        reg.update("u", r.fact_id, window=("ok", 3))


def test_embedding_round_trip_and_staleness(reg):
    (rec,) = reg.create("u", [NewFact("x", embedding=np.arange(4, dtype=np.float32))])
    assert np.array_equal(reg.get("u", rec.fact_id).embedding, np.arange(4, dtype=np.float32))
    # metadata-only update keeps the embedding; a new text drops it (it described the old text)
    r2 = reg.update("u", rec.fact_id, metadata={"a": 1})
    assert r2.version == 2 and r2.embedding is not None and r2.metadata == {"a": 1}
    r3 = reg.update("u", rec.fact_id, text="y")
    assert r3.version == 3 and r3.embedding is None and reg.get("u", rec.fact_id).embedding is None
    # an embedding computed for an old version is refused
    assert reg.set_embedding("u", rec.fact_id, 2, np.ones(4)) is False
    assert reg.set_embedding("u", rec.fact_id, 3, np.ones(4)) is True
    assert np.array_equal(reg.get("u", rec.fact_id).embedding, np.ones(4, dtype=np.float32))


def test_update_versions_and_metadata_merge(reg):
    (rec,) = reg.create("u", [NewFact("a", {"k1": "v1"})])
    r = reg.update("u", rec.fact_id, metadata={"k2": "v2"})
    assert r.metadata == {"k1": "v1", "k2": "v2"} and r.version == 2
    r = reg.update("u", rec.fact_id, metadata={"k3": "v3"}, replace_metadata=True)
    assert r.metadata == {"k3": "v3"} and r.version == 3
    assert r.updated_at >= r.created_at
    with pytest.raises(VersionConflictError, match="at version 3"):
        reg.update("u", rec.fact_id, text="b", expected_version=2)
    assert reg.update("u", rec.fact_id, text="b", expected_version=3).version == 4
    assert reg.get("u", rec.fact_id).text == "b"
    assert reg.fact_versions("u") == {rec.fact_id: 4}


def test_owner_isolation(reg):
    (mine,) = reg.create("alice", [NewFact("alice's secret")])
    # bob can neither read, list, update nor delete alice's fact; the error does not reveal it exists
    for call in (lambda: reg.get("bob", mine.fact_id), lambda: reg.update("bob", mine.fact_id, text="pwned"),
                 lambda: reg.delete("bob", mine.fact_id), lambda: reg.get_many("bob", [mine.fact_id])):
        with pytest.raises(UnknownFactError) as e:
            call()
        assert "alice" not in str(e.value) and "secret" not in str(e.value)
    assert reg.list("bob") == ([], None)
    assert reg.delete_user("bob") == 0
    assert reg.get("alice", mine.fact_id).text == "alice's secret"


def test_delete_and_delete_user(reg):
    a, b, c = reg.create("u", [NewFact("a"), NewFact("b"), NewFact("c")])
    (other,) = reg.create("v", [NewFact("other")])
    assert reg.delete("u", b.fact_id).text == "b"
    with pytest.raises(UnknownFactError):
        reg.get("u", b.fact_id)
    with pytest.raises(UnknownFactError):
        reg.delete("u", b.fact_id)
    assert [r.fact_id for r in reg.list("u")[0]] == [a.fact_id, c.fact_id]
    reg.add_placement("u", "replica-1")
    assert reg.delete_user("u") == 2
    assert reg.count("u") == 0 and reg.placement("u") == set()
    assert reg.get("v", other.fact_id).text == "other"


def test_user_version_moves_on_every_change(reg):
    assert reg.user_version("u") == 0
    (r,) = reg.create("u", [NewFact("a")])
    v1 = reg.user_version("u")
    reg.update("u", r.fact_id, text="b")
    v2 = reg.user_version("u")
    reg.delete("u", r.fact_id)
    v3 = reg.user_version("u")
    reg.delete_user("u")
    assert 0 < v1 < v2 < v3 < reg.user_version("u")
    assert reg.user_version("someone-else") == 0


def test_user_versions_reads_many_counters_at_once(reg):
    assert reg.user_versions([]) == []
    reg.create("u1", [NewFact("a")])
    (b,) = reg.create("u2", [NewFact("b")])
    reg.delete("u2", b.fact_id)
    assert reg.user_versions(["u1", "u2", "never"]) == [reg.user_version("u1"), reg.user_version("u2"), 0]
    assert reg.user_versions(["u2", "u1"])[0] > reg.user_versions(["u1"])[0]
    with pytest.raises(InvalidIdError):
        reg.user_versions(["u1", ""])


def test_find_many_leaves_out_what_the_user_does_not_own(reg):
    a, b = reg.create("u", [NewFact("a"), NewFact("b")])
    (other,) = reg.create("v", [NewFact("v's")])
    reg.delete("u", b.fact_id)
    got = reg.find_many("u", [b.fact_id, a.fact_id, other.fact_id, "never-existed"])
    assert list(got) == [a.fact_id] and got[a.fact_id].text == "a" and got[a.fact_id].version == 1
    assert reg.find_many("u", []) == {}
    with pytest.raises(InvalidIdError):
        reg.find_many("u", ["bad/id"])


def test_caller_chosen_ids_and_duplicates(reg):
    (r,) = reg.create("u", [NewFact("a", fact_id="f-1")])
    assert r.fact_id == "f-1"
    with pytest.raises(DuplicateFactError):
        reg.create("u", [NewFact("b", fact_id="f-1")])
    if isinstance(reg, RedisRegistry):  # a fact id is its user's own: another user's "f-1" is another fact
        (v,) = reg.create("v", [NewFact("b", fact_id="f-1")])
        assert reg.get("v", "f-1").text == "b" and reg.get("u", "f-1").text == "a"
        reg.delete("v", "f-1")
    else:  # the in-process registries keep one space of ids: refused, never overwritten
        with pytest.raises(DuplicateFactError):
            reg.create("v", [NewFact("b", fact_id="f-1")])
    with pytest.raises(DuplicateFactError):
        reg.create("u", [NewFact("c", fact_id="f-2"), NewFact("d", fact_id="f-2")])
    assert reg.get("u", "f-1").text == "a" and reg.count("u") == 1
    with pytest.raises(UnknownFactError):
        reg.get("v", "f-1")


def test_a_facts_creation_time_and_expiry_are_kept_and_changed_by_update(reg):
    """NewFact's created_at (an import's own time; updated_at the same) and expires_at (inf: never), kept by every
    backend; update sets or clears (inf) the expiry, a new version; expired_facts names those expired at a time."""
    inf = float("inf")
    a, b, c = reg.create("u", [NewFact("old", created_at=1_600_000_000, expires_at=2_000_000_000.5),
                               NewFact("now"), NewFact("brief", expires_at=1_000.0)])
    (other,) = reg.create("v", [NewFact("v's", expires_at=1_000.0)])
    got = reg.get("u", a.fact_id)
    assert (got.created_at, got.updated_at, got.expires_at) == (1_600_000_000.0, 1_600_000_000.0, 2_000_000_000.5)
    assert reg.get("u", b.fact_id).expires_at == inf and reg.get("u", b.fact_id).created_at > 1_700_000_000
    assert got.expired(2_000_000_000.5) and not got.expired(2_000_000_000.4)
    assert reg.expired_facts("u", 999.0) == [] and reg.expired_facts("u", 1_000.0) == [c.fact_id]
    assert sorted(reg.expired_facts("u", 3e9)) == sorted([a.fact_id, c.fact_id])
    cleared = reg.update("u", c.fact_id, expires_at=inf)
    assert cleared.expires_at == inf and cleared.version == 2 and reg.get("u", c.fact_id).expires_at == inf
    assert reg.history("u", c.fact_id) == []  # an expiry is no new text or metadata for the user
    assert reg.update("u", b.fact_id, expires_at=5_000.0).expires_at == 5_000.0
    assert reg.update("u", b.fact_id, text="now then").expires_at == 5_000.0  # kept when not named
    assert sorted(reg.expired_facts("u", 3e9)) == sorted([a.fact_id, b.fact_id])
    reg.delete("u", a.fact_id)
    assert reg.expired_facts("u", 3e9) == [b.fact_id] and reg.expired_facts("v", 3e9) == [other.fact_id]
    for bad in (float("nan"), "soon", True):
        with pytest.raises(ValueError, match="expires_at must be a Unix time"):
            reg.update("u", b.fact_id, expires_at=bad)
        with pytest.raises(ValueError, match="expires_at must be a Unix time"):
            reg.create("u", [NewFact("x", expires_at=bad)])
    with pytest.raises(ValueError, match="created_at must be a Unix time"):
        reg.create("u", [NewFact("x", created_at=inf)])
    reg.delete_user("u")
    assert reg.expired_facts("u", 3e9) == []


def test_owners_of_names_the_users_of_a_fact_id(reg):
    """The lookup a server without authentication makes for a memory id alone: written with the fact, gone with it
    (delete and DeleteUser). RedisRegistry writes it only when asked (a gateway without authentication opens its
    registry with index_owners): a server with authentication does not pay its bytes."""
    if isinstance(reg, RedisRegistry):
        (unindexed,) = reg.create("cy", [NewFact("not indexed")])
        assert reg.owners_of(unindexed.fact_id) == []
        reg.index_owners = True
    a, b = reg.create("ann", [NewFact("a"), NewFact("b")])
    assert reg.owners_of(a.fact_id) == ["ann"] and reg.owners_of("never-written") == []
    reg.create("bo", [NewFact("shared", fact_id="f-shared")])
    if isinstance(reg, RedisRegistry):  # a fact id is its user's own: two users may have one
        reg.create("ann", [NewFact("shared too", fact_id="f-shared")])
        assert reg.owners_of("f-shared") == ["ann", "bo"]
        reg.delete("ann", "f-shared")
    assert reg.owners_of("f-shared") == ["bo"]
    reg.delete("ann", a.fact_id)
    assert reg.owners_of(a.fact_id) == [] and reg.owners_of(b.fact_id) == ["ann"]
    reg.delete_user("ann")
    reg.delete_user("bo")
    assert reg.owners_of(b.fact_id) == [] and reg.owners_of("f-shared") == []
    with pytest.raises(InvalidIdError):
        reg.owners_of("bad/id")


def test_tombstones_missed_says_when_the_log_was_trimmed_past_a_cursor(reg, monkeypatch):
    """A replica away for more deletes than the log keeps must know it (it then reconciles what it holds): True
    for a cursor from before tombstones that were trimmed unread, False for one the log still covers."""
    from inferscale_server.registry import embedded, redis_backend

    if isinstance(reg, ActorRegistry):
        pytest.skip("the actor's registry runs in another process (the embedded one is tested here)")
    monkeypatch.setattr(redis_backend, "TOMBSTONES_PER_BUCKET", 5)  # trimmed in whole stream nodes (100 entries)
    monkeypatch.setattr(embedded, "TOMBSTONES_KEPT", 5)
    _, before = reg.tombstones_after(None)
    recs = reg.create("tess", [NewFact(f"note {i}") for i in range(3)])
    reg.delete("tess", recs[0].fact_id)
    assert not reg.tombstones_missed(before)  # a few tombstones, nothing trimmed
    recs = reg.create("tess", [NewFact(f"more {i}") for i in range(250)])
    for r in recs:  # one user: one bucket's stream, far past what it keeps
        reg.delete("tess", r.fact_id)
    assert reg.tombstones_missed(before)
    _, now = reg.tombstones_after(None)
    assert not reg.tombstones_missed(now)


def test_bad_input_is_rejected(reg):
    with pytest.raises(InvalidIdError):
        reg.create("", [NewFact("a")])
    with pytest.raises(InvalidIdError):
        reg.get("u", "../etc")
    with pytest.raises(ValueError, match="non-empty"):
        reg.create("u", [NewFact("   ")])
    with pytest.raises(ValueError, match="1-D"):
        reg.create("u", [NewFact("a", embedding=np.zeros((2, 2)))])
    with pytest.raises(TypeError):
        reg.create("u", [NewFact("a", {"k": object()})])
    assert reg.count("u") == 0


def test_placement_map(reg):
    reg.add_placement("u1", "engine-a")
    reg.add_placement("u1", "engine-b")
    reg.add_placement("u2", "engine-a")
    assert reg.placement("u1") == {"engine-a", "engine-b"}
    assert reg.placements() == {"u1": {"engine-a", "engine-b"}, "u2": {"engine-a"}}
    reg.remove_placement("u1", "engine-a")
    reg.remove_placement("u2", "engine-a")
    reg.remove_placement("u2", "engine-never")
    assert reg.placements() == {"u1": {"engine-b"}}


def test_restart_sees_the_data(any_redis_url):
    redis_url = any_redis_url
    prefix = f"restart{uuid.uuid4().hex[:8]}:"
    first = RedisRegistry(redis_url, prefix=prefix)
    (rec,) = first.create("u", [NewFact("survives", {"n": 1}, embedding=np.ones(3))])
    first.add_placement("u", "engine-0")
    ver = first.user_version("u")
    first.close()
    second = open_registry(redis_url, prefix=prefix)
    got = second.get("u", rec.fact_id)
    assert (got.text, got.metadata, got.version) == ("survives", {"n": 1}, 1)
    assert np.array_equal(got.embedding, np.ones(3, dtype=np.float32))
    assert second.placement("u") == {"engine-0"} and second.user_version("u") == ver
    second.close()


def test_open_registry_picks_backend(redis_url):
    assert isinstance(open_registry(None), EmbeddedRegistry)
    assert isinstance(open_registry(""), EmbeddedRegistry)
    assert isinstance(open_registry(redis_url), RedisRegistry)
    with pytest.raises(ValueError, match="not a redis"):
        open_registry("http://localhost:6379")


def test_actor_registry_is_shared_by_name(local_ray):
    """Two processes' handles on the same name reach one registry (what the replicas of an app without
    Redis rely on); the registry's own errors come back as themselves, not wrapped by Ray."""
    name = f"shared-{uuid.uuid4().hex[:8]}"
    first, second = open_registry(f"ray-actor://{name}"), open_registry(f"ray-actor://{name}")
    assert isinstance(first, ActorRegistry)
    (rec,) = first.create("u", [NewFact("seen by both")])

    @local_ray.remote(num_cpus=0)
    def read_elsewhere(fact_id):
        return open_registry(f"ray-actor://{name}").get("u", fact_id).text

    assert local_ray.get(read_elsewhere.remote(rec.fact_id)) == "seen by both"
    assert second.user_version("u") == 1
    with pytest.raises(UnknownFactError, match="unknown fact 'nope'"):
        second.get("u", "nope")
    local_ray.kill(first.actor)


def test_user_changes_is_one_read_when_nothing_moved_and_the_diff_otherwise(reg):
    """services/user_sync.py, the sync retrieval and the engine replica share."""
    from inferscale_server.user_sync import user_changes

    a, b = reg.create("u", [NewFact("one"), NewFact("two")])
    first = user_changes(reg, "u", None, {})
    assert sorted(r.fact_id for r in first.fresh) == sorted([a.fact_id, b.fact_id]) and first.gone == []
    held = {r.fact_id: r.version for r in first.fresh}
    assert user_changes(reg, "u", first.version, held) is None  # the counter did not move
    reg.update("u", a.fact_id, text="uno")
    reg.delete("u", b.fact_id)
    (c,) = reg.create("u", [NewFact("three")])
    later = user_changes(reg, "u", first.version, held)
    assert later.version > first.version and sorted(later.gone) == sorted([a.fact_id, b.fact_id])
    assert sorted((r.fact_id, r.version, r.text) for r in later.fresh) == sorted(
        [(a.fact_id, 2, "uno"), (c.fact_id, 1, "three")])


def test_retrieval_replica_resyncs_from_the_registry(redis_url):
    """A retrieval replica's index is a cache of the registry: writes made by someone else (another gateway,
    or a push that never arrived) are seen by its next search, embeddings are written back, and deletes and
    text updates drop or replace what it held."""
    from inferscale_core.embedder import default_embedder
    from inferscale_server.retrieval import RetrievalCore

    prefix = f"retr{uuid.uuid4().hex[:8]}:"
    writer, reader = RedisRegistry(redis_url, prefix=prefix), RedisRegistry(redis_url, prefix=prefix)
    core = RetrievalCore(reader, default_embedder())
    assert core.search("u", "anything", 3) == []
    tea, dog = writer.create("u", [NewFact("I like green tea"), NewFact("My dog is called Rex")])
    (other,) = writer.create("v", [NewFact("My dog is called Bolt")])
    hits = core.search("u", "what is my dog's name?", 1)
    assert hits[0][0] == dog.fact_id
    assert {f for f, _ in core.search("u", "dog", 10)} == {tea.fact_id, dog.fact_id}  # never v's fact
    assert writer.get("u", dog.fact_id).embedding is not None  # written back for the next replica
    writer.update("u", dog.fact_id, text="I have no pets")
    writer.delete("u", tea.fact_id)
    hits = core.search("u", "what is my dog's name?", 10)
    assert [f for f, _ in hits] == [dog.fact_id]
    assert core.index.size("u") == 1 and "v" not in core.index.users()  # v was never searched here
    writer.delete_user("u")
    assert core.search("u", "dog", 3) == []


def test_retrieval_never_picks_an_expired_fact(redis_url):
    """A search leaves out the facts expired at its own time: one that expires while indexed stops being picked
    with no registry change (no sync runs for it), and k unexpired facts are still returned when the user has
    them; clearing the expiry (an update) brings it back."""
    import time

    from inferscale_core.embedder import default_embedder
    from inferscale_server.retrieval import RetrievalCore

    reg = RedisRegistry(redis_url, prefix=f"exp{uuid.uuid4().hex[:8]}:")
    core = RetrievalCore(reg, default_embedder())
    dog, cat, tea = reg.create("u", [NewFact("My dog is called Rex"), NewFact("My cat is called Tom"),
                                     NewFact("I like green tea")])
    (old,) = reg.create("u", [NewFact("My old dog was called Bolt", expires_at=1_000.0)])
    assert [f for f, _ in core.search("u", "what is my dog's name?", 2)] == [dog.fact_id, cat.fact_id]
    # The expiry set once the facts are embedded (slow on a loaded machine): the next sync reuses the embedding.
    dog = reg.update("u", dog.fact_id, expires_at=time.time() + 3)
    assert [f for f, _ in core.search("u", "what is my dog's name?", 2)] == [dog.fact_id, cat.fact_id]
    version = core.book.synced["u"]
    time.sleep(max(0.0, dog.expires_at - time.time()) + 0.05)
    assert [f for f, _ in core.search("u", "what is my dog's name?", 2)] == [cat.fact_id, tea.fact_id]
    assert core.book.synced["u"] == version  # nothing was synced: the clock alone
    reg.update("u", old.fact_id, expires_at=float("inf"))
    assert [f for f, _ in core.search("u", "what is my dog's name?", 1)] == [old.fact_id]
    assert {f for f, _ in core.search("u", "dog", 10)} == {old.fact_id, cat.fact_id, tea.fact_id}
    reg.close()


def test_retrieval_keeps_its_indices_within_a_byte_budget(redis_url):
    """A retrieval replica's indices stay within their byte budget (embeddings: facts x 384 x 4 B), whatever the
    number of users: the least recently used users are unloaded for a bigger one; one unloaded is rebuilt from the
    registry's stored embeddings at its next search, with the same answers; a user alone over the budget is still
    served."""
    from inferscale_core.embedder import default_embedder
    from inferscale_server.retrieval import RetrievalCore, max_index_bytes

    reg = RedisRegistry(redis_url, prefix=f"budget{uuid.uuid4().hex[:8]}:")
    row = 384 * 4
    core = RetrievalCore(reg, default_embedder(), max_bytes=6 * row)
    facts = {"a": ["My dog is called Rex", "I like green tea", "I live in Oslo"],
             "b": ["My cat is called Tom", "I drink coffee", "I live in Rome"],
             "c": ["My bird is called Kiwi", "I live in Lima"]}
    ids = {u: [r.fact_id for r in reg.create(u, [NewFact(t) for t in texts])] for u, texts in facts.items()}
    dog = core.search("a", "what is my dog's name?", 1)
    core.search("b", "pet", 1)
    assert sorted(core.index.users()) == ["a", "b"] and core.index.nbytes() == 6 * row and core.evicted == 0
    core.search("c", "pet", 1)  # 8 rows: a, the least recently used, leaves
    assert sorted(core.index.users()) == ["b", "c"] and core.index.nbytes() == 5 * row and core.evicted == 1
    embedded, embed = [], core._embed  # the facts' embedder (the queries' batcher holds its own reference)
    core._embed = lambda texts: embedded.extend(texts) or embed(texts)
    assert core.search("a", "what is my dog's name?", 1) == dog and dog[0][0] == ids["a"][0]  # rebuilt
    assert embedded == []  # from the embeddings the registry stores: nothing embedded again
    assert sorted(core.index.users()) == ["a", "c"] and core.index.nbytes() <= 6 * row  # b was the oldest then
    small = RetrievalCore(reg, default_embedder(), max_bytes=2 * row)
    assert small.search("a", "what is my dog's name?", 1)[0][0] == ids["a"][0]  # alone over the budget: served
    assert small.index.users() == ["a"]
    with pytest.raises(ValueError, match="INFERSCALE_RETRIEVAL_MAX_INDEX_BYTES='2GB'"):
        max_index_bytes({"INFERSCALE_RETRIEVAL_MAX_INDEX_BYTES": "2GB"})
    assert max_index_bytes({"INFERSCALE_RETRIEVAL_MAX_INDEX_BYTES": "1048576"}) == 1 << 20
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1"):
        RetrievalCore(reg, default_embedder(), max_bytes=0)
    reg.close()


# ------------------------------------------------------------------------------------------ quotas
def test_quotas_on_facts_and_bytes(reg):
    from inferscale_server.registry import Quota, QuotaExceededError, fact_bytes

    limit = 2 * FACT_STORED_BYTES + 200  # what Redis stores with two facts, and 200 bytes of their text
    q = Quota(max_facts=3, max_bytes=limit)
    a, b = reg.create("u", [NewFact("one"), NewFact("two", {"k": "v"})], quota=q)
    assert reg.user_bytes("u") == fact_bytes(a) + fact_bytes(b) > 2 * FACT_STORED_BYTES
    with pytest.raises(QuotaExceededError, match="limit of 3 facts per user"):
        reg.create("u", [NewFact("three"), NewFact("four")], quota=q)
    with pytest.raises(QuotaExceededError, match=f"limit of {limit} bytes per user"):
        reg.create("u", [NewFact("x" * 190)], quota=q)
    with pytest.raises(QuotaExceededError, match="bytes per user"):  # an update that grows the text counts too
        reg.update("u", a.fact_id, text="y" * 190, quota=q)
    assert reg.count("u") == 2 and reg.get("u", a.fact_id).text == "one"  # nothing written by the refusals
    reg.update("u", a.fact_id, text="1", quota=q)
    reg.delete("u", b.fact_id)
    kept = sum(len(v.to_json()) for v in reg.history("u", a.fact_id))  # "one", kept as the earlier version
    assert kept and reg.user_bytes("u") == fact_bytes(reg.get("u", a.fact_id)) + kept
    reg.delete_user("u")
    assert reg.user_bytes("u") == 0 and reg.count("u") == 0


def test_the_kv_quota_counts_kv_bytes_with_the_write(reg):
    """Each fact version's KV bytes (tokens x bytes per token, measured by the encoder before the write) count
    against Quota.max_kv_bytes in the same atomic step as the rows: creates, updates, deletes."""
    from inferscale_server.registry import Quota, QuotaExceededError

    q = Quota(max_facts=100, max_bytes=1 << 20, max_kv_bytes=10_000)
    a, b = reg.create("u", [NewFact("one", kv_bytes=4_000), NewFact("two", kv_bytes=3_000)], quota=q)
    assert reg.user_kv_bytes("u") == 7_000 and reg.get("u", a.fact_id).kv_bytes == 4_000
    with pytest.raises(QuotaExceededError, match="limit of 10000 KV bytes per user"):
        reg.create("u", [NewFact("three", kv_bytes=3_001)], quota=q)
    with pytest.raises(QuotaExceededError, match="KV bytes per user"):  # a longer text: more KV
        reg.update("u", a.fact_id, text="one, said longer", kv_bytes=7_001, quota=q)
    assert reg.user_kv_bytes("u") == 7_000 and reg.get("u", a.fact_id).version == 1  # nothing written
    reg.update("u", a.fact_id, text="1", kv_bytes=1_000, quota=q)
    reg.update("u", a.fact_id, metadata={"k": "v"}, quota=q)  # the text (and its KV size) unchanged
    assert reg.user_kv_bytes("u") == 4_000 and reg.get("u", a.fact_id).kv_bytes == 1_000
    reg.delete("u", b.fact_id)
    assert reg.user_kv_bytes("u") == 1_000
    reg.delete_user("u")
    assert reg.user_kv_bytes("u") == 0
    with pytest.raises(ValueError, match="kv_bytes must be an int >= 0"):
        reg.create("u", [NewFact("x", kv_bytes=-1)])


def test_tombstones_are_written_with_every_delete_and_update(reg):
    """The log engine replicas read to remove KV from every tier: an update names the versions before the new
    one, a delete all of them (gone), DeleteUser the user; read from a cursor, in order, in pages."""
    from inferscale_server.registry import Tombstone

    reg.create("old", [NewFact("before the cursor")])
    reg.delete_user("old")
    got, cursor = reg.tombstones_after(None)  # the log's end: what a replica starting now begins from
    assert got == []
    a, b = reg.create("u", [NewFact("one"), NewFact("two")])
    assert reg.tombstones_after(cursor) == ([], cursor)  # creating removes nothing
    reg.update("u", a.fact_id, text="uno")
    reg.update("u", a.fact_id, metadata={"k": 1})
    reg.delete("u", b.fact_id)
    reg.delete_user("u")
    want = [Tombstone("u", a.fact_id, 1), Tombstone("u", a.fact_id, 2), Tombstone("u", b.fact_id, 1, gone=True),
            Tombstone("u", gone=True)]
    first, c1 = reg.tombstones_after(cursor, limit=3)
    rest, c2 = reg.tombstones_after(c1)
    assert first + rest == want and reg.tombstones_after(c2) == ([], c2)
    everything, _ = reg.tombstones_after("0")  # from the beginning
    assert everything == [Tombstone("old", gone=True), *want]


def test_quota_holds_under_concurrent_writers(any_redis_url):
    """16 writers race to add 3 facts each under a 20-fact quota: exactly 6 requests win (18 facts), the
    rest are refused whole, and the byte counter matches the facts stored (WATCH/MULTI in Redis; on a cluster,
    in the master that holds the user's slot)."""
    redis_url = any_redis_url
    from concurrent.futures import ThreadPoolExecutor

    from inferscale_server.registry import Quota, QuotaExceededError, fact_bytes

    prefix = f"q{uuid.uuid4().hex[:8]}:"
    q = Quota(max_facts=20, max_bytes=1 << 20)
    kv_q = Quota(max_facts=1000, max_bytes=1 << 20, max_kv_bytes=18 * 1000)  # the same bound, in KV bytes

    def write(i: int, quota=q, user="racer") -> bool:
        r = RedisRegistry(redis_url, prefix=prefix)  # one connection per writer, as replicas have
        try:
            r.create(user, [NewFact(f"writer {i} fact {j}", kv_bytes=1000) for j in range(3)], quota=quota)
            return True
        except QuotaExceededError:
            return False
        finally:
            r.close()

    with ThreadPoolExecutor(16) as pool:
        won = list(pool.map(write, range(16)))
        won_kv = list(pool.map(lambda i: write(i, kv_q, "kv-racer"), range(16)))
    reg = RedisRegistry(redis_url, prefix=prefix)
    assert sum(won_kv) == 6 and reg.user_kv_bytes("kv-racer") == 18 * 1000 == 1000 * reg.count("kv-racer")
    facts = reg.list("racer")[0]
    assert sum(won) == 6 and len(facts) == 18
    assert reg.user_bytes("racer") == sum(fact_bytes(f) for f in facts)
    writers = {f.text.split()[1] for f in facts}
    assert len(writers) == 6 and all(sum(f.text.split()[1] == w for f in facts) == 3 for w in writers)  # whole


def test_unservable_is_recorded_per_version(reg):
    (a,) = reg.create("u", [NewFact("too long for the encoder")])
    assert reg.set_unservable("u", a.fact_id, 1, "the fact is 300 tokens long") is True
    assert reg.get("u", a.fact_id).unservable_reason == "the fact is 300 tokens long"
    assert reg.list("u")[0][0].unservable_reason == "the fact is 300 tokens long"
    new = reg.update("u", a.fact_id, text="short now")
    assert new.version == 2 and new.unservable_reason == "" and reg.get("u", a.fact_id).unservable_reason == ""
    assert reg.set_unservable("u", a.fact_id, 1, "stale") is False  # an old version's verdict is not applied


def test_redis_with_a_password(redis_password_url, monkeypatch):
    import redis

    from inferscale_server.registry import PASSWORD_ENV, redacted

    password = redis_password_url.split("//:", 1)[1].split("@", 1)[0]
    no_password = redis_password_url.replace(f":{password}@", "")
    reg = open_registry(redis_password_url, prefix=f"p{uuid.uuid4().hex[:8]}:")
    (f,) = reg.create("u", [NewFact("behind a password")])
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    with pytest.raises(redis.AuthenticationError):
        RedisRegistry(no_password, prefix=reg.prefix).ping()
    # The password from the environment (a Kubernetes Secret), the URL in the config without it.
    monkeypatch.setenv(PASSWORD_ENV, password)
    assert RedisRegistry(no_password, prefix=reg.prefix).get("u", f.fact_id).text == "behind a password"
    assert password not in redacted(redis_password_url) and ":***@" in redacted(redis_password_url)


def test_redis_password_from_a_file(redis_password_url, monkeypatch, tmp_path):
    """The chart mounts the Redis Secret as a file: $INFERSCALE_REDIS_PASSWORD_FILE names it."""
    from inferscale_server.registry.redis_backend import PASSWORD_ENV, PASSWORD_FILE_ENV

    password = redis_password_url.split("//:", 1)[1].split("@", 1)[0]
    no_password = redis_password_url.replace(f":{password}@", "")
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    (tmp_path / "password").write_text(password + "\n")
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(tmp_path / "password"))
    reg = RedisRegistry(no_password, prefix=f"pf{uuid.uuid4().hex[:8]}:")
    (f,) = reg.create("u", [NewFact("behind a password file")])
    assert reg.get("u", f.fact_id).text == "behind a password file"
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read the Redis password file"):
        RedisRegistry(no_password, prefix="x:").ping()


def test_a_password_that_looks_like_an_option_still_starts_the_server():
    """secrets.token_urlsafe may begin a password with "--"; on redis-server's command line that is read as the
    next option and the server exits (seen once in a full run): the password goes in a config file instead."""
    import redis

    from bench.local_redis import local_redis_server

    with local_redis_server("--requirepass-lookalike") as url:
        assert redis.Redis.from_url(url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url.replace("--requirepass-lookalike", "wrong")).ping()


# ------------------------------------------------------------------------------------------ Redis Cluster
def _cluster_nodes(url: str) -> list[str]:
    """host:port of every node of the cluster the URL's node is in."""
    import redis

    with redis.Redis.from_url(url) as node:
        return sorted(addr.split("@")[0] for addr in node.cluster("nodes"))


def test_a_users_keys_are_in_one_slot_and_users_spread_over_the_masters(redis_cluster_url):
    """Every key the registry writes for a user (facts, history, counters, placement, and its bucket's sequence,
    tombstones and placed users) hashes to one slot (CLUSTER KEYSLOT on a real node); no other key is written;
    the users' buckets spread over the 3 masters; DeleteUser leaves no key of the user but its bucket's."""
    import redis

    from inferscale_server.registry.redis_backend import KV_TIER_KINDS, bucket_of

    # every key it may write, the owners index included (a gateway without authentication writes it)
    reg = RedisRegistry(redis_cluster_url, prefix=f"slot{uuid.uuid4().hex[:8]}:", index_owners=True)
    from inferscale_server.registry import IdempotentAdd

    users = [f"user-{i}" for i in range(40)]
    facts = {}
    for u in users:
        # the first user's add under an idempotency key: its keys' hash and expiry index too, in the same slot
        a, b = reg.create(u, [NewFact("one"), NewFact("two")],
                          idempotent=IdempotentAdd("add-1", "fp") if u == users[0] else None)
        if u == users[0]:  # an expiring fact: its user's expiry index too, in the same slot
            reg.update(u, b.fact_id, expires_at=2e9)
        reg.update(u, a.fact_id, text="uno")  # a history entry and a tombstone
        reg.add_placement(u, "engine-0")
        if u == users[0]:  # its cluster-tier books (the encoder pool's write), in the same slot
            reg.kv_tier_admit(u, [(a.fact_id, 2, 100)], 1000)
            reg.kv_tier_touch(u, [a.fact_id])
        facts[u] = [a.fact_id, b.fact_id]
    written = set()
    for addr in _cluster_nodes(redis_cluster_url):
        with redis.Redis.from_url(f"redis://{addr}/0") as node:
            written |= {k.decode() for k in node.scan_iter(match=f"{reg.prefix}*", count=1000)}
    expected = {k for u in users for k in reg.user_keys(u, facts[u])} - {
        reg._history_key(u, facts[u][1]) for u in users} - {  # the second fact was never updated: no history
        reg._user_key(u, k) for u in users[1:] for k in ("expiry", "idem", "idemexp", *KV_TIER_KINDS)}  # not written
    assert written == expected  # nothing global, nothing unnamed
    with redis.Redis.from_url(redis_cluster_url) as node:
        for u in users[:8]:
            slots = {node.cluster("keyslot", k) for k in reg.user_keys(u, facts[u])}
            assert len(slots) == 1, (u, slots)
    nodes = reg._bucket_nodes()
    assert len({nodes[bucket_of(u)].name for u in users}) == 3  # 40 users on all 3 masters
    assert {nodes[b].name for b in range(len(nodes))} == {n.name for n in reg.r.get_primaries()}
    for u in users:
        assert reg.delete_user(u) == 2
    assert reg.placements() == {}
    left = set()
    for addr in _cluster_nodes(redis_cluster_url):
        with redis.Redis.from_url(f"redis://{addr}/0") as node:
            left |= {k.decode() for k in node.scan_iter(match=f"{reg.prefix}*", count=1000)}
    bucket_keys = {reg._key(u, n) for u in users for n in ("seq", "tombstones")}
    versions = {reg._user_key(u, "ver") for u in users}  # kept: replicas must still see the change
    assert left == bucket_keys | versions
    reg.close()


def test_open_registry_on_any_node_of_a_cluster(redis_cluster_url):
    """A URL naming any node reaches the whole cluster: what one node's registry writes, another's reads."""
    prefix = f"anynode{uuid.uuid4().hex[:8]}:"
    regs = [open_registry(f"redis://{addr}/0", prefix=prefix) for addr in _cluster_nodes(redis_cluster_url)]
    assert len(regs) == 3
    written = {f"u{i}": regs[i % 3].create(f"u{i}", [NewFact(f"fact of u{i}")])[0] for i in range(12)}
    for i, (u, rec) in enumerate(written.items()):
        reader = regs[(i + 1) % 3]
        assert isinstance(reader, RedisRegistry) and reader.get(u, rec.fact_id).text == f"fact of {u}"
    for r in regs:
        r.ping()
        assert r.cluster is True and not r.is_full()
        r.close()
    with pytest.raises(ValueError, match="database 0"):
        RedisRegistry(redis_cluster_url.replace("/0", "/3")).ping()


def test_seed_nodes_reach_a_cluster_whose_first_node_does_not_answer(redis_cluster_url, redis_url):
    """`?seeds=HOST:PORT,...`: more nodes of a Redis Cluster to start from (a deployment lists several, so that one
    node down at start does not keep the service from its registry); refused on a single Redis and when malformed."""
    from inferscale_server.local_processes import free_port

    nodes = _cluster_nodes(redis_cluster_url)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    reg = RedisRegistry(f"redis://{dead}/0?seeds={nodes[1]},{nodes[2]}&wait_replicas=0",
                        prefix=f"seeds{uuid.uuid4().hex[:8]}:")
    (rec,) = reg.create("u", [NewFact("reached through a seed")])
    assert reg.cluster is True and reg.get("u", rec.fact_id).text == "reached through a seed"
    reg.close()
    with pytest.raises(ValueError, match="is a single Redis"):
        RedisRegistry(f"{redis_url}?seeds={nodes[0]}").ping()
    with pytest.raises(ValueError, match="seeds='redis-1'"):
        RedisRegistry(f"redis://{nodes[0]}/0?seeds=redis-1")


def test_a_replica_cluster_is_handed_out_once_its_replicas_confirm_writes(redis_replica_cluster):
    """The readiness of the clusters with replicas (support.redis_cluster_fixture.confirm_replicas_follow, which
    redis_replica_cluster and redis_tls_cluster_url run before they yield): a write on every master is confirmed by
    WAIT at once; with one master's replica stopped (SIGSTOP: linked, answering nothing) it refuses, naming that
    master, and passes again once the replica resumes."""
    import os
    import signal

    from support.redis_cluster_fixture import PROBE_WAIT_MS, confirm_replicas_follow

    cluster = redis_replica_cluster
    confirm_replicas_follow(cluster, timeout_s=0)  # the fixture's own check held: each first probe is confirmed
    master = cluster.masters()[1]
    replica = next(n for n in cluster.nodes if n.master_port == master.port)
    os.kill(replica.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RuntimeError, match=f"master 127.0.0.1:{master.port}: 0 of its 1 replicas confirmed"):
            confirm_replicas_follow(cluster, timeout_s=PROBE_WAIT_MS / 1000 / 2)  # one probe, then the error
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
    confirm_replicas_follow(cluster, timeout_s=10)


def test_tombstones_from_another_writer_reach_a_polling_reader(any_redis_url):
    """An engine replica's poll: a reader at the log's end, polled while nothing moves (it then skips the masters
    whose XADD count did not move), sees every tombstone another process writes afterwards, for users of
    many buckets, each user's in order; an idle poll returns the same cursor. A cursor of the layout before
    buckets (a plain stream id) and "0" read from the start."""
    from inferscale_server.registry import Tombstone

    prefix = f"poll{uuid.uuid4().hex[:8]}:"
    writer, reader = RedisRegistry(any_redis_url, prefix=prefix), RedisRegistry(any_redis_url, prefix=prefix)
    _, cursor = reader.tombstones_after(None)
    for _ in range(3):
        assert reader.tombstones_after(cursor) == ([], cursor)
    users = [f"p{i}" for i in range(20)]
    made = {u: writer.create(u, [NewFact("a"), NewFact("b")]) for u in users}
    assert reader.tombstones_after(cursor) == ([], cursor)  # creates write no tombstone
    for u in users:
        a, b = made[u]
        writer.update(u, a.fact_id, text="A")
        writer.delete(u, b.fact_id)
    writer.delete_user(users[0])
    got, cursor2 = [], cursor
    while True:  # in pages of 7, as a replica reads them
        page, cursor2 = reader.tombstones_after(cursor2, limit=7)
        if not page:
            break
        assert len(page) <= 7
        got += page
    for u in users:
        a, b = made[u]
        want = [Tombstone(u, a.fact_id, 1), Tombstone(u, b.fact_id, 1, gone=True)]
        assert [t for t in got if t.user_id == u] == want + ([Tombstone(u, gone=True)] if u == users[0] else [])
    assert len(got) == 41 and reader.tombstones_after(cursor2) == ([], cursor2)
    (c,) = writer.create("late", [NewFact("c")])
    writer.delete("late", c.fact_id)
    assert reader.tombstones_after(cursor2)[0] == [Tombstone("late", c.fact_id, 1, gone=True)]
    assert len(reader.tombstones_after("0", limit=100_000)[0]) == 42
    assert len(reader.tombstones_after("0-0", limit=100_000)[0]) == 42  # the old layout's cursor form
    with pytest.raises(ValueError, match="not a tombstone cursor"):
        reader.tombstones_after("b:99999=1-0")
    writer.close()
    reader.close()


def test_an_idempotency_key_stores_an_add_once(reg):
    """An add under a key keeps key -> its fact ids with the facts (same atomic step), its bytes in the user's
    byte quota; a repeat of the key writes nothing and names the earlier add; keys are per user; a key released
    (an undone add) or erased with the user can be used again."""
    from inferscale_server.registry import (
        IdempotentAdd,
        IdempotentRepeatError,
        Quota,
        QuotaExceededError,
        fact_bytes,
    )

    first = reg.create("u", [NewFact("one"), NewFact("two")], idempotent=IdempotentAdd("key-1", "fp-a"))
    ids = tuple(r.fact_id for r in first)
    held = reg.idempotent_add("u", "key-1")
    assert held.fact_ids == ids and held.fingerprint == "fp-a" and held.key == "key-1"
    assert reg.user_bytes("u") == sum(fact_bytes(r) for r in first) + held.stored_bytes()
    before = (reg.count("u"), reg.user_version("u"), reg.user_bytes("u"))
    with pytest.raises(IdempotentRepeatError) as e:  # the same key again, even with other facts: nothing written
        reg.create("u", [NewFact("one"), NewFact("two"), NewFact("three")], idempotent=IdempotentAdd("key-1", "fp-b"))
    assert e.value.earlier == held
    assert (reg.count("u"), reg.user_version("u"), reg.user_bytes("u")) == before
    other = reg.create("v", [NewFact("one")], idempotent=IdempotentAdd("key-1", "fp-a"))  # another user's key
    assert reg.idempotent_add("v", "key-1").fact_ids == (other[0].fact_id,) and reg.idempotent_add("w", "key-1") is None

    facts_only = Quota(max_facts=10, max_bytes=reg.user_bytes("u") + fact_bytes(first[0]))  # no room for a key
    with pytest.raises(QuotaExceededError, match="bytes per user"):
        reg.create("u", [NewFact("one")], quota=facts_only, idempotent=IdempotentAdd("key-2", "fp-c"))
    assert reg.idempotent_add("u", "key-2") is None and reg.count("u") == 2

    reg.release_idempotency_key("u", "key-1")
    reg.release_idempotency_key("u", "never-used")  # nothing to forget: nothing happens
    assert reg.idempotent_add("u", "key-1") is None
    assert reg.user_bytes("u") == sum(fact_bytes(r) for r in first)
    again = reg.create("u", [NewFact("three")], idempotent=IdempotentAdd("key-1", "fp-d"))
    assert reg.idempotent_add("u", "key-1").fact_ids == (again[0].fact_id,)
    reg.delete_user("u")
    assert reg.idempotent_add("u", "key-1") is None and reg.user_bytes("u") == 0
    reg.create("u", [NewFact("four")], idempotent=IdempotentAdd("key-1", "fp-e"))  # erased: usable again
    for bad in ("", "has space", "x" * 129, "naïve"):
        with pytest.raises(ValueError, match="idempotency key"):
            reg.create("u", [NewFact("five")], idempotent=IdempotentAdd(bad, "fp"))
    assert reg.count("u") == 1


def test_a_repeat_answered_with_an_adds_facts_keeps_the_add_from_being_released(reg):
    """idempotent_add(answering=the add's own fingerprint) marks the add answered in one atomic step: from then on
    release_idempotency_key (an undo) says False and forgets nothing, so the facts a repeat returned stay named by
    the key; a lookup or another request's fingerprint marks nothing; the mark moves no byte counter."""
    from inferscale_server.registry import IdempotentAdd

    recs = reg.create("u", [NewFact("one")], idempotent=IdempotentAdd("key-1", "fp-a"))
    reg.create("u", [NewFact("two")], idempotent=IdempotentAdd("key-2", "fp-b"))
    used = reg.user_bytes("u")
    assert not reg.idempotent_add("u", "key-1").answered  # a lookup
    assert not reg.idempotent_add("u", "key-1", answering="fp-other").answered  # another add's request
    marked = reg.idempotent_add("u", "key-1", answering="fp-a")
    assert marked.answered and marked.fact_ids == (recs[0].fact_id,) and reg.idempotent_add("u", "key-1").answered
    assert reg.idempotent_add("u", "key-1", answering="fp-a") == marked  # answered again: the same
    assert reg.idempotent_add("u", "never-used", answering="fp-a") is None
    assert reg.user_bytes("u") == used and marked.stored_bytes() == IdempotentAdd(
        "key-1", "fp-a", marked.fact_ids, marked.expires_at).stored_bytes()
    assert reg.release_idempotency_key("u", "key-1") is False and reg.idempotent_add("u", "key-1") == marked
    assert reg.release_idempotency_key("u", "key-2") is True and reg.idempotent_add("u", "key-2") is None
    assert reg.release_idempotency_key("u", "never-used") is True
    reg.delete_user("u")  # erased with the user, answered or not
    assert reg.idempotent_add("u", "key-1") is None and reg.user_bytes("u") == 0


def test_expired_idempotency_keys_are_forgotten_with_their_bytes(reg, monkeypatch):
    """A key is kept IDEMPOTENCY_TTL_S: after it a lookup does not find it, the key can name a new add, and the
    user's next add forgets it and gives its bytes back."""
    import time

    from inferscale_server.registry import IdempotentAdd, IdempotentRepeatError, base, fact_bytes

    if isinstance(reg, ActorRegistry):
        pytest.skip("the TTL is read in the actor's process; the actor runs the EmbeddedRegistry tested here")
    monkeypatch.setattr(base, "IDEMPOTENCY_TTL_S", 0.5)
    (a,) = reg.create("u", [NewFact("one")], idempotent=IdempotentAdd("old", "fp"))
    (b,) = reg.create("u", [NewFact("two")], idempotent=IdempotentAdd("reused", "fp"))
    assert reg.idempotent_add("u", "old", now=time.time() + 1) is None  # a lookup after the TTL: gone
    with pytest.raises(IdempotentRepeatError):
        reg.create("u", [NewFact("two")], idempotent=IdempotentAdd("reused", "fp"))
    time.sleep(0.6)
    assert reg.idempotent_add("u", "old") is None
    (c,) = reg.create("u", [NewFact("three")], idempotent=IdempotentAdd("reused", "fp-new"))  # a new add now
    fresh = reg.idempotent_add("u", "reused")
    assert fresh.fact_ids == (c.fact_id,) and fresh.fingerprint == "fp-new"
    # "old" and the first "reused" were forgotten with that add: only the new key's bytes are counted
    assert reg.user_bytes("u") == sum(fact_bytes(r) for r in (a, b, c)) + fresh.stored_bytes()
    assert reg.count("u") == 3


def test_concurrent_adds_under_one_key_store_once(reg):
    """Writers racing with one key (a client's retry beside its first try): one add stores its facts, every other
    is refused as a repeat of it (the key is checked in the create's atomic step)."""
    from concurrent.futures import ThreadPoolExecutor

    from inferscale_server.registry import IdempotentAdd, IdempotentRepeatError

    def add(i: int):
        try:
            return [r.fact_id for r in reg.create("racer", [NewFact("a fact"), NewFact("another")],
                                                  idempotent=IdempotentAdd("one-key", "fp"))]
        except IdempotentRepeatError as e:
            return e.earlier.fact_ids

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(add, range(8)))
    assert reg.count("racer") == 2
    assert {tuple(a) for a in answers} == {tuple(r.fact_id for r in reg.list("racer")[0])}
