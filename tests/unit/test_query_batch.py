"""Queries that wait for the retrieval replica's embedder are embedded together (services/retrieval.py
QueryBatcher): one call for a queue of queries, each caller gets its own row, a failure stays in its batch."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest
import torch

from inferscale_core.embedder import default_embedder
from inferscale_server.retrieval import QueryBatcher

QUERIES = ["what is my dog's name?", "where do I live?", "which city am I flying to next week?", "tea",
           "what does my sister do for a living, and where does she work?", "allergies", "favourite dessert",
           "when is my birthday?", "what instrument do I play?", "cats"]


class _Gated:
    """The real embedder behind a gate: the first call waits until the test opens it, so that the other
    queries queue meanwhile. Records the size of every call."""

    def __init__(self):
        self.embedder = default_embedder()
        self.sizes: list[int] = []
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.fail_next = False

    def __call__(self, texts):
        self.sizes.append(len(texts))
        self.entered.set()
        assert self.opened.wait(60), "the test never opened the gate"
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("embedder failed")
        return self.embedder.embed(texts)


def _wait_queued(batcher: QueryBatcher, n: int) -> None:
    deadline = time.monotonic() + 60
    while len(batcher._queue) < n:
        assert time.monotonic() < deadline, f"only {len(batcher._queue)} of {n} queries queued"
        time.sleep(0.01)


def _embed_all(batcher: QueryBatcher, gated: _Gated, texts: list[str]) -> list:
    """The first text alone, the rest while it holds the embedder; returns the futures in `texts` order."""
    with cf.ThreadPoolExecutor(len(texts)) as pool:
        first = pool.submit(batcher.embed, texts[0])
        assert gated.entered.wait(60)
        rest = [pool.submit(batcher.embed, t) for t in texts[1:]]
        _wait_queued(batcher, len(texts) - 1)
        gated.opened.set()
        futures = [first] + rest
        cf.wait(futures, timeout=120)
        return futures


def test_queries_that_wait_are_embedded_in_one_call_each_with_its_own_row():
    gated = _Gated()
    batcher = QueryBatcher(gated)
    futures = _embed_all(batcher, gated, QUERIES)
    assert gated.sizes == [1, len(QUERIES) - 1] and batcher.calls == 2
    alone = default_embedder().embed(QUERIES)  # same texts, one row each
    for q, f, row in zip(QUERIES, futures, alone):
        got = f.result()
        assert got.shape == row.shape
        # Its own row, not a neighbour's: closest to its own one-at-a-time embedding by far.
        assert torch.allclose(got, default_embedder().embed([q])[0], atol=1e-5), q
        assert int(torch.argmax(alone @ got)) == QUERIES.index(q)


def test_a_batch_holds_at_most_max_batch_queries():
    gated = _Gated()
    batcher = QueryBatcher(gated, max_batch=4)
    futures = _embed_all(batcher, gated, QUERIES)
    assert gated.sizes == [1, 4, 4, 1], gated.sizes
    assert all(f.result().shape == (gated.embedder.dim,) for f in futures)


def test_a_failed_call_fails_its_own_batch_only():
    gated = _Gated()
    gated.fail_next = True
    batcher = QueryBatcher(gated, max_batch=4)
    futures = _embed_all(batcher, gated, QUERIES[:6])
    assert gated.sizes == [1, 4, 1]
    with pytest.raises(RuntimeError, match="embedder failed"):
        futures[0].result()
    assert all(f.result().shape == (gated.embedder.dim,) for f in futures[1:])
    assert batcher.embed("one more").shape == (gated.embedder.dim,)  # still usable


def test_max_batch_must_be_positive():
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        QueryBatcher(lambda texts: texts, max_batch=0)


def test_queries_go_to_the_query_embedder_and_facts_to_the_fact_embedder():
    """RetrievalCore with a query embedder of its own (the deployment's bfloat16 copy): a search embeds its query
    there and nowhere else, the user's facts are embedded by the fact embedder (float32: what the registry stores
    for every replica), and the search still finds the fact the float32 query finds."""
    from inferscale_core.embedder import CallableEmbedder, Embedder
    from inferscale_server.registry import NewFact, open_registry
    from inferscale_server.retrieval import RetrievalCore

    seen: dict[str, list[str]] = {"facts": [], "queries": []}
    low = Embedder(dtype=torch.bfloat16)

    def recording(name, embed):
        return CallableEmbedder(lambda texts: seen[name].extend(texts) or embed(texts))

    registry = open_registry(None)
    core = RetrievalCore(registry, recording("facts", default_embedder().embed),
                         query_embedder=recording("queries", low.embed))
    dog, _ = registry.create("u", [NewFact("My dog is called Rex"), NewFact("I like green tea")])
    assert [f for f, _ in core.search("u", "what is my dog's name?", 1)] == [dog.fact_id]
    assert seen["facts"] == ["dimension probe", "My dog is called Rex", "I like green tea"]  # the probe: the index's width
    assert seen["queries"] == ["what is my dog's name?"]
    stored = torch.as_tensor(registry.get("u", dog.fact_id).embedding)
    torch.testing.assert_close(stored, default_embedder().embed(["My dog is called Rex"])[0], rtol=0, atol=1e-6)
    # embed_texts (Mem0's pipeline in the gateway embeds here): a query row from the query embedder, fact rows
    # from the fact embedder, equal to what a search and the index compute
    (as_query,) = core.embed_texts(["what is my dog's name?"], as_query=True)
    as_facts = core.embed_texts(["My dog is called Rex", "I like green tea"], as_query=False)
    assert seen["queries"][-1] == "what is my dog's name?" and seen["facts"][-2:] == ["My dog is called Rex",
                                                                                    "I like green tea"]
    torch.testing.assert_close(torch.tensor(as_query), low.embed(["what is my dog's name?"])[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(as_facts[0]), stored, rtol=0, atol=1e-6)
    assert [f for f, _ in core.search_vector("u", as_query, 1)] == [dog.fact_id]


def test_the_query_dtype_follows_the_replicas_hardware_unless_set():
    """query_dtype auto: bfloat16 where the retrieval replica's device computes it natively (a CPU with
    avx512_bf16 or amx_bf16, a CUDA GPU with bf16), float32 elsewhere, a GPU without bf16 included whatever its
    host CPU has; an explicit dtype wins; a misspelled one is refused when the config is made."""
    from inferscale_server.app import ServiceConfig
    from inferscale_server.retrieval import RetrievalConfig

    auto = RetrievalConfig()
    assert auto.resolved_query_dtype("cpu", cpu_flags={"avx2", "avx512f", "avx512_bf16"}) == (
        torch.bfloat16, "the CPU has avx512_bf16")
    assert auto.resolved_query_dtype("cpu", cpu_flags={"amx_bf16"})[0] == torch.bfloat16
    assert auto.resolved_query_dtype("cpu", cpu_flags={"avx2", "avx512f"})[0] == torch.float32
    assert auto.resolved_query_dtype("cuda:0", cuda_bf16=True, cpu_flags=set())[0] == torch.bfloat16
    assert auto.resolved_query_dtype("cuda:0", cuda_bf16=False, cpu_flags={"avx512_bf16"})[0] == torch.float32
    assert RetrievalConfig(query_dtype="float32").resolved_query_dtype("cpu", cpu_flags={"amx_bf16"}) == (
        torch.float32, "query_dtype")
    assert RetrievalConfig(query_dtype="bfloat16").resolved_query_dtype("cpu", cpu_flags=set())[0] == torch.bfloat16
    for make in (lambda: RetrievalConfig(query_dtype="fp16"), lambda: ServiceConfig(query_dtype="fp16"),
                 lambda: ServiceConfig.from_args({"query_dtype": "half"})):
        with pytest.raises(ValueError, match="query_dtype must be one of auto, float32, bfloat16"):
            make()
    assert ServiceConfig(query_dtype="float32").retrieval_config("redis://r").query_dtype == "float32"
    assert ServiceConfig().app_args()["query_dtype"] == "auto"


def test_a_large_write_embeds_in_turns_so_a_query_waits_for_one_chunk():
    """A 256-fact write is embedded FACT_EMBED_CHUNK facts per call, and the embedder is taken in the order asked
    (FifoLock): a query asked while the write's first call runs is embedded right after that call, not after the
    whole write (which held every query of the replica ~2 s under the noisy benchmark's kv_flood)."""
    from inferscale_core.embedder import CallableEmbedder
    from inferscale_server.registry import NewFact, open_registry
    from inferscale_server.retrieval import FACT_EMBED_CHUNK, RetrievalCore

    real = default_embedder()
    calls: list[tuple[str, int]] = []
    first_fact_call, query_asked = threading.Event(), threading.Event()

    def facts(texts):
        calls.append(("facts", len(texts)))
        if len(calls) > 2 and not first_fact_call.is_set():  # after the probe and the light user's fact
            first_fact_call.set()
            assert query_asked.wait(60), "the query never asked for the embedder"
        return real.embed(texts)

    registry = open_registry(None)
    core = RetrievalCore(registry, CallableEmbedder(facts),
                         query_embedder=CallableEmbedder(lambda t: calls.append(("query", len(t))) or real.embed(t)))
    (light,) = registry.create("light", [NewFact("My dog is called Rex")])
    core.ensure("light")
    heavy = registry.create("heavy", [NewFact(f"Flood fact {i} about nothing much at all.") for i in range(256)])
    lock = core._embed_lock
    with cf.ThreadPoolExecutor(2) as pool:
        write = pool.submit(core.index_facts, "heavy", [(r.fact_id, r.version, r.text) for r in heavy])
        assert first_fact_call.wait(60)
        search = pool.submit(core.search, "light", "what is my dog's name?", 1)
        deadline = time.monotonic() + 60
        while lock._next - lock._serving < 2:  # the query waits for the embedder behind the write's first call
            assert time.monotonic() < deadline, "the query never queued for the embedder"
            time.sleep(0.005)
        query_asked.set()
        assert write.result(timeout=120) == 256
        assert [f for f, _ in search.result(timeout=120)] == [light.fact_id]
    chunks = 256 // FACT_EMBED_CHUNK
    assert calls[2:] == [("facts", FACT_EMBED_CHUNK), ("query", 1)] + [("facts", FACT_EMBED_CHUNK)] * (chunks - 1)
    assert core.index.size("heavy") == 256
