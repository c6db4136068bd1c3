"""The cluster KV tier (inferscale_core/cluster_store.py) on a real Mooncake Store on 127.0.0.1: bit-exact round
trips, fingerprints that keep models apart, removes that really remove, and a store that is away is a miss."""
from __future__ import annotations

import json
import logging
import struct
import time
import warnings

import pytest
import torch
from support.fact_store import D, H, L, assert_same, make_fact
from support.mooncake_fixture import raw_client

from inferscale_core.cluster_store import P2P_METADATA, ClusterConfig, ClusterStore, kv_fingerprint, pack, unpack
from inferscale_core.types import EncodedFact
from inferscale_server.local_processes import free_port

FP_A, FP_B = "a" * 16, "b" * 16


@pytest.fixture(scope="module")
def tier(mooncake):
    s = ClusterStore(ClusterConfig.from_dict(mooncake.config), FP_A)
    assert s.wait_available(60)
    yield s
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(tier, dtype):
    user = f"alice-{dtype}"  # objects are immutable: another dtype under the same key would not replace it
    facts = {f"f{i}@v1": make_fact(5 + i, dtype=dtype, seed=i) for i in range(3)}
    assert tier.put_many(user, list(facts.items())) == [True] * 3
    got = tier.get_many(user, list(facts))
    for want, have in zip(facts.values(), got):
        assert have is not None
        assert_same(want, have)
    assert have.k_pre.is_contiguous() and have.token_ids.dtype == torch.int64
    assert_same(tier.get_many(user, ["f2@v1"])[0], facts["f2@v1"])  # read again: the same bytes


def test_writes_and_reads_larger_than_the_transfer_buffer(mooncake):
    """A user's facts (AddFacts of 100+) or a request's k facts can take more than the client's transfer buffer,
    where Mooncake stages a batch: a put_batch over it fails whole, a get_batch reads only what fits. Both are cut
    into batches (and reads repeated), so every fact is stored and read; a fact over the buffer alone is refused
    by itself, and the store stays up for the others."""
    from inferscale_core.cluster_store import BUFFER_SHARE

    buffer = 1 << 20
    s = ClusterStore(ClusterConfig.from_dict({**mooncake.config, "buffer_bytes": buffer}), FP_A)
    assert s.wait_available(60)
    try:
        facts = {f"f{i}@v1": make_fact(100, seed=i) for i in range(40)}  # 40 x 38 KB: 1.5 buffers
        assert sum(len(pack(FP_A, "big", k, f)) for k, f in facts.items()) > 1.4 * buffer
        assert s.put_many("big", list(facts.items())) == [True] * 40
        got = s.get_many("big", list(facts))
        for want, have in zip(facts.values(), got):
            assert have is not None
            assert_same(want, have)
        huge = make_fact(int(buffer * BUFFER_SHARE) // (2 * 4 * 3 * 2 * 8) + 1, seed=99)
        assert s.put_many("big", [("huge@v1", huge), ("small@v1", make_fact(3))]) == [False, True]
        assert s.available and s.counters["put_failures"] == 1 and s.counters["errors"] == 0
        got = s.read("big", ["f0@v1", "huge@v1", "f39@v1"])
        assert [f is not None for f in got.facts] == [True, False, True]
        assert got.unreadable == [False, False, False]  # read, absent, read: none listed but unread
    finally:
        s.close()


def test_a_read_whose_rounds_outlive_the_lease_is_read_in_smaller_rounds():
    """Mooncake fails every object of a round whose transfer ends after the read lease (LEASE_EXPIRED, -707): seen on
    a loaded machine, where a 48 MB round outlived the 0.5 s lease and the request's whole memory was recomputed.
    Here the lease is 10 ms: one 23 MB round outlives it, one 0.4 MB object does not. Every fact is read, in halved
    rounds, and the reader keeps the smaller rounds for its next read."""
    from inferscale_server.local_mooncake import local_mooncake

    with local_mooncake(segment_bytes=256 << 20, lease_ms=10) as m:
        s = ClusterStore(ClusterConfig.from_dict(m.config), FP_A)
        assert s.wait_available(60)
        try:
            facts = {f"r{i}@v1": make_fact(1000, seed=70 + i) for i in range(60)}  # 60 x 392 KB, one round
            assert s.put_many("slow", list(facts.items())) == [True] * 60
            ids = list(facts)
            got = s.get_many("slow", ids)
            assert all(f is not None and same_bits(f, facts[kv]) for f, kv in zip(got, ids))
            assert s.counters["read_rounds_halved"] >= 1 and s.read_round_bytes < s.read_buffer.limit
            kept = s.read_round_bytes
            rounds: list[tuple[int, int]] = []  # each round of the next read: its bytes, its largest object's
            read_round = s._read_round

            def recorded(client, user_id, kv_ids, keys, sizes, batch, keep, out):
                rounds.append((sum(sizes[i] for i in batch), max(sizes[i] for i in batch)))
                return read_round(client, user_id, kv_ids, keys, sizes, batch, keep, out)

            s._read_round = recorded
            assert all(f is not None for f in s.get_many("slow", ids))
            # Smaller rounds from the start: the same read's first round no larger than what the first read left (or
            # one object, when that is less), which is less than the one round it began with (a machine loaded by
            # other tests may halve the rounds further; how often is not what this checks).
            first_bytes, largest = rounds[0]
            assert first_bytes <= max(kept, largest) and kept < sum(facts[kv].nbytes for kv in ids)
            assert s.counters["errors"] == 0 and s.counters["misses"] == 0
        finally:
            s.close()


def test_the_object_is_self_describing_and_checked():
    f = make_fact(4, dtype=torch.bfloat16)
    head, back = unpack(pack(FP_A, "u", "x@v2", f))
    assert head["fingerprint"] == FP_A and head["user_id"] == "u" and head["kv_id"] == "x@v2"
    assert head["dtype"] == "bfloat16" and head["shape"] == list(f.k_pre.shape)
    assert_same(f, back)
    with pytest.raises(ValueError, match="does not match its header"):
        unpack(pack(FP_A, "u", "x@v2", f)[:-1])
    with pytest.raises(ValueError, match="not an InferScale KV object"):
        unpack(b"garbage" * 10)


def test_another_fingerprint_user_or_version_is_a_miss(tier, mooncake):
    f = make_fact(6, seed=7)
    assert tier.put_many("bob", [("cat@v1", f)]) == [True]
    other = ClusterStore(ClusterConfig.from_dict(mooncake.config), FP_B)  # another model / dtype / prefix
    assert other.wait_available(60)
    try:
        assert other.get_many("bob", ["cat@v1"]) == [None]
        assert tier.get_many("carol", ["cat@v1"]) == [None]     # another user's fact of the same id
        assert tier.get_many("bob", ["cat@v2"]) == [None]       # a version not written
        # A value under our key that holds another fact's KV (a bug, a collision) is a miss, never served.
        client = raw_client(mooncake.config)
        assert client.put(tier.key("bob", "dog@v1"), pack(FP_A, "bob", "cat@v1", f)) == 0
        client.close()
        assert tier.get_many("bob", ["dog@v1"]) == [None]
    finally:
        other.close()


def same_bits(a, b) -> bool:
    """Bit for bit (NaN payloads and signed zeros included), not numerically."""
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.contiguous().view(torch.uint8),
                                                                         y.contiguous().view(torch.uint8))
               for x, y in ((a.token_ids, b.token_ids), (a.k_pre, b.k_pre), (a.v, b.v)))


