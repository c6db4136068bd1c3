"""Retrieval deployment: per-user exact vector indices on the replica's device, kept in sync with the registry.

The registry (Redis) is the truth; an index here is a cache of it. Every request first compares the user's
version counter in the registry with the version this replica last synced (one read); on a mismatch it
diffs fact versions and (re)indexes only what changed. So a write that reached another replica, or none
(a push that failed), is still seen by the next search. Embeddings computed here are written back to the
registry, so a replica that loads the user later does not embed them again.

Users are multiplexed (`multiplexed_model_id` = user id): Serve routes a user to a replica that has the
user's index loaded, and each replica keeps at most MAX_USERS indices (Serve's LRU) and at most MAX_INDEX_BYTES
of embeddings (RetrievalCore's own LRU, by bytes: a user with 100,000 facts holds ~150 MB, as much as 100,000
users with one), dropping the rest from memory. An index dropped for bytes is rebuilt from the registry the next
time its user searches here, from the embeddings stored there (nothing is embedded again).
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from ray import serve

from inferscale_core.errors import UnknownUserError
from inferscale_core.index import VectorIndex

from .registry import Registry
from .user_sync import UserBook

log = logging.getLogger("inferscale.retrieval")
MAX_USERS = int(os.environ.get("INFERSCALE_RETRIEVAL_MAX_USERS", "1024"))
MAX_INDEX_BYTES_ENV = "INFERSCALE_RETRIEVAL_MAX_INDEX_BYTES"
# ~1.4 million facts of all-MiniLM-L6-v2 (384 float32, 1,536 B) per replica: well within a replica's memory on
# the chart's default pod, and bounded whatever the users' sizes.
DEFAULT_MAX_INDEX_BYTES = 2 << 30


def max_index_bytes(environ=os.environ) -> int:
    """The byte budget of one replica's indices from $INFERSCALE_RETRIEVAL_MAX_INDEX_BYTES (default
    DEFAULT_MAX_INDEX_BYTES); ValueError naming the variable for a value that is not a whole number >= 1."""
    raw = environ.get(MAX_INDEX_BYTES_ENV, str(DEFAULT_MAX_INDEX_BYTES))
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"${MAX_INDEX_BYTES_ENV}={raw!r}: the bytes of embeddings one retrieval replica keeps, a "
                         "whole number >= 1 (e.g. 2147483648 for 2 GiB)")
    return int(raw)


QUERY_DTYPES = ("auto", "float32", "bfloat16")


def check_query_dtype(value: str) -> None:
    """ValueError naming the setting unless `value` is one of QUERY_DTYPES (RetrievalConfig, ServiceConfig)."""
    if value not in QUERY_DTYPES:
        raise ValueError(f"query_dtype must be one of {', '.join(QUERY_DTYPES)}, got {value!r}")


QUERY_BATCH = 64  # queries embedded in one call at most (the Embedder's own batch size)
# Fact texts embedded per embedder call: a write's facts go in calls of this many, each taking the embedder in
# turn (FifoLock), so queries and other users' writes wait for one such call (~20-40 ms on the reference node's
# 2 cores), not for a 256-fact add's whole embedding, which held every query and add of the replica (0.49 s alone,
# longer beside the engine; the noisy benchmark's kv_flood). Rows equal one call's to ~1e-7 (padding to each call's
# longest text).
FACT_EMBED_CHUNK = 16
WRITE_THREADS = 4  # writes embedded at once, in turns (the deployment's index_facts)


class FifoLock:
    """A lock taken in the order it was asked for: a thread that releases it and asks again goes behind those
    already waiting (threading.Lock lets the releasing thread take it back at once)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._next = self._serving = 0

    def __enter__(self):
        with self._cv:
            ticket, self._next = self._next, self._next + 1
            self._cv.wait_for(lambda: self._serving == ticket)

    def __exit__(self, *exc):
        with self._cv:
            self._serving += 1
            self._cv.notify_all()


