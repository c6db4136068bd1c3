"""How a request's facts' KV reaches the engine's worker store, and how it leaves.

Per request, for the facts it names (the retrieval's top-k):
  1. facts this replica put or had loaded into its worker store (`ResidentKV`) are used as they are,
  2. with a cluster KV tier (Mooncake Store) the rest are left to the connector's worker: the request goes to vLLM
     with `fetch` set, the worker reads what its store lacks (its memory and disk tiers, then the cluster tier, with
     a Mooncake client of its own) on a loader thread while vLLM keeps the request outside the batch, and writes the
     blocks when the KV has arrived. No KV passes through this process or the engine core's RPC channel. A fact
     found in no tier (evicted, never written, Mooncake down) is computed by vLLM with the query (the connector's
     failed-load path: slower, never wrong); the worker lists it, and `requeue_missing` (every watch round) queues
     ONE re-encode, which writes it to the cluster tier,
  3. without a cluster tier the rest is encoded by the encoder pool now, from the registry's text and window, and
     put into the worker store; the put is sent, not awaited, before the request (`put(ahead=True)`): vLLM's engine
     core runs its input in the order sent, so the put has run when the request is added.
Facts are stored under `kv_id(fact_id, version)` in every tier, so KV is used only for the exact version the
registry names. What the byte budget pushes out leaves the worker store in the background.

A fact the encoder cannot encode (stored by an older version, say) is marked unservable in the registry for that
version and left out of that request and later ones."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from inferscale_core.types import kv_id

from ..encoder_pool import EncodeFailure, StoredKV
from .books import HeldFact, ResidentKV, UserBooks
from .engine import ServingEngine, ms

log = logging.getLogger("inferscale.engine_replica")
PUT_CHUNK_TOKENS = 512  # KV tokens per call into the engine core: its step loop waits while a call runs
# When a write's warm-up is asked which facts have landed (seconds after the previous look; one look is one call
# into the engine core between steps, ids only): at once, then backing off; what has not landed after ~60 s is
# left to the requests.
WARM_CHECKS_S = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


def put_chunks(items: list, token_counts: list[int], max_tokens: int = PUT_CHUNK_TOKENS) -> list[list]:
    """`items` cut, in order, into runs of at most `max_tokens` tokens (an item larger than that alone)."""
    chunks: list[list] = []
    cur: list = []
    used = 0
    for item, n in zip(items, token_counts):
        if cur and used + n > max_tokens:
            chunks.append(cur)
            cur, used = [], 0
        cur.append(item)
        used += n
    if cur:
        chunks.append(cur)
    return chunks


def older_kv_ids(fact_id: str, version: int) -> list[str]:
    """Ids of every earlier version (versions count up from 1, so this is exhaustive)."""
    return [kv_id(fact_id, v) for v in range(1, int(version))]


class Background:
    """Tasks this replica keeps a reference to until they end (asyncio keeps only a weak one)."""

    def __init__(self):
        self.tasks: set[asyncio.Task] = set()

    def run(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


class KVPath:
    def __init__(self, engine: ServingEngine, encoder, registry, cluster, books: UserBooks, resident: ResidentKV,
                 counters: dict, background: Background):
        """`encoder`: the encoder pool's handle (`encoder.encode_for.remote(...)` awaited)."""
        self.engine, self.encoder, self.registry, self.cluster = engine, encoder, registry, cluster
        self.books, self.resident, self.counters, self.background = books, resident, counters, background
        self.reencoding: set[tuple[str, str]] = set()  # (user, kv_id) with a re-encode under way
        self._bytes_per_token: int | None = None  # the worker store's KV bytes per token (asked once)
        # Whether the cluster tier bounds each user's share (pool_bytes or max_bytes_per_user set; the encoder pool
        # books its writes then): only then is a read worth a registry call to mark it used.
        self.share_on = cluster is not None and cluster.config.user_cap() is not None

    async def fetch(self, user_id: str, facts: list[tuple[str, HeldFact]]) -> tuple[dict[str, float], list[str]]:
        """Makes these facts' KV reachable for the request. Facts this replica knows the worker store holds are
        used as they are. With a cluster tier the others are left to the worker, which reads them itself when
        the request arrives (returned: the kv_ids it will load; the request is sent with `fetch`); without one
        they are encoded now and put into the worker store (after a look at its disk tier). Returns the time of
        each step taken, in ms (`kv_fetch_*` hops of the answer's timings), and the kv_ids left to the worker."""
        steps: dict[str, float] = {}
        t = time.perf_counter()

        def step(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            steps[name] = ms(now - t)
            t = now

        async with self.books.lock(user_id):
            step("kv_fetch_lock")
            self.resident.touch(user_id, [kv_id(f, h.version) for f, h in facts])
            todo = [(f, h) for f, h in facts if not self.resident.has(user_id, kv_id(f, h.version))]
            if not todo:
                return steps, []
            maybe = self.books.maybe_on_disk.get(user_id, set())
            if self.cluster is not None:
                # The worker looks in its own tiers (memory, disk) and then the cluster tier: nothing to ask it
                # or move from here.
                kvs = [kv_id(f, h.version) for f, h in todo]
                maybe.difference_update(kvs)
                if self.share_on:
                    self.background.run(self.touch_in_cluster(user_id, [f for f, _ in todo]))
                return steps, kvs
            ask = [kv_id(f, h.version) for f, h in todo if kv_id(f, h.version) in maybe]
            if ask:  # the disk tier may have them: the worker store says which it still holds
                present = set(kv for kv, ok in zip(ask, await self.engine.has_encoded(user_id, ask)) if ok)
                maybe.difference_update(ask)  # counted in `resident` now, or known to be gone
                await self.evict(self.resident.add(user_id, [(kv, None) for kv in ask if kv in present]))
                self.counters["facts_from_disk"] += len(present)
                step("kv_fetch_disk_check")
                todo = [(f, h) for f, h in todo if kv_id(f, h.version) not in present]
                if not todo:
                    return steps, []
            await self.encode_and_put(user_id, todo)
            step("kv_fetch_encode")
            return steps, []

    async def touch_in_cluster(self, user_id: str, fact_ids: list[str]) -> None:
        """Marks these facts used in the user's cluster-tier books (services/kv_tier_share.py), so that a user
        over its share loses the facts it reads least, not these; off the request's path, and a failure only
        makes them look older."""
        try:
            await asyncio.to_thread(self.registry.kv_tier_touch, user_id, fact_ids)
        except Exception as e:  # noqa: BLE001 - a hint for the share's LRU order, never a request's failure
            log.warning("marking %d facts of a user used in the cluster tier's books failed: %s", len(fact_ids), e)

    def book_fetched(self, user_id: str, params, kvs: list[str]) -> None:
        """Counts the facts the worker loads for this request as resident (their bytes from their token counts),
        so later requests use them as they are; the least recently used leave the worker store in the
        background. A fact the load finds nowhere leaves the books again (`requeue_missing`)."""
        if not kvs or params is None:
            return
        tokens = dict(zip(params.kv_ids, params.chunk_lens or ()))
        per_token = self.bytes_per_token()
        self.book(user_id, [(kv, tokens[kv] * per_token if kv in tokens else None) for kv in kvs])

    def bytes_per_token(self) -> int:
        """The worker store's KV bytes per token (asked of the engine once)."""
        if self._bytes_per_token is None:
            self._bytes_per_token = self.engine.kv_bytes_per_token()
        return self._bytes_per_token

    def book(self, user_id: str, items: list[tuple[str, int | None]]) -> None:
        """Counts `(kv_id, bytes or None)` the worker loads as resident; what the budget pushes out leaves the
        worker store in the background."""
        evicted = self.resident.add(user_id, items)
        if evicted:
            self.background.run(self.evict(evicted))

    async def warm(self, user_id: str, items: Sequence[tuple[str, int | None]]) -> None:
        """Facts just written to the cluster tier for a user this replica serves (`(kv_id, tokens)`; tokens None
        when not known, as for an admin's load_user: booked without bytes), or a user loaded on purpose: the worker
        reads them in its background, behind the requests' loads (connector_worker.WARM_CHUNK_FACTS), so the
        user's first request finds them in memory instead of waiting for a cold read (at N=100, every user's first
        request was cold). Each is counted resident once the worker store holds it (asked with a backoff,
        WARM_CHECKS_S, off any request's path): a request whose facts are all counted goes to vLLM without `fetch`,
        so it does not wait for a step to end either (an asynchronous load with nothing to read still costs one:
        1.7 s p50 at N=100 on 2 cores). Until then a request asks the worker, which finds them or reads what the
        warm-up has not reached: a request never counts on a read not yet landed. The worker store's own byte
        budgets bound what warm-ups keep. A failure only leaves them cold."""
        if not items:
            return
        try:
            kvs = [kv for kv, _ in items]
            await self.engine.prefetch(user_id, kvs)
            self.counters["facts_warmed"] += len(kvs)
            per_token = self.bytes_per_token()
            nbytes = {kv: None if n is None else n * per_token for kv, n in items}
            for wait_s in WARM_CHECKS_S:
                await asyncio.sleep(wait_s)
                landed = await self.engine.has_encoded(user_id, kvs)
                self.book(user_id, [(kv, nbytes[kv]) for kv, ok in zip(kvs, landed) if ok])
                kvs = [kv for kv, ok in zip(kvs, landed) if not ok]
                if not kvs:
                    return
        except Exception as e:  # noqa: BLE001 - the next request loads what it needs
            log.warning("warming %d facts of a user failed: %s", len(items), e)

    async def requeue_missing(self) -> int:
        """Facts the worker's loads found in no tier (evicted from the cluster tier, never written, Mooncake away)
        leave the books, and ONE re-encode of each still-held version is queued (it writes the cluster tier; the
        next request that names the fact loads it). Facts it found absent from its store but maybe elsewhere (a
        copy on a dead node's segment, until the master drops it) only leave the books: the next request asks
        the worker to load them again. Returns how many were missing."""
        lacking = await self.engine.take_missing()
        for user_id, kvs in lacking.get("absent", {}).items():
            self.resident.discard(user_id, kvs)
        n = 0
        for user_id, kvs in lacking.get("missing", {}).items():
            self.resident.discard(user_id, kvs)
            n += len(kvs)
            held = self.books.book.facts.get(user_id, {})
            todo = []
            for kv in kvs:
                f = kv.rpartition("@v")[0]
                h = held.get(f)
                if h is not None and kv_id(f, h.version) == kv:  # the version still held, not an older one
                    todo.append((f, h))
            self.queue_reencode(user_id, todo)
        self.counters["facts_recomputed"] += n
        return n

    def queue_reencode(self, user_id: str, facts: list[tuple[str, HeldFact]]) -> None:
        """One background re-encode per fact version, however many requests miss it meanwhile."""
        fresh = [(f, h) for f, h in facts if (user_id, kv_id(f, h.version)) not in self.reencoding]
        if not fresh:
            return
        self.reencoding.update((user_id, kv_id(f, h.version)) for f, h in fresh)

        async def run():
            try:
                async with self.books.lock(user_id):
                    held = self.books.book.facts.get(user_id, {})
                    current = [(f, h) for f, h in fresh if held.get(f) == h]  # not moved on meanwhile
                    if current:
                        await self.encode_and_put(user_id, current)
            except Exception:  # the next request that needs the fact queues it again
                log.exception("re-encoding %d facts of a user failed", len(fresh))
            finally:
                self.reencoding.difference_update((user_id, kv_id(f, h.version)) for f, h in fresh)

        self.background.run(run())

    async def encode_and_put(self, user_id: str, facts: list[tuple[str, HeldFact]]) -> None:
        """Encodes facts from the registry's text and window. With a cluster tier the pool writes them there
        (StoredKV) and the worker loads them when a request names them; without one they are put into the worker
        store. Call under the user's lock."""
        encoded = await self.encoder.encode_for.remote(
            user_id, [(f, h.version, h.text, list(h.window)) for f, h in facts])
        fresh = await self.current(user_id, [(f, h.version) for f, h in facts])
        facts, encoded = [fh for fh, ok in zip(facts, fresh) if ok], [e for e, ok in zip(encoded, fresh) if ok]
        good = []
        for (f, h), e in zip(facts, encoded):
            if isinstance(e, EncodeFailure) and e.transient:  # the encoder failed, not the fact: not served this
                # time (vLLM computes it); it is not held, so the next request that names it tries again
                log.warning("fact %s v%d of a user failed to encode for now: %s", f, h.version, e.reason)
            elif isinstance(e, EncodeFailure):  # only a deterministic failure is for good
                log.warning("fact %s v%d of a user cannot be encoded: %s", f, h.version, e.reason)
                await asyncio.to_thread(self.registry.set_unservable, user_id, f, h.version, e.reason)
                self.books.book.facts.get(user_id, {}).pop(f, None)
                self.counters["facts_unservable"] += 1
            elif isinstance(e, StoredKV):
                pass  # in the cluster tier: the worker loads it for the next request that names it
            else:
                good.append((f, h.version, e))
        if good:
            await self.put(user_id, [(f, v) for f, v, _ in good], [e for _, _, e in good], ahead=True)
        self.counters["facts_encoded"] += sum(not isinstance(e, EncodeFailure) for e in encoded)

    async def current(self, user_id: str, facts: list[tuple[str, int]]) -> list[bool]:
        """Whether each (fact, version) is still the registry's; for one that is not, the cluster object its
        encode just wrote (after the newer version's write removed the older ones: two updates racing, or a
        re-encode racing an update) is removed, and the caller never stores it: a put never replaces, or
        outlives, a newer version. One registry read."""
        current = await asyncio.to_thread(self.registry.find_many, user_id, [f for f, _ in facts])
        fresh = [f in current and current[f].version == v for f, v in facts]
        for (f, v), ok in zip(facts, fresh):
            if not ok and self.cluster is not None:
                await asyncio.to_thread(self.cluster.remove_versions, user_id, f, v + 1)
        return fresh

    async def drop(self, user_id: str, held: dict[str, HeldFact], fact_ids: list[str]) -> int:
        """Drops these held facts (deleted, or at another version now) from the books and the worker store."""
        if fact_ids:
            ids = [kv_id(f, held[f].version) for f in fact_ids]
            await self.engine.delete_encoded(user_id, ids)
            self.resident.discard(user_id, ids)
            for f in fact_ids:
                del held[f]
        return len(fact_ids)

    async def put(self, user_id: str, facts: list[tuple[str, int]], encoded: list, ahead: bool = False) -> None:
        """`facts`: (fact_id, version) of each EncodedFact. Chunked (PUT_CHUNK_TOKENS): each call into the engine
        core holds up its step loop (every user's decoding) for as long as it runs, so without `ahead` (a write)
        a chunk is sent once the one before it has run, and this returns when the last has. Older versions leave
        the worker store.

        `ahead`: a request that needs these facts is sent next. Returns once the puts are sent
        (ServingEngine.send_put: the engine core runs them before it adds that request), not answered,
        which saves the request a step of the engine's loop; their replies, the older versions' delete and the
        byte budget's evictions are settled in the background. A put that fails there is logged and counted
        (`facts_put_failed`), its facts forgotten here: the request computes them (vLLM's failed-load path), the
        next one that names them fetches them again."""
        if len(facts) != len(encoded):
            raise ValueError(f"{len(facts)} fact ids but {len(encoded)} encoded facts")
        items = [(kv_id(f, v), enc) for (f, v), enc in zip(facts, encoded)]
        replies: list[asyncio.Future] = []
        for chunk in put_chunks(items, [enc.num_tokens for enc in encoded], PUT_CHUNK_TOKENS):
            if replies and not ahead:
                # A write no request waits for: one chunk in the engine core at a time, so that its step loop runs
                # between two. Sent at once, the engine core ran them back to back between two steps: a 256-fact
                # add (~140 MB of fp32 KV) stalled every user's answer 1.1-1.7 s as it landed (bench/noisy_neighbour.py
                # `kv_flood`, BENCHMARKS.md). A failed chunk raises here, before anything is booked resident.
                await replies[-1]
            replies.append(await self.engine.send_put(user_id, chunk))
        old = [i for f, v in facts for i in older_kv_ids(f, v)]
        self.resident.discard(user_id, old)
        evicted = self.resident.add(user_id, [(i, enc.nbytes) for i, enc in items])

        async def settle() -> None:
            try:
                for reply in replies:
                    await reply
            except BaseException:
                self.resident.discard(user_id, [i for i, _ in items])
                with contextlib.suppress(Exception):  # the facts the books let go for these still leave the store
                    await self.evict(evicted)
                raise
            if old:
                await self.engine.delete_encoded(user_id, old)
            await self.evict(evicted)

        if not ahead:
            return await settle()

        async def settle_in_background() -> None:
            try:
                await settle()
            except Exception:  # the request computes what is missing; nothing to answer to
                self.counters["facts_put_failed"] += len(items)
                log.exception("putting %d facts of a user into the worker store failed", len(items))

        self.background.run(settle_in_background())

    async def evict(self, keys: list[tuple[str, str]]) -> None:
        """Deletes from the worker store (memory and disk) the facts the byte budget pushed out; a later request
        that names one reads it again (cluster tier or encoder)."""
        by_user: dict[str, list[str]] = {}
        for u, kv in keys:
            by_user.setdefault(u, []).append(kv)
        for u, kvs in by_user.items():
            await self.engine.delete_encoded(u, kvs)
        self.counters["facts_evicted"] += len(keys)