def test_a_read_lands_in_the_registered_buffer_and_is_what_the_writer_put(tier):
    """Mooncake writes the objects into the store's registered read buffer (batch_get_into): `keep` is handed views
    of that memory, bit for bit the writer's tensors, and the buffer is reused by the next read (no new
    registration, same address)."""
    facts = {f"z{i}@v1": make_fact(7 + i, dtype=dt, seed=20 + i)
             for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float16])}
    facts["z0@v1"].k_pre[0, 0, 0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    assert tier.put_many("zed", list(facts.items())) == [True] * 3
    seen = {}

    def keep(kv, fact):
        base, end = tier.read_buffer.memory.data_ptr(), tier.read_buffer.memory.data_ptr() + tier.read_buffer.limit
        seen[kv] = all(base <= t.data_ptr() < end for t in (fact.token_ids, fact.k_pre, fact.v))
        return same_bits(fact, facts[kv])

    got = tier.read("zed", list(facts), keep)
    assert got.facts == [True] * 3 and got.unreadable == [False] * 3
    assert seen == {kv: True for kv in facts}  # views of the registered buffer: no copy before `keep`
    registrations, address = tier.read_buffer.registrations, tier.read_buffer.memory.data_ptr()
    for _ in range(3):
        copies = tier.get_many("zed", list(facts))  # the default keep: a private copy
        assert all(same_bits(c, facts[kv]) for c, kv in zip(copies, facts))
        assert all(c.k_pre.data_ptr() != address for c in copies)
    assert (tier.read_buffer.registrations, tier.read_buffer.memory.data_ptr()) == (registrations, address)


def test_a_read_larger_than_the_buffer_grows_it_and_one_larger_than_its_limit_takes_rounds(mooncake):
    from inferscale_core.cluster_store import BUFFER_SHARE, RegisteredBuffer

    mib = RegisteredBuffer.GRAIN_BYTES
    s = ClusterStore(ClusterConfig.from_dict({**mooncake.config, "buffer_bytes": 4 * mib}), FP_A)
    assert s.wait_available(60)
    try:
        buf = s.read_buffer
        assert buf.limit == int(4 * mib * BUFFER_SHARE) and buf.memory is None  # nothing before the first read
        facts = {f"g{i}@v1": make_fact(1000, seed=40 + i) for i in range(12)}  # 12 x 392 KB
        assert s.put_many("grow", list(facts.items())) == [True] * 12
        ids = list(facts)

        def read_exactly(n):
            assert all(same_bits(f, facts[kv]) for f, kv in zip(s.get_many("grow", ids[:n]), ids[:n]))
            return buf.registrations, buf.memory.numel()

        assert read_exactly(1) == (1, mib)  # one fact: one grain
        assert read_exactly(2) == (1, mib)  # still fits: reused
        assert read_exactly(4) == (2, 2 * mib)  # 1.6 MB: grown
        assert sum(len(pack(FP_A, "grow", kv, f)) for kv, f in facts.items()) > 1.4 * buf.limit
        # Over the limit: read in rounds, through a buffer that grows to the limit and no further.
        assert read_exactly(12) == (3, buf.limit)
        assert read_exactly(12) == (3, buf.limit) and read_exactly(3) == (3, buf.limit)
        assert s.counters["errors"] == 0
    finally:
        s.close()
    assert buf.memory is None  # unregistered with the client


def documented_object(fingerprint: str, user_id: str, kv_id: str, fact) -> bytes:
    """The object format as documented (module docstring, docs/deploy.md), built here apart from the code that
    writes it: magic, the JSON header's length (uint32 LE), the header, token ids (int64), K, V, raw bytes."""
    head = json.dumps({"format": "inferscale-kv-v1", "fingerprint": fingerprint, "user_id": user_id, "kv_id": kv_id,
                       "dtype": str(fact.k_pre.dtype).removeprefix("torch."), "shape": list(fact.k_pre.shape)})
    raw = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in (fact.token_ids.to(torch.int64), fact.k_pre,
                                                                         fact.v)]
    return b"ISKV1\n" + struct.pack("<I", len(head.encode())) + head.encode() + b"".join(raw)