class QueryBatcher:
    """Embeds queries that wait for the embedder together: a caller that finds it idle embeds every query
    queued so far (up to `max_batch`) in one call, the others wait for their row. Under load a replica embeds a
    queue of N queries in a few calls instead of N; alone a query is embedded at once, as before. A batch's rows
    equal one-at-a-time embeddings to ~1e-7 (padding to the longest query; bench/query_batch.py). A failed call
    fails the queries of that batch only."""

    def __init__(self, embed, max_batch: int = QUERY_BATCH):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._embed, self.max_batch = embed, max_batch
        self._cv = threading.Condition()
        self._queue: list[_Query] = []
        self._busy = False
        self.calls = 0  # embedder calls made, for tests and benchmarks

    def embed(self, text: str) -> torch.Tensor:
        mine = _Query(text)
        with self._cv:
            self._queue.append(mine)
            while not mine.done:
                if self._busy:
                    self._cv.wait()
                    continue
                batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
                self._busy = True
                self._cv.release()
                try:
                    self._run(batch)
                finally:
                    self._cv.acquire()
                    self._busy = False
                    self._cv.notify_all()
        if mine.error is not None:
            raise mine.error
        assert mine.row is not None  # a batch that did not fail gave each of its queries its row
        return mine.row

    def _run(self, batch: list["_Query"]) -> None:
        self.calls += 1
        try:
            rows = self._embed([q.text for q in batch])
            for q, row in zip(batch, rows):
                q.row = row
        except BaseException as err:  # noqa: BLE001 - handed to every caller of this batch, raised there
            for q in batch:
                q.error = err
        for q in batch:
            q.done = True


class _Query:
    __slots__ = ("text", "row", "error", "done")

    def __init__(self, text: str):
        self.text, self.done = text, False
        self.row: torch.Tensor | None = None
        self.error: BaseException | None = None


