"""The registry on a real Redis Cluster, shard by shard: a master that is down stops its own users only, and the
tombstones every master writes reach each reader of the log (issue 32's tests "DeleteUser of a user on shard B while
shard A's master is down" and "tombstones written on every shard reach every engine replica")."""
from __future__ import annotations

import os
import signal
import time
import uuid

import grpc
import pytest
import redis

from inferscale_server.errors import to_api_error
from inferscale_server.registry import NewFact, RedisRegistry, Tombstone
from inferscale_server.registry.redis_backend import SOCKET_TIMEOUT_S, WRITE_RIDE_THROUGH_S, bucket_of


def _users_by_master(reg: RedisRegistry, n: int = 200) -> dict[int, list[str]]:
    """master's port -> the users (of u0..u<n>) whose bucket that master holds, as the registry's slot map says."""
    nodes = reg._bucket_nodes()
    out: dict[int, list[str]] = {}
    for i in range(n):
        out.setdefault(nodes[bucket_of(f"u{i}")].port, []).append(f"u{i}")
    return out


def _keys_on(port: int, prefix: str) -> set[str]:
    """Every key under `prefix` on one node, asked of that node alone (SCAN on its own connection)."""
    with redis.Redis(host="127.0.0.1", port=port, socket_timeout=SOCKET_TIMEOUT_S) as node:
        return {k.decode() for k in node.scan_iter(match=f"{prefix}*", count=1000)}


def _bucket_leftovers(reg: RedisRegistry, user: str) -> set[str]:
    """What DeleteUser keeps of a user: its bucket's sequence and tombstone stream (shared with the bucket's other
    users) and its change counter (replicas must still see the change)."""
    return {reg._key(user, "seq"), reg._key(user, "tombstones"), reg._user_key(user, "ver")}