def test_objects_written_from_the_write_buffer_are_the_format_byte_for_byte(tier, mooncake):
    """put_many packs each object into its registered write buffer and Mooncake sends it from there: the bytes
    Mooncake holds are the documented format exactly (every dtype, NaN payloads and signed zeros, keys that were a
    non-contiguous view, int32 token ids), `pack` gives the same bytes, and the reader reads them back bit for bit."""
    facts = {f"w{i}@v1": make_fact(6 + i, dtype=dt, seed=60 + i)
             for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float16])}
    facts["w0@v1"].k_pre[0, 0, 0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    strided = make_fact(5, seed=70)
    facts["w3@v1"] = EncodedFact(strided.token_ids.to(torch.int32),
                                 strided.k_pre.transpose(1, 2).contiguous().transpose(1, 2), strided.v)
    assert not facts["w3@v1"].k_pre.is_contiguous()
    assert tier.put_many("wendy", list(facts.items())) == [True] * 4
    assert tier.write_buffer.registrations >= 1
    client = raw_client(mooncake.config)
    try:
        for kv, fact in facts.items():
            want = documented_object(FP_A, "wendy", kv, fact)
            assert client.get(tier.key("wendy", kv)) == want
            assert pack(FP_A, "wendy", kv, fact) == want
    finally:
        client.close()
    got = tier.get_many("wendy", list(facts))
    assert all(have is not None and same_bits(have, EncodedFact(want.token_ids.to(torch.int64), want.k_pre, want.v))
               for have, want in zip(got, facts.values()))


def test_the_write_buffer_is_registered_once_and_reused(mooncake):
    """Like the read buffer: registered at the first write, reused by writes of other users of the same size (no
    new registration, the same memory), grown when a round needs more, never past its limit (larger writes go in
    rounds), unregistered at close; what went through it reads back exact."""
    from inferscale_core.cluster_store import RegisteredBuffer

    mib = RegisteredBuffer.GRAIN_BYTES
    s = ClusterStore(ClusterConfig.from_dict({**mooncake.config, "buffer_bytes": 4 * mib}), FP_A)
    assert s.wait_available(60)
    buf = s.write_buffer
    facts = {f"p{i}@v1": make_fact(1000, seed=80 + i) for i in range(12)}  # 12 x 392 KB, 1.6 limits
    ids = list(facts)
    try:
        assert buf.limit == 3 * mib and buf.memory is None

        def write(user, n):
            assert s.put_many(user, [(kv, facts[kv]) for kv in ids[:n]]) == [True] * n
            return buf.registrations, buf.memory.numel(), buf.memory.data_ptr()

        first = write("p-a", 2)
        assert first[:2] == (1, mib)
        assert write("p-b", 2) == first  # another user, same size: the same registered memory
        assert write("p-c", 4)[:2] == (2, 2 * mib)  # 1.6 MB: grown
        assert write("p-d", 12)[:2] == (3, buf.limit)  # over the limit: rounds, grown to the limit and no further
        assert write("p-e", 12)[:2] == (3, buf.limit) and write("p-f", 3)[:2] == (3, buf.limit)
        for user in ("p-a", "p-d", "p-f"):
            n = {"p-a": 2, "p-d": 12, "p-f": 3}[user]
            assert all(same_bits(f, facts[kv]) for f, kv in zip(s.get_many(user, ids[:n]), ids[:n]))
        assert s.counters["errors"] == 0 and s.counters["put_failures"] == 0
    finally:
        s.close()
    assert buf.memory is None  # unregistered with the client


def test_a_refused_object_is_answered_per_key_and_a_dead_master_fails_the_put(tmp_path):
    """Mooncake answers batch_put_from per object. One object larger than every segment (the master has no room
    for it) is refused alone: the objects beside it in the same round are stored and reported stored, and, as after
    any failed call, the store counts as down until its probe answers. Then the master dies: a put is refused
    whole (the store down, misses at once after)."""
    from inferscale_server.local_mooncake import local_mooncake

    with local_mooncake(segment_bytes=16 << 20) as m:
        s = ClusterStore(ClusterConfig.from_dict({**m.config, "replicas": 1}), FP_A)  # buffer: 64 MiB, limit 48
        assert s.wait_available(60)
        try:
            small = {"s1@v1": make_fact(5, seed=1), "s2@v1": make_fact(4, seed=2, dtype=torch.bfloat16)}
            big = make_fact((20 << 20) // (2 * L * H * D * 4), seed=3)  # 20 MiB: under the buffer, over the segment
            assert s.put_many("u", [("s1@v1", small["s1@v1"]), ("big@v1", big), ("s2@v1", small["s2@v1"])]) == [
                True, False, True]
            # Down, as after any failed call, until the probe answers (at once here: the master is up).
            assert (s.counters["puts"], s.counters["put_failures"], s.counters["errors"]) == (2, 1, 1)
            assert s.wait_available(60)
            got = s.get_many("u", ["s1@v1", "big@v1", "s2@v1"])
            assert got[1] is None and same_bits(got[0], small["s1@v1"]) and same_bits(got[2], small["s2@v1"])
            m.stop_master()
            assert s.put_many("u", [("t1@v1", make_fact(3)), ("t2@v1", make_fact(3))]) == [False, False]
            assert not s.available and s.counters["errors"] >= 2 and s.counters["put_failures"] == 3
            t = time.monotonic()
            assert s.put_many("u", [("t1@v1", make_fact(3))]) == [False]
            assert time.monotonic() - t < 1.0
        finally:
            s.close()


def test_the_read_buffer_is_pinned_for_a_cuda_reader_only(mooncake):
    """On a CUDA worker the read buffer is page-locked, so the copy from it to the device is a DMA; any other
    device keeps ordinary memory, quietly (a CPU-only torch cannot pin). Asking for CUDA where torch sees none is
    refused by name. The CUDA branch runs only on a machine with CUDA."""
    fact = make_fact(4, seed=90)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = ClusterStore(ClusterConfig.from_dict(mooncake.config), FP_A, reads_to=torch.device("cpu"))
        try:
            assert s.wait_available(60) and s.put_many("pin", [("f@v1", fact)]) == [True]
            assert same_bits(s.get_many("pin", ["f@v1"])[0], fact)
            assert not s.read_buffer.pinned and not s.read_buffer.memory.is_pinned()
        finally:
            s.close()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="reads_to is cuda, but torch sees no CUDA device"):
            ClusterStore(ClusterConfig.from_dict(mooncake.config), FP_A, reads_to="cuda")
        return
    s = ClusterStore(ClusterConfig.from_dict(mooncake.config), FP_A, reads_to="cuda:0")
    try:
        assert s.wait_available(60) and same_bits(s.get_many("pin", ["f@v1"])[0], fact)
        assert s.read_buffer.pinned and s.read_buffer.memory.is_pinned()
    finally:
        s.close()


def test_misses_and_foreign_or_corrupt_objects_in_one_read(tier, mooncake):
    """In one read: a fact, an absent one, another fact's object under this key, bytes that are no InferScale
    object, an object that lies about its size, and a fact again. Each bad one is a plain miss (never served, not
    `unreadable`: it was read), and the good ones around it are exact."""
    good = {"a@v1": make_fact(5, seed=1), "e@v1": make_fact(9, seed=2, dtype=torch.bfloat16)}
    assert tier.put_many("mix", list(good.items())) == [True, True]
    client = raw_client(mooncake.config)
    try:
        assert client.put(tier.key("mix", "c@v1"), pack(FP_A, "mix", "a@v1", good["a@v1"])) == 0  # a's KV
        assert client.put(tier.key("mix", "d@v1"), b"garbage" * 100) == 0
        assert client.put(tier.key("mix", "t@v1"), pack(FP_A, "mix", "t@v1", make_fact(4))[:-8]) == 0  # truncated
    finally:
        client.close()
    before = dict(tier.counters)
    ids = ["a@v1", "b@v1", "c@v1", "d@v1", "t@v1", "e@v1"]
    got = tier.read("mix", ids)
    assert [f is not None for f in got.facts] == [True, False, False, False, False, True]
    assert same_bits(got.facts[0], good["a@v1"]) and same_bits(got.facts[5], good["e@v1"])
    assert got.unreadable == [False] * 6
    assert tier.counters["hits"] - before["hits"] == 2 and tier.counters["misses"] - before["misses"] == 4
    assert tier.available and tier.counters["errors"] == before["errors"]


def test_an_error_in_keep_is_the_callers_and_the_store_stays_up(tier):
    assert tier.put_many("keeper", [("k@v1", make_fact(3))]) == [True]

    def keep(kv, fact):
        raise OSError("the caller's own failure")

    with pytest.raises(OSError, match="the caller's own failure"):
        tier.read("keeper", ["k@v1"], keep)
    assert tier.available and tier.get_many("keeper", ["k@v1"])[0] is not None


def test_fingerprint_names_model_dtype_and_prefix(tmp_path):
    (tmp_path / "m1").mkdir()
    (tmp_path / "m1" / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "m2").mkdir()
    (tmp_path / "m2" / "config.json").write_text('{"hidden_size": 128}')
    base = kv_fingerprint(tmp_path / "m1", torch.float32, [1, 2, 3])
    assert base == kv_fingerprint(str(tmp_path / "m1"), torch.float32, (1, 2, 3))
    assert len({base, kv_fingerprint(tmp_path / "m2", torch.float32, [1, 2, 3]),
                kv_fingerprint(tmp_path / "m1", torch.bfloat16, [1, 2, 3]),
                kv_fingerprint(tmp_path / "m1", torch.float32, [1, 2])}) == 4


def test_remove_really_removes(tier, mooncake):
    client = raw_client(mooncake.config)
    try:
        facts = [(f"dog@v{v}", make_fact(3, seed=v)) for v in (1, 2, 3)] + [("owl@v1", make_fact(3, seed=9))]
        assert tier.put_many("dave", facts) == [True] * 4
        tier.get_many("dave", ["dog@v1"])  # a read starts a lease: the remove must still happen
        other = ClusterStore(ClusterConfig.from_dict(mooncake.config), FP_B)
        assert other.wait_available(60)
        other.put_many("dave", [("dog@v1", make_fact(3, seed=1))])
        other.close()
        keys = {kv: tier.key("dave", kv) for kv, _ in facts}
        tier.remove_versions("dave", "dog", below=3)  # an update to v3: v1 and v2 go, under every fingerprint
        time.sleep(mooncake.config["lease_s"] + 0.6)
        assert [client.is_exist(keys[k]) for k in ("dog@v1", "dog@v2", "dog@v3", "owl@v1")] == [0, 0, 1, 1]
        assert client.get(ClusterStore(ClusterConfig.from_dict(mooncake.config), FP_B).key("dave", "dog@v1")) == b""
        tier.remove_user("dave")  # DeleteUser
        time.sleep(mooncake.config["lease_s"] + 0.6)
        assert [client.is_exist(k) for k in keys.values()] == [0, 0, 0, 0]
        assert [client.get(k) for k in keys.values()] == [b""] * 4  # the bytes, not only the books
        assert tier.get_many("dave", list(keys)) == [None] * 4
    finally:
        client.close()


def test_a_read_between_two_remove_attempts_does_not_keep_the_object(tier, mooncake):
    """Mooncake answers 0 to a remove whose only objects are leased (measured): a read that starts after the
    first attempt (a request that looked the facts up before the delete) must not end the retries."""
    client = raw_client(mooncake.config)
    lease_s = mooncake.config["lease_s"]
    try:
        assert tier.put_many("eve", [("cat@v1", make_fact(3))]) == [True]
        key = tier.key("eve", "cat@v1")
        assert tier.get_many("eve", ["cat@v1"])[0] is not None  # leased
        t0 = time.monotonic()
        tier.remove_user("eve")  # refused now; again after the lease (lease_s + 0.2)
        time.sleep(lease_s * 0.7)
        tier.get_many("eve", ["cat@v1"])  # a new lease over the second attempt (None if that ran already)
        time.sleep(max(0.0, t0 + 3 * lease_s + 1.0 - time.monotonic()))  # past the third attempt
        assert client.is_exist(key) == 0 and client.get(key) == b""
    finally:
        client.close()


def test_the_master_listens_on_loopback_only_and_runs_no_metadata_server(tier, mooncake):
    """Segments find each other peer to peer (P2PHANDSHAKE): the master's listeners are its RPC port and its
    metrics port, both on 127.0.0.1 (an HTTP metadata server would add one that Mooncake binds to 0.0.0.0
    whatever --http_metadata_server_host says), and the tier works through it (the fixture's `tier`)."""
    import psutil

    assert tier.put_many("u", [("f@v1", make_fact(2))]) == [True] and tier.get_many("u", ["f@v1"])[0] is not None
    listening = [c.laddr for c in psutil.Process(mooncake.master.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    rpc_port = int(mooncake.config["master"].rpartition(":")[2])
    assert rpc_port in {a.port for a in listening} and len(listening) == 2, listening
    assert {a.ip for a in listening} == {"127.0.0.1"}, listening
    assert mooncake.config["metadata"] == P2P_METADATA


def test_config_is_validated():
    assert ClusterConfig.from_dict({}) is None
    with pytest.raises(ValueError, match="unknown cluster_store keys \\['mastr'\\]"):
        ClusterConfig.from_dict({"mastr": "x", "metadata": "y"})
    with pytest.raises(ValueError, match="cluster_store.master must be set"):
        ClusterConfig.from_dict({"metadata": "http://x/metadata"})
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="cluster_store.replicas must be an integer >= 1"):
            ClusterConfig.from_dict({"master": "x:1", "metadata": "http://x/metadata", "replicas": bad})
    assert ClusterConfig.from_dict({"master": "x:1", "metadata": "http://x/metadata"}).replicas == 2
    assert ClusterConfig.from_dict({"master": "x:1"}).metadata == P2P_METADATA  # no metadata server by default
    for bad in ("", None, 5):
        with pytest.raises(ValueError, match="cluster_store.metadata must be 'P2PHANDSHAKE'"):
            ClusterConfig.from_dict({"master": "x:1", "metadata": bad})
    assert ClusterConfig.from_dict({"master": "x:1"}).warm_at_write is True
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="cluster_store.warm_at_write must be true or false"):
            ClusterConfig.from_dict({"master": "x:1", "warm_at_write": bad})


def _serve_args(*argv: str):
    """`inferscale serve ARGV`'s parsed flags, from serve's own parser (nothing starts)."""
    import argparse

    from inferscale_server.cli import add_commands

    parser = argparse.ArgumentParser(prog="inferscale")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_serve_flags_name_the_master_and_default_to_peer_to_peer_metadata():
    """`inferscale serve --mooncake-master`: no metadata server unless --mooncake-metadata names one."""
    from inferscale_server.cli import cluster_store_settings

    def settings(*argv):
        return cluster_store_settings(_serve_args(*argv))

    pool = ("--mooncake-pool-gib", "1")
    assert settings() == {}
    assert settings("--mooncake-master", "10.0.0.5:50051", *pool) == {"master": "10.0.0.5:50051", "pool_bytes": 1 << 30}
    assert ClusterConfig.from_dict(settings("--mooncake-master", "10.0.0.5:50051", *pool)).metadata == P2P_METADATA
    assert settings("--mooncake-master", "m:1", *pool, "--mooncake-metadata", "http://m:8080/metadata") == {
        "master": "m:1", "pool_bytes": 1 << 30, "metadata": "http://m:8080/metadata"}
    for bad in (("--mooncake-master", "m", *pool), ("--mooncake-metadata", "http://m:8080/metadata")):
        with pytest.raises(SystemExit, match="--mooncake-m"):
            settings(*bad)


def test_serve_bounds_each_users_share_of_an_external_store(capsys):
    """`inferscale serve --mooncake-master` gets the chart's rule (issue 31): the pool's size is required with the
    master, so every user's KV in that store is bounded to pool / (2 copies x 16 tenants); a master without it, a
    pool without a master, or a pool that is not a number above 0 is refused with both flags named, before
    anything starts (the settings are read first in serve)."""
    from inferscale_server.cli import _cluster_line, cluster_store_settings

    args = _serve_args("--mooncake-master", "10.0.0.5:50051", "--mooncake-pool-gib", "16")
    config = cluster_store_settings(args)
    assert config["pool_bytes"] == 16 << 30
    assert ClusterConfig.from_dict(config).user_cap() == (16 << 30) // (2 * 16)  # 512 MiB, as the chart's share
    assert _cluster_line(args, config) == ("Mooncake Store, master 10.0.0.5:50051 (pool 16 GiB; each user's KV at "
                                           "most 512 MiB)")
    assert cluster_store_settings(_serve_args("--mooncake-master", "m:1", "--mooncake-pool-gib", "0.5"))[
        "pool_bytes"] == 1 << 29
    for argv in (["--mooncake-master", "10.0.0.5:50051"], ["--mooncake-pool-gib", "16"],
                 ["--local-mooncake", "--mooncake-master", "10.0.0.5:50051", "--mooncake-pool-gib", "16"],
                 ["--local-mooncake", "--mooncake-pool-gib", "16"]):
        with pytest.raises(SystemExit) as refused:
            cluster_store_settings(_serve_args(*argv))
        assert "--mooncake-pool-gib" in str(refused.value) and "--mooncake-master" in str(refused.value), argv
    for bad in ("0", "-2", "nan", "inf", "lots"):  # the parser refuses the number, naming the flag
        with pytest.raises(SystemExit):
            _serve_args("--mooncake-master", "10.0.0.5:50051", "--mooncake-pool-gib", bad)
        assert "--mooncake-pool-gib" in capsys.readouterr().err, bad


def test_serve_refuses_a_master_without_its_pool_before_anything_starts():
    """The refusal comes before the registry is reached, Ray starts or a store starts: _serve reads the cluster
    tier's flags first (a Redis URL nobody listens on would otherwise be the error reported)."""
    import contextlib

    import inferscale_server.cli as cli

    args = _serve_args("--mooncake-master", "10.0.0.5:50051", "--redis-url", "redis://127.0.0.1:1/0")
    with contextlib.ExitStack() as stack, pytest.raises(SystemExit, match="--mooncake-pool-gib"):
        cli._serve(args, stack)


def test_serve_starts_a_mooncake_store_when_asked():
    """`inferscale serve --local-mooncake` runs the cluster's KV path on one machine: a master on 127.0.0.1 and a
    segment (stopped with serve), where facts written are read back; without the flag it starts none."""
    import contextlib
    import socket
    from types import SimpleNamespace

    from inferscale_server.cli import _cluster_line, local_cluster_tier

    args = SimpleNamespace(local_mooncake=False, mooncake_segment_gib=0.25)
    with contextlib.ExitStack() as stack:
        assert local_cluster_tier(args, stack) == {}
    args.local_mooncake = True
    with contextlib.ExitStack() as stack:
        config = local_cluster_tier(args, stack)
        assert config["master"].startswith("127.0.0.1:") and config["metadata"] == P2P_METADATA
        assert args.local_mooncake_gib == 0.25
        # each user's share of it, as the chart's rule has it: pool / (1 copy x 16 tenants), and serve says so
        assert config["pool_bytes"] == 1 << 28 and ClusterConfig.from_dict(config).user_cap() == 16 << 20
        assert "each user's KV at most 16 MiB" in _cluster_line(args, config)
        store = ClusterStore(ClusterConfig.from_dict(config), FP_A)
        try:
            assert store.wait_available(60)
            fact = make_fact(6, seed=5)
            assert store.put_many("alice", [("f@v1", fact)]) == [True]
            assert_same(store.get_many("alice", ["f@v1"])[0], fact)
        finally:
            store.close()
    host, port = config["master"].split(":")
    with socket.socket() as s:  # the master is gone with serve
        assert s.connect_ex((host, int(port))) != 0


def test_a_store_that_is_away_is_a_miss_at_once():
    """Nothing listens: every call answers at once (the connect runs in a background thread; Mooncake's own
    setup retries for ~90 s) and a delete is kept until the store is reachable."""
    from inferscale_server.local_processes import free_port

    port = free_port()
    s = ClusterStore(ClusterConfig(master=f"127.0.0.1:{port}", retry_s=60), FP_A)
    try:
        t = time.monotonic()
        assert s.put_many("u", [("f@v1", make_fact(2))]) == [False]
        assert s.get_many("u", ["f@v1"]) == [None]
        s.remove_user("u")
        assert time.monotonic() - t < 1.0 and not s.available
        assert s._pending_removes == {s._user_pattern("u")}
    finally:
        s.close()


def test_removes_kept_while_the_store_was_away_survive_a_restart(tier, mooncake, tmp_path):
    """Issue 31: a delete that reached a process while the store was away is kept in its pending file (an engine
    replica's disk folder: its tombstone cursor has moved past the delete); the process restarted in that folder
    does it once the store answers, and the file is emptied."""
    from inferscale_server.local_processes import free_port

    pending = tmp_path / "cluster-removes.pending"
    assert tier.put_many("gone", [("f@v1", make_fact(3))]) == [True]
    away = ClusterStore(ClusterConfig(master=f"127.0.0.1:{free_port()}", retry_s=60), FP_A, pending_file=pending)
    try:
        away.remove_user("gone")
        assert pending.read_text().splitlines() == [away._user_pattern("gone")]
    finally:
        away.close()  # the process ends with the delete not done
    assert tier.get_many("gone", ["f@v1"])[0] is not None
    restarted = ClusterStore(tier.config, FP_A, pending_file=pending)
    try:
        assert restarted.pending_removes() == {restarted._user_pattern("gone")}
        restarted.start()
        deadline = time.monotonic() + 60
        while restarted.pending_removes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not restarted.pending_removes() and pending.read_text() == ""
        time.sleep(mooncake.config["lease_s"] + 0.6)  # the read above holds a lease: the remove's retry ends it
        client = raw_client(mooncake.config)
        try:
            assert client.is_exist(tier.key("gone", "f@v1")) == 0
        finally:
            client.close()
    finally:
        restarted.close()


def test_master_killed_reads_become_misses_fast(tier, mooncake):  # last: kills the master
    assert tier.put_many("erin", [("f@v1", make_fact(4))]) == [True]
    mooncake.stop_master()
    first = tier.get_many("erin", ["f@v1"])  # Mooncake's own RPC timeout (~4 s here) on the first call
    t = time.monotonic()
    for _ in range(20):
        assert tier.get_many("erin", ["f@v1"]) == [None]
        assert tier.put_many("erin", [("g@v1", make_fact(4))]) == [False]
    assert first == [None] and time.monotonic() - t < 1.0  # then down: misses at once, no RPC
    assert tier.counters["errors"] >= 1


def test_the_replicas_resident_kv_is_bounded_lru():
    from inferscale_server.engine_replica import ResidentKV

    r = ResidentKV(budget_bytes=300)
    assert r.add("a", [("f@v1", 100), ("g@v1", 100)]) == []
    r.touch("a", ["f@v1"])                                  # g is now the least recently used
    assert r.add("b", [("h@v1", 150)]) == [("a", "g@v1")]   # over 300: g leaves, never h (just added)
    assert (r.bytes, r.count()) == (250, 2) and r.has("a", "f@v1") and not r.has("a", "g@v1")
    assert r.add("c", [("big@v1", 1000)]) == [("b", "h@v1"), ("a", "f@v1")]  # alone over budget: kept, the rest go
    # (the user holding the most first: b's 150 bytes before a's 100)
    # unknown size (found in the disk tier) counts as the average fact (1000): big leaves for it
    assert r.add("c", [("disk@v1", None)]) == [("c", "big@v1")] and r.bytes == 1000
    r.drop_user("c")
    assert (r.bytes, r.count()) == (0, 0)
    with pytest.raises(ValueError, match="KV budget"):
        ResidentKV(-1)


def test_one_user_naming_ever_new_facts_recycles_its_own_share():
    """Over budget, the user holding the most pays first: a tenant whose requests name ever new facts evicts its
    own, not the KV of the users beside it; alone, a user may still use the whole budget."""
    from inferscale_server.engine_replica.books import ResidentKV

    r = ResidentKV(budget_bytes=1000)
    for user in ("a", "b", "c"):
        assert r.add(user, [(f"{user}1@v1", 100), (f"{user}2@v1", 100)]) == []
    evicted = []
    for i in range(50):  # the flood: 50 new facts of 100 bytes
        evicted += r.add("flood", [(f"x{i}@v1", 100)])
    assert {u for u, _ in evicted} == {"flood"} and r.bytes <= 1000
    assert all(r.has(u, f"{u}{n}@v1") for u in "abc" for n in (1, 2))
    assert r.user_bytes("flood") == 400 and r.user_bytes("a") == 200
    alone = ResidentKV(budget_bytes=1000)
    assert alone.add("solo", [(f"s{i}@v1", 100) for i in range(10)]) == []  # the whole budget, no one else
    assert alone.add("solo", [("s10@v1", 100)]) == [("solo", "s0@v1")]
    r.drop_user("flood")
    assert r.user_bytes("flood") == 0 and r.bytes == 600


def test_many_tenants_flooding_at_once_never_flush_a_quiet_tenants_resident_kv():
    """Eight tenants name ever new facts, in turns, beside a quiet user who holds less than any fair share (budget /
    users): the quiet user's KV stays, the flooders recycle theirs and end up with even shares. (With a fixed share
    of a quarter of the budget, nobody was over it and one LRU over all took the quiet user's facts, the oldest.)"""
    from inferscale_server.engine_replica.books import ResidentKV

    r = ResidentKV(budget_bytes=1000)
    r.add("quiet", [("q1@v1", 40), ("q2@v1", 40)])
    evicted = []
    for i in range(30):
        for n in range(8):
            evicted += r.add(f"flood{n}", [(f"x{i}@v1", 50)])
    assert r.has("quiet", "q1@v1") and r.has("quiet", "q2@v1") and r.bytes <= 1000
    assert {u for u, _ in evicted} == {f"flood{n}" for n in range(8)}
    assert {r.user_bytes(f"flood{n}") for n in range(8)} <= {100, 150}  # even: one fact apart at most


def test_a_local_store_whose_first_start_fails_starts_again_on_other_ports(monkeypatch, caplog):
    """local_mooncake (`inferscale serve --local-mooncake`, the tests' store) makes a failed start once more on other
    ports. The first master's port is taken here (bound by this test, not listening): that master exits at once;
    the error logged names it and carries its log's end; the second start serves puts and gets."""
    import socket

    import inferscale_server.local_mooncake as lm

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # bound, not listening: a connect is refused, a bind fails
    taken_port = taken.getsockname()[1]
    ports = iter([taken_port])
    monkeypatch.setattr(lm, "free_port", lambda: next(ports, None) or free_port())
    try:
        with caplog.at_level(logging.WARNING, logger=lm.__name__), lm.local_mooncake(segment_bytes=16 << 20) as m:
            s = ClusterStore(ClusterConfig.from_dict(m.config), FP_A)
            assert s.wait_available(60)
            try:
                fact = make_fact(3, seed=5)
                assert s.put_many("u", [("a@v1", fact)]) == [True]
                assert same_bits(s.get_many("u", ["a@v1"])[0], fact)
            finally:
                s.close()
    finally:
        taken.close()
    (warning,) = [r.getMessage() for r in caplog.records if "did not start" in r.getMessage()]
    assert f"mooncake_master did not start on port {taken_port} (exit 1)" in warning and "starting it again on other ports" in warning
    assert "the end of its log:\n" in warning and len(warning.split("the end of its log:\n")[1]) > 0
