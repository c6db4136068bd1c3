"""Engine replica deployment: one vLLM engine (AsyncInjectingEngine, InferScaleConnector) per replica process,
plus the KV of the users routed here.

Users are multiplexed (`multiplexed_model_id` = user id): Serve routes a user to a replica that already holds
it, and a replica holds at most MAX_USERS users (Serve's LRU). Loading a user ("sync") makes the worker store
hold the registry's facts of the user at their current versions:
  1. the registry (Redis) lists the user's facts and versions (one read of the version counter when nothing
     moved since the last sync),
  2. facts the worker store already has at that version are kept: after a restart they are found in its disk
     tier (`kv_dir`), written through on every put, so nothing is encoded again,
  3. the rest is encoded by the encoder pool from the registry's text and window; the KV comes back through
     the Ray object store.
Facts are stored in the worker under `kv_id(fact_id, version)`, so a copy on disk is used only for the exact
version the registry names; an update or a delete removes the older versions.

Writes from the gateway arrive as `put_facts(user, ids_versions, encoded)` where `encoded` is the encoder
pool's response that the gateway passed on unresolved: Serve resolves it here, from the object store. A write
is all or nothing: if the encoder failed on any of its facts, none is stored and the gateway undoes the
registry rows.

A fact the encoder cannot encode during a sync (stored by an older version, say) is marked unservable in the
registry for that version and left out; the user is answered from the facts that can be served.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from pathlib import Path

from ray import serve

import grpc

from inferscale_core.errors import UnknownFactError

from .api import ApiError
from .encoder_pool import EncodeFailure
from .registry import open_registry

log = logging.getLogger("inferscale.engine_replica")
MAX_USERS = int(os.environ.get("INFERSCALE_ENGINE_MAX_USERS", "256"))
API_MODES = {"inject": "kv", "prompt": "pi"}  # wire names -> engine modes


def kv_id(fact_id: str, version: int) -> str:
    """The worker-store id of one version of a fact."""
    return f"{fact_id}@v{int(version)}"


def older_kv_ids(fact_id: str, version: int) -> list[str]:
    """Ids of every earlier version (versions count up from 1, so this is exhaustive)."""
    return [kv_id(fact_id, v) for v in range(1, int(version))]


def replica_disk_dir(kv_dir: str | None) -> str | None:
    """`{kv_dir}/{app}/{deployment}/slot-{local rank}`: stable across restarts of the replica in that slot,
    so a restarted replica finds its predecessor's files, and never shared by two live replicas."""
    if not kv_dir:
        return None
    try:
        ctx = serve.get_replica_context()
        app, dep, slot = ctx.app_name, ctx.deployment, ctx.rank.local_rank
    except Exception:  # noqa: BLE001 - outside Serve (a direct test): one slot
        app, dep, slot = "local", "EngineReplica", 0
    path = Path(kv_dir).expanduser() / app / dep / f"slot-{slot}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


@contextlib.contextmanager
def _engine_death_is_unavailable():
    """A call that meets a dead vLLM engine is UNAVAILABLE (retryable: check_health has Serve replace this
    replica), not an internal error."""
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        yield
    except EngineDeadError:
        raise ApiError(grpc.StatusCode.UNAVAILABLE, "this engine replica's vLLM engine died; it is being replaced, "
                                                    "retry shortly") from None


class _HeldUser:
    """What the multiplexed loader hands Serve. Serve calls __del__ when it evicts the user (LRU); Python
    calls it again when the object dies, hence the flag."""

    def __init__(self, replica: "EngineReplica", user_id: str, loop: asyncio.AbstractEventLoop):
        self.replica, self.user_id, self.loop, self.released = replica, user_id, loop, False

    def __del__(self):
        if self.released:
            return
        self.released = True
        try:  # Serve runs this in a thread: hand the unload to the replica's loop
            asyncio.run_coroutine_threadsafe(self.replica._unload(self.user_id), self.loop)
        except RuntimeError:  # the loop is closed: the replica is going away anyway
            pass


