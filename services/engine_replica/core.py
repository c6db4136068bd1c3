"""`ReplicaCore`: one engine replica's logic over its parts, without Serve: the user books, the KV path, deletions,
answering. Built from an engine that satisfies `ServingEngine` (vLLM with the connector, or a test double), the
encoder pool's handle, a registry and the cluster tier, so tests run it without vLLM or Ray
(tests/unit/test_replica_core.py); deployment.py is the Serve deployment that holds it.

Syncing a user reads the registry's list of the user's servable facts, versions and texts (one read of the
version counter when nothing moved since the last sync); it moves no KV. The hot path: the replica keeps, per held
user, each servable fact's version and text from its last sync, so an Answer costs one registry read (the user's
version counter) however many facts it names.

Writes from the gateway arrive as `put_facts(user, facts, encoded)` where `encoded` is the encoder pool's response
that the gateway passed on unresolved: Serve resolves it here, from the object store. With a cluster tier it holds
only token counts (`StoredKV`: the KV is in the cluster tier; this replica's worker warms it in its background,
behind the requests' loads, and the replica counts it resident once it has landed: KVPath.warm); without one, the
EncodedFacts, put into the worker store now. A write is all or nothing: if the encoder failed on any of its facts,
none is stored and the gateway undoes the registry rows."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
import uuid

import grpc

from inferscale_core.errors import check_id
from inferscale_core.types import Mode, kv_id

from ..admission import Admission
from ..encoder_pool import EncodeFailure, StoredKV
from ..errors import RETRY_AFTER_S, ApiError
from ..messages import AnswerRequest, FactRef, FactWrite
from ..metrics import EngineMetrics
from .answering import Answering
from .books import HeldFact, ResidentKV, UserBooks
from .config import EngineReplicaConfig
from .deletions import Deletions
from .engine import ServingEngine, engine_death_is_unavailable, ms
from .kv_path import Background, KVPath
from .placement import replica_slot, serve_replica_id

log = logging.getLogger("inferscale.engine_replica")
WATCH_PERIOD_S = float(os.environ.get("INFERSCALE_ENGINE_WATCH_S", "0.5"))


class ReplicaCore:
    """The engine replica without Serve. `hold(user_id)` registers a user before it is served (the deployment
    passes Serve's multiplexed loader; by default the user is registered once)."""

    engine_cpus: list[int] | None = None  # the cores its vLLM is bound to, when not every core (bind_engine_cpus)
    engine_niceness: int | None = None  # its vLLM's niceness when lowered below light work (below_light_work)

    def __init__(self, config: EngineReplicaConfig, engine: ServingEngine, encoder, registry, cluster=None,
                 disk_dir: str | None = None, metrics=None, disk_budget_bytes: int | None = None, hold=None):
        """`engine`: started; `encoder`: the encoder pool's handle (`encoder.encode_for.remote(...)` awaited);
        `disk_budget_bytes`: the worker store's disk tier budget, if it has one."""

        self.config = config
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self.engine, self.encoder, self.registry, self.cluster = engine, encoder, registry, cluster
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.disk_dir = disk_dir
        self.admission = Admission(engine.kv_cache_tokens(), config.admission_queue_factor)
        log.info("engine replica %s: KV cache of %d tokens, admitting up to %d tokens in flight", self.replica_id,
                 self.admission.capacity_tokens, self.admission.limit_tokens)
        if self.cluster is not None:
            self.cluster.available  # noqa: B018 - starts connecting in the background
        self.books = UserBooks()
        # What this replica put into its worker store, within its disk tier's budget (files are written through),
        # so that budget collects facts of users this replica no longer holds before the ones it counts on.
        self.resident = ResidentKV(min(config.kv_budget(), disk_budget_bytes or 1 << 62))
        # facts_from_cluster and facts_unreadable (cluster-tier objects that exist but could not be read: computed)
        # are the worker's own counts (it reads the cluster tier); `stats` reports them beside these.
        self.counters = {"facts_from_disk": 0, "facts_encoded": 0, "facts_recomputed": 0,
                         "facts_pushed": 0, "users_loaded": 0, "users_evicted": 0, "facts_unservable": 0,
                         "facts_evicted": 0, "facts_stale_pushes": 0, "tombstones_applied": 0,
                         "tombstones_skipped": 0, "facts_put_failed": 0, "kv_reconciled": 0, "facts_warmed": 0}
        self.background = Background()
        self.kv = KVPath(engine, encoder, registry, cluster, self.books, self.resident, self.counters,
                         self.background)
        self.deletions = Deletions(engine, registry, cluster, self.books, self.resident, self.counters, disk_dir)
        self.answering = Answering(engine, self.admission, self.metrics, config.stream_interval)
        self._hold_user = hold or self._register_once

    @property
    def max_model_len(self) -> int:
        return self.answering.max_model_len

    async def start(self) -> "ReplicaCore":
        """Tombstones (registry deletes and updates) are applied before any request (deletions.py); with a disk
        tier, the facts its files hold are listed (a request asks the worker about those only)."""
        await self.deletions.start()
        if self.disk_dir:
            self.books.maybe_on_disk = {u: set(kvs) for u, kvs in (await self.engine.list_encoded()).items()}
        return self

    # ------------------------------------------------------------------------------ user placement
    async def register_user(self, user_id: str) -> None:
        """This replica holds the user from now on (Serve's loader). Its placement is written once it has facts
        here (`_place`), not for any request: a request for a user DeleteUser erased must not name it again."""
        self.counters["users_loaded"] += 1

    async def _place(self, user_id: str) -> None:
        """Records in the registry that this replica holds the user's facts (their KV comes here)."""
        await asyncio.to_thread(self.registry.add_placement, user_id, self.replica_id)

    async def _register_once(self, user_id: str) -> None:
        if user_id not in self.books.loaded:
            self.books.loaded.add(user_id)
            await self.register_user(user_id)

    async def unload(self, user_id: str) -> None:
        """LRU eviction. With a disk tier the worker store keeps the facts (its byte budgets decide what stays
        in memory) and a reload finds them there; without one they are dropped and re-encoded on reload."""
        async with self.books.lock(user_id):
            # The disk tier keeps them: a reload asks the worker store, whose budgets may have dropped some since.
            kept = (self.books.maybe_on_disk.get(user_id, set()).union(self.resident.kvs_of(user_id))
                    if self.disk_dir else set())
            if not self.disk_dir:
                await self.engine.delete_encoded(user_id, None)
            self.deletions.forget_user_books(user_id)
            if kept:
                self.books.maybe_on_disk[user_id] = kept
        self.books.loaded.discard(user_id)
        self.counters["users_evicted"] += 1
        await asyncio.to_thread(self.registry.remove_placement, user_id, self.replica_id)

    async def _sync(self, user_id: str) -> dict[str, HeldFact]:
        """The registry's servable facts of the user at their versions (texts and windows), no KV; drops the
        KV of facts deleted or moved on. One registry read (the version counter) when nothing moved."""
        async with self.books.lock(user_id):
            held = self.books.held(user_id)
            changes = await asyncio.to_thread(self.books.book.changes, self.registry, user_id)
            if changes is None:
                return held
            await self.kv.drop(user_id, held, changes.gone)
            for r in changes.fresh:  # a version known to be bad is left out
                if not r.unservable_reason:
                    held[r.fact_id] = HeldFact(r.version, r.text, tuple(r.window), r.expires_at)
            self.books.book.synced[user_id] = changes.version
            # A user's placement is dropped with its facts (DeleteUser): say again that this replica holds it,
            # while it has facts; a user with none (erased, or never added) is not written back into the registry.
            # A sync that moved no fact (the versions already held: a write's facts came with it) changes nothing
            # the placement depends on: the write placed the user (put_facts), and an erasure takes facts away.
            if held and (changes.fresh or changes.gone):
                await self._place(user_id)
            return held

    # ------------------------------------------------------------------------------ the watch
    async def watch(self) -> None:
        """Every WATCH_PERIOD_S: the facts the worker found nowhere are re-encoded (kv_path.py), the registry's new
        tombstones applied (deletions.py)."""
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            await self.watch_once()

    async def watch_once(self) -> None:
        try:
            await self.kv.requeue_missing()
        except Exception as e:  # noqa: BLE001 - the engine is check_health's business; the next round asks again
            log.warning("asking the worker for facts it found nowhere failed: %s", e)
        try:
            await self.deletions.apply()
        except Exception as e:  # noqa: BLE001 - Redis away for a moment: the next round tries again
            log.warning("reading the registry's tombstones failed: %s", e)

    # ------------------------------------------------------------------------------ called by the gateway
    async def put_facts(self, user_id: str, facts: list[FactWrite], encoded: list) -> int:
        """New facts (their registry versions and texts). `encoded` arrives resolved from the object store (the
        encoder's response, passed on unresolved): StoredKV (in the cluster tier: nothing to move now) or
        EncodedFact (put into the worker store). With a cluster tier the worker warms the written facts in its
        background (KVPath.warm). All or nothing: if the encoder failed on any fact, nothing is
        stored and the error names it."""
        with self.metrics.request("put_facts"), engine_death_is_unavailable():
            for i, enc in enumerate(encoded):
                if isinstance(enc, EncodeFailure):
                    raise ApiError(grpc.StatusCode.UNAVAILABLE if enc.transient else grpc.StatusCode.INVALID_ARGUMENT,
                                   f"facts[{i}] could not be encoded: {enc.reason}; nothing was stored"
                                   + ("; retry shortly" if enc.transient else ""), field=f"facts[{i}].text",
                                   retry_after_s=RETRY_AFTER_S if enc.transient else None)
            async with self.books.lock(user_id):
                held = self.books.held(user_id)  # held here from now on
                fresh = await self.kv.current(user_id, [(w.fact_id, int(w.version)) for w in facts])
                # The written facts are held at once, as the registry stored them: the user's next request then
                # finds them at their versions and reads no record again (its sync lists the versions, one read);
                # before, that request read every record of the user (texts, windows, embeddings: ~3.5 KB a fact).
                # A fact held at an older version (an update) is dropped first, its KV with it, as the sync that
                # would have found it moved drops it.
                await self.kv.drop(user_id, held, [w.fact_id for w, ok in zip(facts, fresh)
                                                   if ok and w.fact_id in held and held[w.fact_id].version < w.version])
                for w, ok in zip(facts, fresh):
                    if ok and w.fact_id not in held:
                        held[w.fact_id] = HeldFact(int(w.version), w.text, tuple(w.window), w.expires_at)
                local = [((w.fact_id, int(w.version)), e) for w, e, ok in zip(facts, encoded, fresh)
                         if ok and not isinstance(e, StoredKV)]
                if local:
                    await self.kv.put(user_id, [fv for fv, _ in local], [e for _, e in local])
                stored = [(kv_id(w.fact_id, int(w.version)), e.num_tokens) for w, e, ok in zip(facts, encoded, fresh)
                          if ok and isinstance(e, StoredKV)]
                if stored and self.cluster is not None and self.cluster.config.warm_at_write:  # this replica serves
                    self.background.run(self.kv.warm(user_id, stored))  # the user: its worker reads them now
                self.counters["facts_stale_pushes"] += fresh.count(False)
            self.counters["facts_pushed"] += len(encoded)
            await self._hold_user(user_id)  # registers the user here (Serve routes its requests to this replica)
            await self._place(user_id)
            return len(encoded)

    async def forget(self, user_id: str, facts: list[FactRef]) -> int:
        """The gateway deleted these facts: a hint that the registry's tombstone log moved, applied now
        (deletions.py) rather than at the next watch round. Returns the tombstones applied."""
        with self.metrics.request("forget"):
            return await self.deletions.apply()

    async def forget_user(self, user_id: str) -> int:
        """The gateway deleted the user: as `forget`."""
        with self.metrics.request("forget_user"):
            return await self.deletions.apply()

    async def answer(self, req: AnswerRequest):
        """Streams AnswerPiece messages, then one AnswerEnd with TTFT, the injected fact ids and `timings_ms`
        (this replica's hops; services/messages.py). Refused with RESOURCE_EXHAUSTED (EngineAtCapacity) when the
        KV cache is full."""
        from inferscale_core.requests import Query

        t_in = time.perf_counter()
        user_id = req.user_id
        with self.metrics.request("answer"), engine_death_is_unavailable():
            mode = Mode(req.mode)  # ValueError naming the value for anything else
            await self._hold_user(user_id)
            held = await self._sync(user_id)  # one read of the version counter when nothing moved
            t_synced = time.perf_counter()
            # Retrieval may name a fact deleted since, or one that cannot be served: it is not held, skipped; nor
            # is one expired now (retrieval leaves those out at its own time: this is the injecting side's word).
            # Both modes serve the same facts (an A/B of injection).
            now = time.time()
            facts = [(f, held[f]) for f in req.fact_ids if f in held and now < held[f].expires_at]
            fetch_steps: dict[str, float] = {}
            fetched: list[str] = []
            if mode == Mode.KV:
                fetch_steps, fetched = await self.kv.fetch(user_id, facts)
                # A fact the encoder just found it cannot encode (stored by an older version) is no longer held:
                # left out, as the sync used to leave it out before the request.
                facts = [(f, h) for f, h in facts if held.get(f) == h]
            hops = {"user_sync": ms(t_synced - t_in), "kv_fetch": ms(time.perf_counter() - t_synced), **fetch_steps}
            conversation = req.conversation
            after: list[dict] = []
            tools: list = []
            if req.openai is not None:
                turns, at = req.openai.messages, req.openai.question_index
                conversation, after, tools = turns[:at], turns[at + 1:], req.openai.tools
            q = Query(user_id, req.query, k=max(1, len(facts)), mode=mode,
                      conversation=tuple(conversation or ()), tools=tuple(tools or ()), after=tuple(after))
            try:
                # Tokenizing (up to 100 messages of 16,000 characters, sized by the gateway) runs in a worker
                # thread: this replica's other streams keep going.
                p = await asyncio.to_thread(self.engine.prepare_facts, q, [f for f, _ in facts],
                                            [h.text for _, h in facts], [h.version for _, h in facts],
                                            [kv_id(f, h.version) for f, h in facts])
            except ValueError as e:  # the chat template refused the conversation
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            if fetched and p.params is not None:  # the worker loads these itself, asynchronously
                p.params = dataclasses.replace(p.params, fetch=True)
                self.kv.book_fetched(user_id, p.params, fetched)
            async for piece in self.answering.stream(p, dataclasses.replace(req, mode=mode), t_in, hops):
                yield piece

    async def chat(self, user_id: str, messages: list[dict], max_tokens: int = 256, temperature: float = 0.0,
                   structured: dict | None = None) -> str:
        """Plain chat generation with the serving model for `user_id`, no memory (Mem0's extraction step)."""
        with engine_death_is_unavailable():
            return await self.answering.chat(user_id, messages, max_tokens, temperature, structured)

    async def chat_room(self, user_id: str, messages: list[dict]) -> int:
        """Tokens left in the context after these messages (negative when they do not fit)."""
        return await self.answering.chat_room(user_id, messages)

    async def load_user(self, user_id: str) -> str:
        """Loads the user onto THIS replica (whichever one Serve routed the call to; admin and tests: put a user
        on several replicas, warm a replica), every fact's KV fetched into its worker store (requests fetch only
        their k). Returns this replica's id. With a cluster tier the worker reads them in its background, as after
        a write (KVPath.warm: counted resident once they landed, so no request counts on a read not yet done)."""
        await self._hold_user(check_id("user_id", user_id))
        held = await self._sync(user_id)
        _, fetched = await self.kv.fetch(user_id, list(held.items()))
        if fetched:
            self.background.run(self.kv.warm(user_id, [(kv, None) for kv in fetched]))
        return self.replica_id

    async def holds(self, user_id: str, facts: list[tuple[str, int]], with_replica: bool = False):
        """Whether the worker store holds each `(fact_id, version)`: the KV side of a fact, for checks.
        `with_replica`: {"replica_id": this replica, "holds": [...]} (a check across several replicas)."""
        held = await self.engine.has_encoded(user_id, [kv_id(f, v) for f, v in facts])
        return {"replica_id": self.replica_id, "holds": held} if with_replica else held

    # ------------------------------------------------------------------------------ observability
    async def stats(self) -> dict:
        """This replica's counters, the users it holds, and the engine's (vLLM + worker store) metrics; the facts
        the worker found nowhere are re-queued first, so `facts_recomputed` counts them."""
        await self.kv.requeue_missing()
        engine = await self.engine.metrics()
        worker = engine.get("worker") or {}
        loads = {"facts_from_cluster": int(worker.get("fetched_facts", 0)),
                 "facts_unreadable": int(worker.get("fetch_unreadable", 0))}
        return {"replica_id": self.replica_id, "pid": os.getpid(), "disk_dir": self.disk_dir, "slot": replica_slot(),
                "serve_replica_id": serve_replica_id(), "engine_cpus": self.engine_cpus,
                "engine_niceness": self.engine_niceness,
                "users": self.books.held_users(), **self.counters, **loads, "admission": self.admission.stats(),
                "cluster": dict(self.cluster.counters) if self.cluster is not None else None,
                "resident": {"facts": self.resident.count(), "bytes": self.resident.bytes,
                             "budget_bytes": self.resident.budget_bytes},
                "engine": engine}

    async def health(self) -> str:
        await self.engine.has_encoded("__health__", ["probe"])  # a round trip to the engine's worker
        await asyncio.to_thread(self.registry.ping)
        return "ok"
