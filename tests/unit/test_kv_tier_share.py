"""Each user's share of the cluster KV tier (issue 31; services/kv_tier_share.py): the registry's books of what the
encoder pool wrote there, the cap derived from the pool, and a tenant flooding a real Mooncake Store past its
share: its own least recently used KV goes, never another tenant's."""
from __future__ import annotations

import time

import pytest
from support.fact_store import make_fact
from support.mooncake_fixture import raw_client

from inferscale_core.cluster_store import ClusterConfig, ClusterStore, pack
from inferscale_core.types import kv_id
from inferscale_server.kv_tier_share import TierShare
from inferscale_server.registry import EmbeddedRegistry, NewFact, RedisRegistry


def test_the_cap_is_a_fair_share_of_the_pool_and_bad_values_are_refused():
    base = {"master": "127.0.0.1:1"}
    assert ClusterConfig.from_dict(base).user_cap() is None  # no pool size known: the master's LRU alone
    pool = {**base, "pool_bytes": 18 << 30}  # the chart's default pool: 1 CPU pod x 2 GiB + 1 GPU pod x 16 GiB
    assert ClusterConfig.from_dict(pool).user_cap() == (18 << 30) // (2 * 16)  # 2 copies, 16 tenants: 576 MiB
    assert ClusterConfig.from_dict({**pool, "replicas": 1, "tenants": 4}).user_cap() == (18 << 30) // 4
    assert ClusterConfig.from_dict({**pool, "max_bytes_per_user": 1000}).user_cap() == 1000
    assert ClusterConfig.from_dict({**pool, "max_bytes_per_user": None}).user_cap() == (18 << 30) // 32
    for bad, name in [({"pool_bytes": -1}, "pool_bytes"), ({"pool_bytes": 1.5}, "pool_bytes"),
                      ({"tenants": 0}, "tenants"), ({"tenants": True}, "tenants"),
                      ({"max_bytes_per_user": 0}, "max_bytes_per_user"),
                      ({"max_bytes_per_user": "1G"}, "max_bytes_per_user")]:
        with pytest.raises(ValueError, match=f"cluster_store.{name} must be an integer"):
            ClusterConfig.from_dict({**base, **bad})


def test_the_chart_derives_the_pool_from_its_smallest_cluster():
    import yaml

    from inferscale_server.app import CHART_VALUES, ServiceConfig

    values = yaml.safe_load(CHART_VALUES.read_text())
    store = ServiceConfig.from_chart_values(values).cluster_store
    m, ray = values["mooncake"], values["ray"]
    want = (ray["cpuWorkers"]["minReplicas"] * m["cpuSegmentGiB"] + ray["gpuWorkers"]["minReplicas"] * m["segmentGiB"])
    assert store["pool_bytes"] == want << 30 and store["tenants"] == m["tenants"] == 16
    cap = ClusterConfig.from_dict(store).user_cap()
    assert cap is not None and cap * m["replicas"] * 16 <= store["pool_bytes"]


def test_every_deployment_takes_the_share_from_the_segments_it_always_runs(mooncake):
    """One rule (kv_tier_share.smallest_pool_bytes) for the chart, a Ray cluster and one machine: the tests' store
    (services/local_mooncake.py, as `inferscale serve --local-mooncake` and the benchmarks start it) is a pool of
    its one segment, so its tenants have a share as they would on a cluster."""
    from inferscale_server.kv_tier_share import smallest_pool_bytes

    assert smallest_pool_bytes([(1, 2 << 30), (1, 16 << 30)]) == 18 << 30  # the chart's default: 1 CPU + 1 GPU pod
    assert smallest_pool_bytes([(0, 16 << 30)]) == 0 and smallest_pool_bytes([]) == 0
    with pytest.raises(ValueError, match="counts >= 0"):
        smallest_pool_bytes([(-1, 16 << 30)])
    config = ClusterConfig.from_dict(mooncake.config)
    # the fixture's one segment: one copy of each object written there, so one counted
    assert config.pool_bytes == 512 << 20 and config.replicas == 1 and config.tenants == 16
    assert config.user_cap() == (512 << 20) // 16  # 32 MiB


@pytest.fixture(params=["embedded", "redis"])
def registry(request):
    if request.param == "embedded":
        yield EmbeddedRegistry()
        return
    reg = RedisRegistry(request.getfixturevalue("redis_url"), prefix=f"kvshare-{time.time_ns()}:")
    yield reg
    reg.close()