def test_delete_user_on_one_master_while_another_master_is_stopped_then_killed(redis_stoppable_cluster):
    """Master A stopped (SIGSTOP: its port still accepts connections, nothing answers: a hung or partitioned
    master, the worst case for a client, which waits for its timeouts rather than being refused at once), for
    less than the cluster-node-timeout, so the cluster has not declared it failed: DeleteUser of a user on master
    B succeeds at once and leaves none of its keys on B; DeleteUser of a user on A answers UNAVAILABLE with a retry
    hint (what errors.to_api_error makes of it) within the registry's own timeouts; once A resumes, the user on A
    is deleted and none of its keys are left. A is the node the registry's URL names, so nothing of B's path may
    go through the URL's node either. (A read of a user on A, not made here, takes longer to give up: redis-py's
    cluster retry, 1 + CLUSTER_RETRIES tries of SOCKET_TIMEOUT_S each, about 14 s measured.)"""
    cluster = redis_stoppable_cluster
    a, b = cluster.masters()[0], cluster.masters()[1]
    assert cluster.url.endswith(f":{a.port}/0")  # the URL's node is the one that goes down
    reg = RedisRegistry(cluster.url, prefix=f"down{uuid.uuid4().hex[:8]}:")
    by_master = _users_by_master(reg)
    user_a, user_b = by_master[a.port][0], by_master[b.port][0]
    facts = {}
    for u in (user_a, user_b):  # every kind of key a user has: facts, history, counters, placement
        one, two = reg.create(u, [NewFact(f"{u} one"), NewFact(f"{u} two")])
        reg.update(u, one.fact_id, text=f"{u} uno")
        reg.add_placement(u, "engine-0")
        facts[u] = [one.fact_id, two.fact_id]
    for u, m in ((user_a, a), (user_b, b)):  # its keys are on its master, so what is scanned there afterwards says
        assert {reg._fact_key(u, f) for f in facts[u]} | {  # what DeleteUser left
            reg._history_key(u, facts[u][0]), reg._placement_key(u), reg._user_key(u, "facts")} <= _keys_on(m.port,
                                                                                                          reg.prefix)

    os.kill(a.proc.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        started = time.monotonic()
        assert reg.delete_user(user_b) == 2
        assert reg.count(user_b) == 0 and reg.list(user_b)[0] == [] and reg.placement(user_b) == set()
        took_b = time.monotonic() - started
        assert took_b < SOCKET_TIMEOUT_S / 2, took_b  # nothing of it waited on A (about 1 ms measured)
        assert _keys_on(b.port, reg.prefix) == _bucket_leftovers(reg, user_b)

        started = time.monotonic()
        with pytest.raises(Exception) as refused:
            reg.delete_user(user_a)
        took_a = time.monotonic() - started
        err = to_api_error(refused.value)
        assert err.code == grpc.StatusCode.UNAVAILABLE and err.retry_after_s, (err, refused.value)
        # one socket timeout measured (2.0 s); at most the write's ride-through and one last try
        assert took_a < WRITE_RIDE_THROUGH_S + SOCKET_TIMEOUT_S + 1, took_a
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    # Well within the cluster-node-timeout: the cluster never declared A failed (else every node would now answer
    # CLUSTERDOWN, and this test would say so below, not hang).
    assert time.monotonic() - stopped < cluster.node_timeout_ms / 1000 / 2

    # The refused DeleteUser was sent before A stopped answering: A may run it once it resumes (WRITE_UNCONFIRMED's
    # "may have been applied"), so the retry deletes 2 facts or finds them gone; either way nothing of the user is
    # left, and B's user stays deleted.
    assert reg.delete_user(user_a) in (0, 2)
    assert reg.count(user_a) == 0 and reg.placement(user_a) == set()
    assert _keys_on(a.port, reg.prefix) == _bucket_leftovers(reg, user_a)
    assert _keys_on(b.port, reg.prefix) == _bucket_leftovers(reg, user_b)
    assert reg.placements() == {}

    # A killed (its port refuses connections; with a replica, this is a failover's first seconds): B's users are
    # still deleted at once, and a write for A's user, refused before anything was sent, is tried again (the slot
    # map refreshed) for WRITE_RIDE_THROUGH_S, as a failover needs, before it answers UNAVAILABLE. (Before the fix
    # in RedisRegistry._on_master the refused connection was raised at once, within a millisecond.)
    user_b2 = by_master[b.port][1]
    reg.create(user_b2, [NewFact("second on B")])
    os.kill(a.proc.pid, signal.SIGKILL)
    a.proc.wait(timeout=10)
    started = time.monotonic()
    assert reg.delete_user(user_b2) == 1
    assert time.monotonic() - started < SOCKET_TIMEOUT_S / 2
    assert _keys_on(b.port, reg.prefix) == _bucket_leftovers(reg, user_b) | _bucket_leftovers(reg, user_b2)
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError) as refused:
        reg.create(user_a, [NewFact("while A is dead")])
    took = time.monotonic() - started
    err = to_api_error(refused.value)
    assert err.code == grpc.StatusCode.UNAVAILABLE and err.retry_after_s, err
    # the last pause before the deadline is at most 0.5 s (its backoff's cap)
    assert WRITE_RIDE_THROUGH_S - 0.6 <= took < WRITE_RIDE_THROUGH_S + SOCKET_TIMEOUT_S, took
    reg.close()


def _poll(reader: RedisRegistry, cursor: str) -> tuple[list[Tombstone], str]:
    """An engine replica's read of the log (services/engine_replica/deletions.py Deletions.apply): from its cursor,
    page after page until a page comes back empty."""
    got: list[Tombstone] = []
    while True:
        page, cursor = reader.tombstones_after(cursor)
        if not page:
            return got, cursor
        got += page