class RetrievalCore:
    """Registry-synced per-user indices. Thread-safe; blocking (call from a thread in async code).

    Locking is per user: syncing one user (registry reads, embedding its new facts) never holds up another
    user's search. The query is embedded before any user lock is taken, in a batch with the queries waiting
    beside it (QueryBatcher). Embedding itself runs one call at a time, in the order asked (`_embed_lock`: a fast
    tokenizer is not safe to call from two threads at once), facts FACT_EMBED_CHUNK per call; VectorIndex guards
    its own matrices.

    Memory: the indices' embeddings (VectorIndex.nbytes: facts x dim x 4) stay within `max_bytes`: after a request
    that read or grew a user's index, the least recently used other users are unloaded until they fit (a user
    busy in another thread is passed over, never waited for). One user alone over the budget keeps its index
    while it is the one in use. Each user's matrix grows by doubling, so what is allocated may reach twice the
    counted bytes."""

    def __init__(self, registry: Registry, embedder, device: str | torch.device = "cpu",
                 max_bytes: int = DEFAULT_MAX_INDEX_BYTES, query_embedder=None):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._recent: OrderedDict[str, None] = OrderedDict()  # users with an index here, least recently used first
        self._recent_lock = threading.Lock()
        self.evicted = 0  # users unloaded to fit max_bytes (tests, benchmarks)
        self.registry = registry
        self.embedder = embedder  # facts: float32 always (stored in the registry, shared by every replica)
        # queries: `embedder` unless another is given (the deployment's bfloat16 copy where the hardware has it:
        # RetrievalConfig.query_dtype); the same model, so its rows score against the facts' float32 rows
        self.query_embedder = query_embedder or embedder
        self.index = VectorIndex(embedder.dim, device=device)
        self._locks_guard = threading.Lock()            # only to create/drop entries of _locks
        self._locks: dict[str, threading.RLock] = {}    # user -> the lock of its sync state and index rows
        self._embed_lock = FifoLock()
        self.queries = QueryBatcher(self._embed_queries)
        self.book: UserBook[int] = UserBook(int)       # user -> fact_id -> fact version indexed; versions synced
        # user -> fact_id -> expires_at, for the indexed facts that expire: a search leaves out those expired at
        # its own time (a fact that expires while indexed stops being picked; no sync has to run for it)
        self.expiring: dict[str, dict[str, float]] = {}

    def _lock(self, user_id: str) -> threading.RLock:
        with self._locks_guard:
            return self._locks.setdefault(user_id, threading.RLock())

    def _embed(self, texts: list[str]) -> torch.Tensor:
        """Fact texts' rows, FACT_EMBED_CHUNK texts per turn of the embedder."""
        rows = []
        for start in range(0, len(texts), FACT_EMBED_CHUNK):
            with self._embed_lock:
                rows.append(self.embedder.embed(texts[start:start + FACT_EMBED_CHUNK]))
        return torch.cat(rows) if rows else self.embedder.embed([])

    def embed_texts(self, texts: list[str], as_query: bool) -> list[list[float]]:
        """Embeddings for a pipeline that embeds for itself (Mem0's extraction, in the gateway): as queries
        (batched with the searches waiting, in the query dtype) or as facts (float32, the rows the index holds).
        A vector the gateway hands back to search_vector, or stores with a fact, is then the one this replica
        would have computed."""
        if as_query:
            rows = [self.queries.embed(t) for t in texts]
            return [r.float().tolist() for r in rows]
        return self._embed(list(texts)).float().tolist()

    def _embed_queries(self, texts: list[str]) -> torch.Tensor:
        with self._embed_lock:
            return self.query_embedder.embed(texts)

    # ----------------------------------------------------------------------------------- sync
    def ensure(self, user_id: str) -> int:
        """Bring the user's index up to the registry's state; returns the number of facts indexed."""
        with self._lock(user_id):
            changes = self.book.changes(self.registry, user_id)
            if changes is not None:
                for fid in changes.gone:
                    self._drop(user_id, fid)
                self._add_records(user_id, changes.fresh)
                self.book.synced[user_id] = changes.version
            return self.index.size(user_id)

    def _add_records(self, user_id: str, recs) -> None:
        if not recs:
            return
        dim = self.index.dim
        reuse = [r for r in recs if r.embedding is not None and r.embedding.shape == (dim,)]
        fresh = [r for r in recs if not (r.embedding is not None and r.embedding.shape == (dim,))]
        rows, ids = [], []
        if reuse:
            rows.append(torch.as_tensor(np.stack([r.embedding for r in reuse])))
            ids += [r.fact_id for r in reuse]
        if fresh:
            embs = self._embed([r.text for r in fresh]).cpu()
            for r, e in zip(fresh, embs):
                self.registry.set_embedding(user_id, r.fact_id, r.version, e.numpy())
            rows.append(embs)
            ids += [r.fact_id for r in fresh]
        self.index.add_many(user_id, ids, torch.cat(rows).to(torch.float32))
        versions, expiring = self.book.of(user_id), self.expiring.setdefault(user_id, {})
        for r in reuse + fresh:
            versions[r.fact_id] = r.version
            if r.expires_at != math.inf:
                expiring[r.fact_id] = r.expires_at
            else:
                expiring.pop(r.fact_id, None)

    def _drop(self, user_id: str, fact_id: str) -> None:
        self.book.facts.get(user_id, {}).pop(fact_id, None)
        self.expiring.get(user_id, {}).pop(fact_id, None)
        if self.index.contains(user_id, fact_id):
            self.index.remove(user_id, fact_id)

    # -------------------------------------------------------------------------------- writes
    def index_facts(self, user_id: str, facts: list[tuple[str, int, str]]) -> int:
        """Eagerly index just-written facts `(fact_id, version, text)`: embed, write the embeddings back to the
        registry, add them here. Does not mark the user synced (other changes may be pending)."""
        with self._lock(user_id):
            found = self.registry.find_many(user_id, [fid for fid, _, _ in facts])  # deleted meanwhile: absent
            recs = [found[fid] for fid, version, _ in facts if fid in found and found[fid].version == version]
            self._add_records(user_id, recs)
        self._used(user_id)
        return len(recs)

    def _used(self, user_id: str) -> None:
        """The user's index was just read or grown (outside its lock): most recently used now; then the others,
        least recently used first, are unloaded until the indices fit max_bytes."""
        with self._recent_lock:
            self._recent[user_id] = None
            self._recent.move_to_end(user_id)
            if self.index.nbytes() <= self.max_bytes:
                return
            victims = [u for u in self._recent if u != user_id]
        for victim in victims:
            lock = self._lock(victim)
            if not lock.acquire(blocking=False):  # in use in another thread: not the least recently used now
                continue
            try:
                self._unload(victim)
            finally:
                lock.release()
            self.evicted += 1
            if self.index.nbytes() <= self.max_bytes:
                return
        log.warning("retrieval: the indices hold %d bytes of embeddings, over the replica's budget of %d "
                    "($%s), with every other user unloaded or in use", self.index.nbytes(), self.max_bytes,
                    MAX_INDEX_BYTES_ENV)

    def forget(self, user_id: str, fact_ids: list[str]) -> None:
        with self._lock(user_id):
            for fid in fact_ids:
                self._drop(user_id, fid)

    def unload(self, user_id: str) -> None:
        """Drop the user's index from memory (LRU eviction or DeleteUser); the registry keeps everything."""
        with self._lock(user_id):
            self._unload(user_id)

    def _unload(self, user_id: str) -> None:  # under the user's lock
        self.book.forget(user_id)
        self.expiring.pop(user_id, None)
        with self._recent_lock:
            self._recent.pop(user_id, None)
        try:
            self.index.remove_user(user_id)
        except UnknownUserError:
            pass

    # -------------------------------------------------------------------------------- reads
    def search(self, user_id: str, query: str, k: int) -> list[tuple[str, float]]:
        """Top-k `(fact_id, score)` of the user's facts not expired now, best first; [] for a user with none."""
        q = self.queries.embed(query)  # before the user's lock: a search never waits on another's sync
        hits = self._search(user_id, q, k)
        self._used(user_id)
        return hits

    def search_vector(self, user_id: str, vector, k: int) -> list[tuple[str, float]]:
        """Top-k by a query embedding computed elsewhere (same model); normalized here like ours."""
        q = torch.as_tensor(np.asarray(vector, dtype=np.float32))
        if q.shape != (self.index.dim,):
            raise ValueError(f"query vector has shape {tuple(q.shape)}, the index holds {self.index.dim}-d vectors")
        q = q / q.norm().clamp_min(1e-12)
        hits = self._search(user_id, q.to(self.index.device), k)
        self._used(user_id)
        return hits

    def _search(self, user_id: str, q: torch.Tensor, k: int) -> list[tuple[str, float]]:
        with self._lock(user_id):
            if self.ensure(user_id) == 0:
                return []
            now = time.time()
            expired = {f for f, t in self.expiring.get(user_id, {}).items() if now >= t}
            hits = self.index.search(user_id, q, k + len(expired))  # k unexpired ones, if the user has them
            return [(f, float(s)) for f, s in hits if f not in expired][:k]

    def users(self) -> list[str]:
        return self.book.users()