def test_the_books_take_only_the_users_own_least_recently_used_facts(registry):
    assert registry.kv_tier_admit("b", [("b1", 1, 300), ("b2", 1, 300)], 1000) == []
    assert registry.kv_tier_admit("a", [(f"a{i}", 1, 300) for i in range(3)], 1000) == []
    registry.kv_tier_touch("a", ["a0", "never-booked"])  # a1 is now a's least recently used
    assert registry.kv_tier_admit("a", [("a3", 1, 300)], 1000) == ["a1@v1"]
    assert registry.kv_tier_admit("a", [("a4", 2, 300)], 1000) == ["a2@v1"]
    assert registry.kv_tier_admit("a", [("a3", 2, 300)], 1000) == []  # a new version replaces its fact's entry
    assert registry.kv_tier_admit("a", [("a5", 1, 950)], 1000) == ["a0@v1", "a4@v2", "a3@v2"]  # alone over: kept
    assert registry.kv_tier_bytes("a") == 950 and registry.kv_tier_bytes("b") == 600  # b never paid
    assert registry.kv_tier_admit("a", [("a6", 1, 10), ("a7", 1, 10)], 1000) == []
    assert registry.kv_tier_admit("a", [("a8", 1, 10)], 0) == ["a5@v1", "a6@v1", "a7@v1"]
    with pytest.raises(ValueError, match="cap per user"):
        registry.kv_tier_admit("a", [("a9", 1, 10)], -1)
    with pytest.raises(ValueError, match="version"):
        registry.kv_tier_admit("a", [("a9", 0, 10)], 100)
    with pytest.raises(ValueError, match="kv_bytes"):
        registry.kv_tier_admit("a", [("a9", 1, -5)], 100)
    assert registry.kv_tier_bytes("a") == 10


def test_a_deleted_fact_or_user_leaves_the_books(registry):
    registry.create("c", [NewFact(text="Carol rows.", fact_id="c1"), NewFact(text="Carol sings.", fact_id="c2")])
    registry.kv_tier_admit("c", [("c1", 1, 100), ("c2", 1, 200)], 1000)
    registry.delete("c", "c1")
    assert registry.kv_tier_bytes("c") == 200
    assert registry.kv_tier_admit("c", [("c3", 1, 900)], 1000) == ["c2@v1"]  # c1 is not named again
    registry.create("d", [NewFact(text="Dan cooks.", fact_id="d1")])
    registry.kv_tier_admit("d", [("d1", 1, 100)], 1000)
    registry.delete_user("c")
    assert registry.kv_tier_bytes("c") == 0 and registry.kv_tier_bytes("d") == 100
    if isinstance(registry, RedisRegistry):  # nothing of c's books is left in Redis
        assert not [k for k in registry.user_keys("c") if registry.r.exists(k) and "kvtier" in k]


def test_a_flood_past_its_share_removes_only_its_own_oldest_kv(mooncake, redis_url):
    """Tenant A writes 20 times its share into a real Mooncake Store through the pool's write sequence (book and
    make room, then put): B's objects are all still there and read back whole, A's oldest are the ones gone, A's
    booked bytes stay within the cap. Without the share (share None) A's oldest stay: nothing bounds A."""
    fp = "c" * 16
    store = ClusterStore(ClusterConfig.from_dict(mooncake.config), fp)
    assert store.wait_available(60)
    raw = raw_client(mooncake.config)
    registry = RedisRegistry(redis_url, prefix=f"kvflood-{time.time_ns()}:")
    try:
        facts = [make_fact(64, seed=i) for i in range(60)]
        size = facts[0].nbytes
        cap = 3 * size
        share = TierShare(registry, store, cap)

        def write(user, i, fact):
            share.make_room(user, [(f"{user}{i}", 1, fact.nbytes)])
            assert store.put_many(user, [(kv_id(f"{user}{i}", 1), fact)]) == [True]

        for i in range(2):
            write("b", i, facts[i])
        for i in range(60):  # the flood: 60 facts, 20 caps
            write("a", i, facts[i])
        assert share.counters["share_removed"] == 57 and registry.kv_tier_bytes("a") == cap
        assert registry.kv_tier_bytes("b") == 2 * size
        deadline = time.monotonic() + 20  # a remove runs again after a read lease; none here, but be fair
        while time.monotonic() < deadline and raw.is_exist(store.key("a", kv_id("a0", 1))) != 0:
            time.sleep(0.2)
        exist = raw.batch_is_exist([store.key("a", kv_id(f"a{i}", 1)) for i in range(60)])
        assert exist == [0] * 57 + [1] * 3  # A's oldest went, its newest three are there
        got = store.read("b", [kv_id("b0", 1), kv_id("b1", 1)])
        assert all(f is not None for f in got.facts)
        assert [pack(fp, "b", kv_id(f"b{i}", 1), f) for i, f in enumerate(got.facts)] == [
            pack(fp, "b", kv_id(f"b{i}", 1), facts[i]) for i in range(2)]
    finally:
        raw.close()
        registry.close()
        store.close()