def test_tombstones_written_on_every_master_reach_every_reader(redis_cluster_url):
    """Two readers (two engine replicas, each with its cursor) at the log's end, polled while nothing moves (so each
    then skips the masters whose XADD count did not move: tombstones_after's hint), and one user on each of the 3
    masters: a delete on one master at a time reaches both readers at their next poll, exactly that tombstone, while
    the other two masters are skipped; then an update, a delete and a DeleteUser on every master at once reach both,
    each user's in order; a reader from the log's start ("0") sees all of them."""
    prefix = f"shards{uuid.uuid4().hex[:8]}:"
    writer = RedisRegistry(redis_cluster_url, prefix=prefix)
    readers = [RedisRegistry(redis_cluster_url, prefix=prefix) for _ in range(2)]
    users = [us[0] for us in _users_by_master(writer).values()]
    nodes = writer._bucket_nodes()
    assert len({nodes[bucket_of(u)].name for u in users}) == 3  # one user on each master
    made = {u: writer.create(u, [NewFact("a"), NewFact("b"), NewFact("c")]) for u in users}
    cursors = [r.tombstones_after(None)[1] for r in readers]
    for _ in range(2):  # idle polls: from here on each reader skips every master whose XADD count stays put
        assert [_poll(r, c) for r, c in zip(readers, cursors)] == [([], c) for c in cursors]

    for u in users:  # one master moves at a time
        writer.delete(u, made[u][0].fact_id)
        for i, r in enumerate(readers):
            got, cursors[i] = _poll(r, cursors[i])
            assert got == [Tombstone(u, made[u][0].fact_id, 1, gone=True)], (u, i)

    for u in users:  # every master moves
        writer.update(u, made[u][1].fact_id, text="B")
        writer.delete(u, made[u][1].fact_id)
        writer.delete_user(u)
    want = {u: [Tombstone(u, made[u][1].fact_id, 1), Tombstone(u, made[u][1].fact_id, 2, gone=True),
                Tombstone(u, gone=True)] for u in users}
    for i, r in enumerate(readers):
        got, cursors[i] = _poll(r, cursors[i])
        assert {u: [t for t in got if t.user_id == u] for u in users} == want, i
        assert len(got) == 9 and _poll(r, cursors[i]) == ([], cursors[i])
    everything, _ = _poll(readers[0], "0")
    assert len(everything) == 12 and {t.user_id for t in everything} == set(users)
    for r in (writer, *readers):
        r.close()


def test_a_killed_master_s_error_crosses_ray_as_unavailable(redis_stoppable_cluster):
    """redis-py's cluster client puts the node a command failed on into the error (`connection`), which cannot be
    pickled: raised in a backend replica, Ray replaced it by a bare RayError and the gateway answered INTERNAL
    during a failover (tests/service/test_kv_tier_service.py). The registry makes redis-py's errors picklable
    without it: the read of a user on a killed master reaches another process as the ConnectionError it is, and
    the gateway's mapping of Ray's wrapper says UNAVAILABLE with a retry hint."""
    import pickle

    from ray.exceptions import RayTaskError

    cluster = redis_stoppable_cluster
    a = cluster.masters()[1]
    reg = RedisRegistry(cluster.url, prefix=f"pk{uuid.uuid4().hex[:8]}:")
    user = _users_by_master(reg)[a.port][0]
    reg.create(user, [NewFact(f"{user} one")])
    os.kill(a.proc.pid, signal.SIGKILL)
    with pytest.raises(redis.ConnectionError) as raised:
        reg.user_version(user)
    assert getattr(raised.value, "connection", None) is not None  # what made it unpicklable
    back = pickle.loads(pickle.dumps(raised.value))
    assert type(back) is redis.ConnectionError and back.args == raised.value.args
    wrapped = pickle.loads(pickle.dumps(RayTaskError("search", "traceback", raised.value)))
    assert isinstance(wrapped.cause, redis.ConnectionError)  # not Ray's "isn't serializable" RayError
    err = to_api_error(wrapped)
    assert err.code == grpc.StatusCode.UNAVAILABLE and err.retry_after_s, err
