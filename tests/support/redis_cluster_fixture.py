"""Real Redis Clusters on free loopback ports (no persistence), started by the tests and stopped afterwards.

A pytest plugin (tests/conftest.py): ask for `redis_cluster_url` by name (the URL of one node of a 3-master cluster
without replicas, started once per test session, about 3 s: the nodes meet by gossip; any node's URL reaches the
whole cluster), or `redis_replica_cluster` (3 masters with one replica each and a cluster-node-timeout of
REPLICA_CLUSTER_NODE_TIMEOUT_MS, so that a master killed or stopped is replaced within seconds; a LocalRedisCluster
with the nodes' ports and processes; one per test, since such tests kill and stop its nodes), or `redis_stoppable_cluster` (3 masters without replicas and a
cluster-node-timeout of STOPPABLE_CLUSTER_NODE_TIMEOUT_MS, so that a master stopped for a few seconds is down but not
yet declared failed: the window in which the other masters still serve; one per test). Tests give their
registries a fresh key prefix, so they never see each other's keys.

A cluster with replicas is handed out only once every master's replicas confirm its writes
(confirm_replicas_follow): the registry waits for a replica with every write (WAIT), and its first write must not
meet a replica that is linked but not yet streamed to."""
from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable

import pytest

from bench.local_redis import LocalRedisCluster, RedisServerMissing, local_redis_cluster, local_redis_cluster_nodes

REPLICA_CLUSTER_NODE_TIMEOUT_MS = 1500
# One probe's WAIT: longer than the once-a-second REPLCONF ACK that a replica just synced may have to send before
# its master streams to it (confirm_replicas_follow), so that one probe normally suffices.
PROBE_WAIT_MS = 1500
CONFIRM_TIMEOUT_S = 30.0  # as long as the cluster's own start may take (local_redis_cluster_nodes)
# Redis's own default. A master silent this long is declared failed; with no replica to promote, every node then
# refuses every command (CLUSTERDOWN: cluster-require-full-coverage, Redis's default), so a test that stops a master
# of redis_stoppable_cluster must resume it well within this.
STOPPABLE_CLUSTER_NODE_TIMEOUT_MS = 15_000


def confirm_replicas_follow(cluster: LocalRedisCluster, client_kwargs: dict | None = None,
                            timeout_s: float = CONFIRM_TIMEOUT_S) -> None:
    """Returns once a probe write on every master of `cluster` was confirmed by all of that master's replicas
    (`WAIT <its replicas> PROBE_WAIT_MS` on the write's connection, repeated until `timeout_s`); RuntimeError naming
    the master and how many replicas confirmed otherwise. `client_kwargs`: redis-py's options for the nodes
    (TlsFiles.client_kwargs() for a TLS cluster).

    Why local_redis_cluster_nodes' own readiness (every replica's master_link_status:up) is not enough: with
    diskless replication (Redis 7's default) a master streams nothing to a replica that just loaded its RDB until it
    has seen both the RDB child exit and a REPLCONF ACK from that replica after it. The replica sends one ACK the
    moment its load is done, and its link says up from then on; when that ACK arrives before the master noticed the
    child's exit (a loaded CPU delays the child's exit), the master waits for the replica's next ACK, sent once a
    second. Until then every WAIT on that master counts 0 replicas: the registry's first write, waiting
    WAIT_TIMEOUT_MS (500 ms), was refused as unconfirmed (test_create_get_list_count[cluster-tls], under two
    xdist workers). A probe confirmed by WAIT is the condition the registry's writes need, whatever the cause."""
    import redis
    from redis.crc import key_slot

    deadline = time.monotonic() + timeout_s
    for master in cluster.masters():
        want = sum(n.master_port == master.port for n in cluster.nodes)
        if want == 0:
            continue
        with redis.Redis(host="127.0.0.1", port=master.port, **(client_kwargs or {})) as node:
            # A key in one of this master's slots (any other key answers MOVED).
            me = next(n for n in node.cluster("nodes").values() if "myself" in n["flags"].split(","))
            lo, hi = (int(s) for s in me["slots"][0][:2])
            key = next(k for k in (f"fixture-probe-{i}" for i in range(100_000)) if lo <= key_slot(k.encode()) <= hi)
            while True:
                node.set(key, "probe")
                got = int(node.execute_command("WAIT", want, PROBE_WAIT_MS))
                if got >= want:
                    node.delete(key)  # not waited for: the probe only had to reach the replicas
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Redis Cluster's master 127.0.0.1:{master.port}: {got} of its {want} "
                                       f"replicas confirmed a write within {timeout_s:.0f} s (WAIT); "
                                       f"its replication: {node.info('replication')}")


def users_by_master(cluster: LocalRedisCluster, user_key: Callable[[str], str], master_port: int, on: int,
                    off: int, tag: str = "u") -> tuple[list[str], list[str]]:
    """`on` fresh user ids whose registry keys are in the slots of the master on `master_port`, and `off` whose keys
    are elsewhere (the failover tests' victims and bystanders). `user_key(user_id)` is one of a user's keys (every
    key of a user is in one slot: RedisRegistry.user_keys)."""
    from redis.cluster import RedisCluster

    victims: list[str] = []
    others: list[str] = []
    with RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port) as rc:
        while len(victims) < on or len(others) < off:
            u = f"{tag}{uuid.uuid4().hex[:8]}"
            (victims if rc.get_node_from_key(user_key(u)).port == master_port else others).append(u)
    return victims[:on], others[:off]


@pytest.fixture(scope="session")
def redis_cluster_url():
    try:
        with local_redis_cluster(masters=3) as url:
            yield url
    except RedisServerMissing as e:  # raised before the servers start
        pytest.fail(f"{e}; the registry's cluster tests need it")


@contextlib.contextmanager
def replica_cluster(needed_by: str):
    """3 masters with one replica each, cluster-node-timeout REPLICA_CLUSTER_NODE_TIMEOUT_MS, handed out once the
    replicas confirm writes (a LocalRedisCluster); the test fails, naming `needed_by`, without a redis-server. For
    a fixture of another scope than redis_replica_cluster's (tests/service/test_kv_tier_service.py runs the service
    on one for its module)."""
    try:
        with local_redis_cluster_nodes(masters=3, replicas_per_master=1,
                                       node_timeout_ms=REPLICA_CLUSTER_NODE_TIMEOUT_MS) as cluster:
            confirm_replicas_follow(cluster)
            yield cluster
    except RedisServerMissing as e:  # raised before the servers start
        pytest.fail(f"{e}; {needed_by} need it")


@pytest.fixture
def redis_replica_cluster():
    with replica_cluster("the registry's failover tests") as cluster:
        yield cluster


@pytest.fixture
def redis_stoppable_cluster():
    """3 masters without replicas, one per test (its tests stop a master: never the session's redis_cluster_url,
    which other tests go on using); a master stopped for less than STOPPABLE_CLUSTER_NODE_TIMEOUT_MS is down for
    its own slots only."""
    try:
        with local_redis_cluster_nodes(masters=3, replicas_per_master=0,
                                       node_timeout_ms=STOPPABLE_CLUSTER_NODE_TIMEOUT_MS) as cluster:
            yield cluster
    except RedisServerMissing as e:  # raised before the servers start
        pytest.fail(f"{e}; the registry's shard-outage tests need it")
