"""Real Redis Clusters on free loopback ports (no persistence), started by the tests and stopped afterwards.

A pytest plugin (tests/conftest.py): ask for `redis_cluster_url` by name (the URL of one node of a 3-master cluster
without replicas, started once per test session, about 3 s: the nodes meet by gossip; any node's URL reaches the
whole cluster), or `redis_replica_cluster` (3 masters with one replica each and a cluster-node-timeout of
REPLICA_CLUSTER_NODE_TIMEOUT_MS, so that a master killed or stopped is replaced within seconds; a LocalRedisCluster
with the nodes' ports and processes; one per test, since such tests kill and stop its nodes). Tests give their
registries a fresh key prefix, so they never see each other's keys."""
from __future__ import annotations

import pytest

from bench.local_redis import RedisServerMissing, local_redis_cluster, local_redis_cluster_nodes

REPLICA_CLUSTER_NODE_TIMEOUT_MS = 1500


@pytest.fixture(scope="session")
def redis_cluster_url():
    try:
        with local_redis_cluster(masters=3) as url:
            yield url
    except RedisServerMissing as e:  # raised before the servers start
        pytest.fail(f"{e}; the registry's cluster tests need it")


@pytest.fixture
def redis_replica_cluster():
    try:
        with local_redis_cluster_nodes(masters=3, replicas_per_master=1,
                                       node_timeout_ms=REPLICA_CLUSTER_NODE_TIMEOUT_MS) as cluster:
            yield cluster
    except RedisServerMissing as e:  # raised before the servers start
        pytest.fail(f"{e}; the registry's failover tests need it")