class EngineReplica:
    """The Serve deployment (options in services/app.py)."""

    async def __init__(self, encoder, registry_url: str | None = None, model_path: str | None = None,
                       dtype: str = "float32", block_size: int = 32, max_model_len: int = 4096,
                       kv_dir: str | None = None, store_options: dict | None = None,
                       engine_overrides: dict | None = None):
        from inferscale_core.defaults import serving_store_options
        from inferscale_core.engine import AsyncInjectingEngine

        from .encoder_pool import dtype_of
        from .metrics import EngineMetrics, hide_multiplexed_ids

        hide_multiplexed_ids()  # before the first @serve.multiplexed call: user ids never become labels
        self.metrics = EngineMetrics()

        self.encoder = encoder
        self.registry = open_registry(registry_url)
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.disk_dir = replica_disk_dir(kv_dir)
        options = serving_store_options(store_options)
        if self.disk_dir:
            options["disk_dir"] = self.disk_dir
        # The instruction prefix is encoded by the pool that encodes the facts: one encoder, one layout.
        prefix = await encoder.prefix.remote()
        self.engine = AsyncInjectingEngine(model_path=model_path, prefix=prefix, dtype=dtype_of(dtype),
                                           block_size=block_size, max_model_len=max_model_len,
                                           store_options=options, **(engine_overrides or {}))
        await self.engine.start()
        self.max_model_len = max_model_len
        self._held: dict[str, dict[str, int]] = {}  # user -> fact_id -> version held by the worker store
        self._synced: dict[str, int] = {}            # user -> registry user_version last synced
        self._user_locks: dict[str, asyncio.Lock] = {}
        self.counters = {"facts_from_disk": 0, "facts_encoded": 0, "facts_pushed": 0, "users_loaded": 0,
                         "users_evicted": 0, "facts_unservable": 0}
        self._exporter = asyncio.get_running_loop().create_task(self._export_engine_metrics())

    # ------------------------------------------------------------------------------ user placement
    @serve.multiplexed(max_num_models_per_replica=MAX_USERS)
    async def _user(self, user_id: str) -> _HeldUser:
        await self._sync(user_id)
        await asyncio.to_thread(self.registry.add_placement, user_id, self.replica_id)
        self.counters["users_loaded"] += 1
        return _HeldUser(self, user_id, asyncio.get_running_loop())

    def _lock(self, user_id: str) -> asyncio.Lock:
        return self._user_locks.setdefault(user_id, asyncio.Lock())

    async def _sync(self, user_id: str) -> None:
        """Make the worker store hold exactly the registry's facts of the user, at their versions."""
        async with self._lock(user_id):
            version = await asyncio.to_thread(self.registry.user_version, user_id)
            if self._synced.get(user_id) == version:
                return
            # Read after `version`: a change landing in between bumps the counter again and the next
            # request re-syncs; this replica can only be ahead of `version`, never silently behind.
            wanted = await asyncio.to_thread(self.registry.fact_versions, user_id)
            held = self._held.setdefault(user_id, {})
            moved = {f: v for f, v in held.items() if wanted.get(f) != v}
            if moved:
                await self.engine.delete_encoded(user_id, [kv_id(f, v) for f, v in moved.items()])
                for f in moved:
                    del held[f]
            need = [(f, v) for f, v in wanted.items() if held.get(f) != v]
            if need:
                # Disk tier first: the worker store lists every fact written before a restart.
                present = await self.engine.has_encoded(user_id, [kv_id(f, v) for f, v in need])
                for (f, v), ok in zip(need, present):
                    if ok:
                        held[f] = v
                self.counters["facts_from_disk"] += sum(present)
                recs = []
                for (f, v), ok in zip(need, present):
                    if ok:
                        continue
                    try:
                        rec = await asyncio.to_thread(self.registry.get, user_id, f)
                    except UnknownFactError:
                        continue  # deleted since the listing; the next sync sees it
                    if not rec.unservable_reason:  # known bad at this version: not asked again
                        recs.append(rec)
                if recs:
                    encoded = await self.encoder.encode.remote([(r.text, list(r.window)) for r in recs])
                    good = [(r, e) for r, e in zip(recs, encoded) if not isinstance(e, EncodeFailure)]
                    for r, e in zip(recs, encoded):
                        if isinstance(e, EncodeFailure):
                            log.warning("fact %s v%d of a user cannot be encoded: %s", r.fact_id, r.version, e.reason)
                            await asyncio.to_thread(self.registry.set_unservable, user_id, r.fact_id, r.version,
                                                    e.reason)
                    if good:
                        await self._put(user_id, [(r.fact_id, r.version) for r, _ in good], [e for _, e in good])
                    self.counters["facts_encoded"] += len(good)
                    self.counters["facts_unservable"] += len(recs) - len(good)
            self._synced[user_id] = version

    async def _put(self, user_id: str, ids_versions: list[tuple[str, int]], encoded: list) -> None:
        if len(ids_versions) != len(encoded):
            raise ValueError(f"{len(ids_versions)} fact ids but {len(encoded)} encoded facts")
        await self.engine.put_encoded(user_id, [(kv_id(f, v), enc) for (f, v), enc in zip(ids_versions, encoded)])
        old = [i for f, v in ids_versions for i in older_kv_ids(f, v)]
        if old:
            await self.engine.delete_encoded(user_id, old)
        held = self._held.setdefault(user_id, {})
        for f, v in ids_versions:
            held[f] = v

    async def _unload(self, user_id: str) -> None:
        """LRU eviction. With a disk tier the worker store keeps the facts (its byte budgets decide what stays
        in memory) and a reload finds them there; without one they are dropped and re-encoded on reload."""
        async with self._lock(user_id):
            if not self.disk_dir:
                await self.engine.delete_encoded(user_id, None)
            self._held.pop(user_id, None)
            self._synced.pop(user_id, None)
        self.counters["users_evicted"] += 1
        await asyncio.to_thread(self.registry.remove_placement, user_id, self.replica_id)

    # ------------------------------------------------------------------------------ called by the gateway
    async def put_facts(self, user_id: str, ids_versions: list[tuple[str, int]], encoded: list) -> int:
        """`encoded` arrives resolved from the object store (the encoder's response, passed on unresolved).
        All or nothing: if the encoder failed on any fact, nothing is stored and the error names it."""
        with self.metrics.request("put_facts"), _engine_death_is_unavailable():
            ids_versions = [(f, int(v)) for f, v in ids_versions]
            for i, enc in enumerate(encoded):
                if isinstance(enc, EncodeFailure):
                    raise ApiError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"facts[{i}] could not be encoded: {enc.reason}; nothing was stored")
            async with self._lock(user_id):
                await self._put(user_id, ids_versions, encoded)
            self.counters["facts_pushed"] += len(encoded)
            # Load (sync) after the put: a first load then finds these facts held and encodes only the others.
            await self._user(user_id)
            return len(encoded)

    async def forget(self, user_id: str, facts: list[tuple[str, int]]) -> int:
        """Deleted facts `(fact_id, last version)`: every version of each leaves the worker store (and disk)."""
        with self.metrics.request("forget"):
            async with self._lock(user_id):
                ids = [i for f, v in facts for i in (*older_kv_ids(f, v), kv_id(f, v))]
                held = self._held.get(user_id, {})
                for f, _ in facts:
                    held.pop(f, None)
                return await self.engine.delete_encoded(user_id, ids)

    async def forget_user(self, user_id: str) -> int:
        with self.metrics.request("forget_user"):
            async with self._lock(user_id):
                self._held.pop(user_id, None)
                self._synced.pop(user_id, None)
                return await self.engine.delete_encoded(user_id, None)

    async def answer(self, user_id: str, query: str, fact_ids: list[str], max_tokens: int, temperature: float,
                     mode: str, conversation: list[dict] | None = None):
        """Streams {"text"} pieces, then the final {"final": True, ...} with TTFT and the injected fact ids.
        `conversation`: system messages and earlier turns, after the memory in the chat template."""
        from vllm import SamplingParams

        from inferscale_core.engine import Query

        with self.metrics.request("answer"), _engine_death_is_unavailable():
            if mode not in API_MODES:
                raise ValueError(f"mode must be one of {sorted(API_MODES)}, got {mode!r}")
            await self._user(user_id)
            await self._sync(user_id)  # cheap when nothing moved: one read of the version counter
            recs = []
            held = self._held.get(user_id, {})
            for f in fact_ids:  # retrieval may name a fact deleted since, or one that cannot be served: skip it
                try:
                    rec = await asyncio.to_thread(self.registry.get, user_id, f)
                except UnknownFactError:
                    continue
                if held.get(f) == rec.version:  # both modes serve the same facts (an A/B of injection)
                    recs.append(rec)
            q = Query(user_id, query, k=max(1, len(recs)), mode=API_MODES[mode],
                      conversation=tuple(conversation or ()))
            try:
                p = self.engine.prepare_facts(q, [r.fact_id for r in recs], [r.text for r in recs],
                                              [r.version for r in recs], [kv_id(r.fact_id, r.version) for r in recs])
            except ValueError as e:  # the chat template refused the conversation
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            if len(p.prompt_ids) >= self.max_model_len:
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"the prompt is {len(p.prompt_ids)} tokens (memory, conversation and query); the "
                               f"model's context is {self.max_model_len} tokens: send fewer or shorter messages")
            sp = SamplingParams(temperature=temperature, max_tokens=max_tokens)
            async for text, ans in self.engine.stream(p, sp):
                if ans is None:
                    yield {"text": text}
                    continue
                if ans.ttft_s is not None:
                    self.metrics.ttft.observe(ans.ttft_s, tags={"mode": mode})
                yield {"final": True, "fact_ids": ans.fact_ids, "ttft_ms": (ans.ttft_s or 0.0) * 1000,
                       "prompt_tokens": ans.prompt_len, "prefilled_tokens": ans.prompt_len - ans.num_cached_tokens,
                       "completion_tokens": len(ans.token_ids), "finish_reason": ans.finish_reason or "stop"}

    async def chat(self, messages: list[dict], max_tokens: int = 256, temperature: float = 0.0,
                   structured: dict | None = None) -> str:
        """Plain chat generation with the serving model, no memory (Mem0's extraction step). `structured`:
        the fields of vLLM's StructuredOutputsParams (json_object, json, regex, ...)."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        sp = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(**structured) if structured else None)
        text, _, _ = await self.engine.chat(messages, sp)
        return text

    async def chat_room(self, messages: list[dict]) -> int:
        """Tokens left in the context after these messages (negative when they do not fit)."""
        return self.max_model_len - len(self.engine.core.chat_prompt(messages)["prompt_token_ids"])

    async def load_user(self, user_id: str) -> str:
        """Loads the user onto THIS replica (whichever one Serve routed the call to; admin and tests: put a user
        on several replicas). Returns this replica's id."""
        from inferscale_core.errors import check_id

        await self._user(check_id("user_id", user_id))
        return self.replica_id

    async def holds(self, user_id: str, facts: list[tuple[str, int]]) -> list[bool]:
        """Whether the worker store holds each `(fact_id, version)`: the KV side of a fact, for checks."""
        return await self.engine.has_encoded(user_id, [kv_id(f, v) for f, v in facts])

    # ------------------------------------------------------------------------------ observability
    async def stats(self) -> dict:
        """This replica's counters, the users it holds, and the engine's (vLLM + worker store) metrics."""
        return {"replica_id": self.replica_id, "pid": os.getpid(), "disk_dir": self.disk_dir,
                "users": sorted(self._held), **self.counters, "engine": await self.engine.metrics()}

    async def health(self) -> str:
        await self.engine.has_encoded("__health__", ["probe"])  # a round trip to the engine's worker
        await asyncio.to_thread(self.registry.ping)
        return "ok"

    async def check_health(self) -> None:
        """Serve's replica health check (every health_check_period_s): a replica whose vLLM engine died (its
        engine-core process is gone) raises here, so Serve replaces it and its users move to a live one."""
        engine = self.engine.engine
        if engine is None:
            raise RuntimeError("the vLLM engine of this replica is not running")
        await engine.check_health()  # raises EngineDeadError once vLLM has seen its engine core die

    async def _export_engine_metrics(self, period_s: float = 5.0) -> None:
        """Copies the engine's counters (injected tokens, store hits and resident bytes per tier) into the
        replica's Prometheus metrics."""
        while True:
            try:
                self.metrics.engine_snapshot(await self.engine.metrics())
            except Exception as e:  # noqa: BLE001 - a dead engine is check_health's business
                log.debug("engine metrics unavailable: %s", e)
            await asyncio.sleep(period_s)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