class _LoadedUser:
    """What the multiplexed loader hands Serve; Serve calls __del__ when it evicts the user (LRU)."""

    def __init__(self, core: RetrievalCore, user_id: str):
        self.core, self.user_id = core, user_id

    def __del__(self):
        self.core.unload(self.user_id)


@dataclass(frozen=True)
class RetrievalConfig:
    """What a retrieval replica is built from, checked once when made (services/app.py
    ServiceConfig.retrieval_config)."""

    registry_url: str | None = None  # None: an in-process registry (one replica, tests)
    device: str = "auto"  # where the indices and the embedder live; "auto": the GPU Ray gave the replica, else CPU
    embedder_path: str | None = None  # None: the packaged all-MiniLM-L6-v2
    # The dtype a query is embedded in; facts are always embedded in float32. "auto": bfloat16 where the replica's
    # device computes it natively (vllm_env.serving_dtype: a CUDA GPU with bf16, or a CPU with avx512_bf16 or
    # amx_bf16), else float32. Measured on an AVX512-bf16 CPU (bench/query_dtype.py): a query's forward 1.8-2.0x
    # cheaper in batches of 16-64, 99.2% or more of the float32 top-5 kept on every LoCoMo dev conversation.
    query_dtype: str = "auto"

    def __post_init__(self):
        from .encoder_pool import check_device

        check_device(self.device)
        check_query_dtype(self.query_dtype)

    def resolved_query_dtype(self, device: str, cuda_bf16: bool | None = None,
                             cpu_flags: set[str] | None = None) -> tuple[torch.dtype, str]:
        """The torch dtype of the query embedder on `device` (a resolved device: "cpu" or "cuda[:N]"), and why."""
        from inferscale_core.vllm_env import serving_dtype

        if self.query_dtype != "auto":
            return getattr(torch, self.query_dtype), "query_dtype"
        if device.startswith("cuda"):
            if cuda_bf16 is None:
                cuda_bf16 = torch.cuda.is_bf16_supported()
            return (torch.bfloat16, "a CUDA GPU with bfloat16") if cuda_bf16 else (torch.float32, "a GPU without it")
        name, why = serving_dtype(cpu_flags, cuda_bf16=False)
        return getattr(torch, name), why


