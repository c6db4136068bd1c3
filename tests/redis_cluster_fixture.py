"""A real Redis Cluster of 3 masters on free loopback ports (no replicas, no persistence), started once per test
session (about 3 s: the nodes meet by gossip) and stopped afterwards.

A pytest plugin (tests/conftest.py): ask for `redis_cluster_url` by name (the URL of one node; any node's URL
reaches the whole cluster). Tests give their registries a fresh key prefix, so they never see each other's keys."""
from __future__ import annotations

import pytest

from inferscale_server.registry.local_redis import RedisServerMissing, local_redis_cluster


@pytest.fixture(scope="session")
def redis_cluster_url():
    try:
        with local_redis_cluster(masters=3) as url:
            yield url
    except RedisServerMissing as e:  # raised before the servers start
        pytest.fail(f"{e}; the registry's cluster tests need it")
