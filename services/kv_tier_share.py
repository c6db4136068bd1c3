"""Each user's share of the cluster KV tier (issue 31): no tenant's KV pushes another's out of Mooncake Store.

Mooncake's master evicts by one LRU over every object, so without a bound one user writing KV without end (a fact
flood, ever new facts, re-encodes of a large memory) evicts every other user's facts. The encoder pool, the only
writer of the tier, therefore books what it writes per user in the registry (`Registry.kv_tier_admit`, atomic,
shared by every pool replica) and, BEFORE it writes, removes that user's own least recently used objects until the
user fits its cap (`ClusterConfig.user_cap`: by default pool_bytes / (replicas x tenants)). Engine replicas mark the
facts a request reads from the tier as used (`Registry.kv_tier_touch`). A fact removed this way is a miss like a
fact the master evicted: the request that names it has vLLM compute those tokens (the connector's failed-load
path, same answer) and one re-encode writes it back, which again makes room within the same user's share.

Where the pool's size comes from is one rule for every way the service is deployed (`smallest_pool_bytes`): the
chart (its worker groups' minReplicas pods), a Ray cluster (`ray_cluster.yaml`'s GPU nodes' min_workers, passed as
`--mooncake-pool-gib` when its Serve config is emitted) and one machine (`inferscale serve --local-mooncake`, the
benchmarks and the tests: the one segment services/local_mooncake.py starts).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger("inferscale.kv_tier_share")


def smallest_pool_bytes(groups: Iterable[tuple[int, int]]) -> int:
    """`ClusterConfig.pool_bytes` for segments held by groups of nodes, `(fewest nodes of the group, segment bytes
    each)`: the memory the deployment always has. Sized on the fewest nodes, never on what autoscaling may add,
    because a share taken from memory that is not there would let one user's KV take more than its fraction of
    the pool that is."""
    total = 0
    for nodes, segment_bytes in groups:
        if nodes < 0 or segment_bytes < 0:
            raise ValueError(f"a group of segments needs counts >= 0, got {nodes} nodes of {segment_bytes} bytes")
        total += nodes * segment_bytes
    return total


class TierShare:
    """The pool's side: make room within a user's cap before writing its facts to the cluster tier."""

    def __init__(self, registry, cluster, cap: int):
        self.registry, self.cluster, self.cap = registry, cluster, cap
        self.counters = {"share_removed": 0, "share_errors": 0}

    def make_room(self, user_id: str, items: list[tuple[str, int, int]]) -> list[str]:
        """Books `(fact_id, version, KV bytes)` about to be written for the user and removes from the tier the
        user's least recently used other facts that take it past its cap; returns their kv_ids. A registry that
        does not answer leaves the write unbounded this once (logged, counted): the KV is still written, and
        Mooncake's own LRU still bounds the pool."""
        if not items:
            return []
        try:
            victims = self.registry.kv_tier_admit(user_id, items, self.cap)
        except Exception as e:  # noqa: BLE001 - the write goes on; the next one books the user again
            self.counters["share_errors"] += 1
            log.warning("cluster KV tier: booking %d facts of a user failed (%s); written without its share's "
                        "bound this time", len(items), e)
            return []
        if victims:
            self.cluster.remove_kvs(user_id, victims)
            self.counters["share_removed"] += len(victims)
        return victims