class Retrieval:
    """The Serve deployment (options in services/app.py)."""

    def __init__(self, config: RetrievalConfig | None = None):
        from inferscale_core.embedder import Embedder
        from inferscale_core.vllm_env import heavy_work_threads, one_thread_beside_the_engine

        config = config or RetrievalConfig()
        from .encoder_pool import resolve_device
        from .metrics import DeploymentMetrics, hide_multiplexed_ids
        from .registry import open_registry

        hide_multiplexed_ids()  # before the first @serve.multiplexed call: user ids never become labels
        self.metrics = DeploymentMetrics()

        device = resolve_device(config.device)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"retrieval replica asked for device {device!r} but no GPU is visible")
        one_thread_beside_the_engine(device)
        query_dtype, why = config.resolved_query_dtype(device)
        log.info("retrieval: queries embedded in %s (%s)", str(query_dtype).removeprefix("torch."), why)
        facts = Embedder(config.embedder_path, device=device)
        queries = facts.in_dtype(query_dtype)  # at start-up, from the weights just read: not at the first query
        self.core = RetrievalCore(open_registry(config.registry_url), facts, device, max_index_bytes(),
                                  query_embedder=queries)
        # Searches run on threads of their own, as many as a query batch holds: asyncio's default pool has
        # cores + 4 threads, which would cap a batch there and queue the other searches unbatched behind it.
        # A search's thread mostly waits for its batch's row.
        self._searches = ThreadPoolExecutor(QUERY_BATCH, thread_name_prefix="search")
        # Written facts are embedded below the searches' priority, as the engines' compute runs (heavy_work_threads);
        # several threads, so that a small write's turn at the embedder (FifoLock) comes between a large one's calls.
        self._writes = heavy_work_threads(device, WRITE_THREADS, "write")

    @serve.multiplexed(max_num_models_per_replica=MAX_USERS)
    async def _user(self, user_id: str) -> _LoadedUser:
        """Serve's loader runs under one lock for the whole replica: it only registers the user; the request
        syncs the index (RetrievalCore.ensure, under the user's own lock)."""
        return _LoadedUser(self.core, user_id)

    async def search(self, user_id: str, query: str, k: int) -> list[tuple[str, float]]:
        with self.metrics.request("search"):
            await self._user(user_id)
            return await asyncio.get_running_loop().run_in_executor(self._searches, self.core.search, user_id,
                                                                    query, k)

    async def search_vector(self, user_id: str, vector: list[float], k: int) -> list[tuple[str, float]]:
        with self.metrics.request("search_vector"):
            await self._user(user_id)
            return await asyncio.to_thread(self.core.search_vector, user_id, vector, k)

    async def embed_texts(self, texts: list[str], as_query: bool) -> list[list[float]]:
        """RetrievalCore.embed_texts: no user's index is read, so any replica answers (no multiplexed id)."""
        with self.metrics.request("embed_texts"):
            pool = self._searches if as_query else self._writes
            return await asyncio.get_running_loop().run_in_executor(pool, self.core.embed_texts, list(texts),
                                                                    as_query)

    async def index_facts(self, user_id: str, facts: list[tuple[str, int, str]]) -> int:
        with self.metrics.request("index_facts"):
            await self._user(user_id)
            return await asyncio.get_running_loop().run_in_executor(self._writes, self.core.index_facts, user_id,
                                                                    facts)

    async def forget(self, user_id: str, fact_ids: list[str]) -> None:
        with self.metrics.request("forget"):
            await asyncio.to_thread(self.core.forget, user_id, fact_ids)

    async def forget_user(self, user_id: str) -> None:
        with self.metrics.request("forget_user"):
            await asyncio.to_thread(self.core.unload, user_id)

    async def health(self) -> str:
        await asyncio.to_thread(self.core.registry.ping)
        return "ok"
