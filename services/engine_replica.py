"""Engine replica deployment: one vLLM engine with InferScaleConnector, plus the KV of the users routed here.

Users are multiplexed (`multiplexed_model_id` = user id). A replica that gets a user it does not hold loads
the user's facts into its engine worker's store: the registry (Redis) lists the user's facts and versions,
and whatever is missing is re-encoded from the registry's text by the encoder pool. At most MAX_USERS users
are held per replica (Serve's LRU); an evicted user's KV is dropped from the worker. The placement map in
the registry records which replicas hold which users.

Writes arrive as `put_facts(user, ids, encoded)` where `encoded` is the encoder pool's response passed on
unresolved by the gateway: Serve resolves it here, from the Ray object store. Every request re-checks the
user's version counter in the registry, so a change that reached another replica (or none) is picked up.

STATUS: written against inferscale_core.engine as of this commit; it needs a GPU or the CPU vLLM build and
has not run end to end yet (see docs/deploy.md, "End-to-end test").
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid

from ray import serve

from inferscale_core.errors import UnknownFactError

from .registry import open_registry

MAX_USERS = int(os.environ.get("INFERSCALE_ENGINE_MAX_USERS", "256"))


class _HeldUser:
    """Serve's handle on a loaded user; __del__ runs when Serve evicts the user (LRU)."""

    def __init__(self, replica: "EngineReplica", user_id: str):
        self.replica, self.user_id = replica, user_id

    async def __del__(self):
        await self.replica._unload(self.user_id)


class EngineReplica:
    """The Serve deployment (options in services/app.py)."""

    def __init__(self, encoder, registry_url: str | None = None, model_path: str | None = None,
                 dtype: str = "float32", block_size: int = 32, max_model_len: int = 4096,
                 engine_overrides: dict | None = None):
        import torch

        from inferscale_core.engine import AsyncInjectingEngine
        from inferscale_core.memory import Memory

        from .encoder_pool import dtype_of

        self.encoder = encoder
        self.registry = open_registry(registry_url)
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # TODO(engine): the engine takes a Memory for its template and prefix chunk; a serving replica needs
        # neither Memory's index nor its in-process encoding. Ask the engine for a Memory-free constructor.
        memory = Memory(model_path, device=device, dtype=dtype_of(dtype))
        self.engine = AsyncInjectingEngine(memory, model_path, dtype=dtype_of(dtype), block_size=block_size,
                                           max_model_len=max_model_len, **(engine_overrides or {}))
        self.template = memory.template
        self._started = asyncio.Lock()
        self._held: dict[str, dict[str, int]] = {}  # user -> fact_id -> version in the worker store
        self._synced: dict[str, int] = {}           # user -> registry user_version last synced
        self._user_locks: dict[str, asyncio.Lock] = {}

    async def _engine(self):
        async with self._started:
            if self.engine.engine is None:
                await self.engine.start()
        return self.engine

    # ------------------------------------------------------------------------------ user placement
    @serve.multiplexed(max_num_models_per_replica=MAX_USERS)
    async def _user(self, user_id: str) -> _HeldUser:
        await self._sync(user_id)
        await asyncio.to_thread(self.registry.add_placement, user_id, self.replica_id)
        return _HeldUser(self, user_id)

    def _lock(self, user_id: str) -> asyncio.Lock:
        return self._user_locks.setdefault(user_id, asyncio.Lock())

    async def _sync(self, user_id: str) -> None:
        """Make the worker store hold exactly the registry's facts of the user, at their versions."""
        async with self._lock(user_id):
            version = await asyncio.to_thread(self.registry.user_version, user_id)
            if self._synced.get(user_id) == version:
                return
            wanted = await asyncio.to_thread(self.registry.fact_versions, user_id)
            held = self._held.setdefault(user_id, {})
            gone = [f for f in held if f not in wanted]
            if gone:
                await self._delete(user_id, gone)
            stale = [f for f, v in wanted.items() if held.get(f) != v]
            recs = []
            for fid in stale:
                try:
                    recs.append(await asyncio.to_thread(self.registry.get, user_id, fid))
                except UnknownFactError:
                    continue  # deleted meanwhile; the next sync sees it
            if recs:
                # TODO(disk tier): reload from this node's disk tier before re-encoding, once the worker
                # store exposes it; re-encoding from the registry's text is always correct, only slower.
                encoded = await self.encoder.encode.remote([(r.text, list(r.window)) for r in recs])
                await self._put(user_id, [(r.fact_id, r.version) for r in recs], encoded)
            self._synced[user_id] = version

    async def _put(self, user_id: str, ids_versions: list[tuple[str, int]], encoded: list) -> None:
        from inferscale_core.engine import _EngineCore, variant_id

        if len(ids_versions) != len(encoded):
            raise ValueError(f"{len(ids_versions)} fact ids but {len(encoded)} encoded facts")
        engine = await self._engine()
        payloads = [_EngineCore.payload(variant_id(fid, 0), enc) for (fid, _), enc in zip(ids_versions, encoded)]
        await engine._rpc("inferscale_put", user_id, payloads)
        held = self._held.setdefault(user_id, {})
        for fid, ver in ids_versions:
            held[fid] = ver

    async def _delete(self, user_id: str, fact_ids: list[str] | None) -> None:
        from inferscale_core.engine import variant_id

        engine = await self._engine()
        held = self._held.get(user_id, {})
        if fact_ids is None:
            await engine._rpc("inferscale_delete", user_id, None)
            self._held.pop(user_id, None)
            self._synced.pop(user_id, None)
            return
        await engine._rpc("inferscale_delete", user_id, [variant_id(f, 0) for f in fact_ids if f in held])
        for f in fact_ids:
            held.pop(f, None)

    async def _unload(self, user_id: str) -> None:
        async with self._lock(user_id):
            await self._delete(user_id, None)
        await asyncio.to_thread(self.registry.remove_placement, user_id, self.replica_id)

    # ------------------------------------------------------------------------------ called by the gateway
    async def put_facts(self, user_id: str, ids_versions: list[tuple[str, int]], encoded: list) -> int:
        """`encoded` arrives resolved from the object store (the encoder's response, passed on unresolved)."""
        async with self._lock(user_id):
            await self._put(user_id, ids_versions, encoded)
        # Load (sync) after the put: a first load then finds these facts held and encodes only the others.
        await self._user(user_id)
        return len(encoded)

    async def forget(self, user_id: str, fact_ids: list[str]) -> None:
        async with self._lock(user_id):
            await self._delete(user_id, fact_ids)

    async def forget_user(self, user_id: str) -> None:
        async with self._lock(user_id):
            await self._delete(user_id, None)

    async def answer(self, user_id: str, query: str, fact_ids: list[str], max_tokens: int, temperature: float,
                     mode: str):
        """Streams {"text"} pieces, then the final {"final": True, ...} with TTFT and the injected fact ids."""
        from vllm import SamplingParams

        from inferscale_core.connector import InjectionParams, cache_salt, memory_hash
        from inferscale_core.engine import variant_id

        await self._user(user_id)
        await self._sync(user_id)  # cheap when nothing moved: one read of the version counter
        recs = await asyncio.to_thread(self.registry.get_many, user_id, fact_ids)
        # TODO(engine): this mirrors _EngineCore.prepare for ids chosen by the retrieval deployment; the
        # engine should expose a prepare(user, fact_ids, texts, versions, mode) so there is one copy.
        memory_ids = list(self.template.prefix_ids)
        for r in recs:
            memory_ids += self.template.fact_ids(r.text)
        prompt = {"prompt_token_ids": memory_ids + self.template.query_ids(query)}
        sp = SamplingParams(temperature=temperature, max_tokens=max_tokens)
        engine = await self._engine()
        if mode == "inject" and recs:
            worker_ids = [engine.core.prefix_id] + [variant_id(r.fact_id, 0) for r in recs]
            params = InjectionParams(user_id, tuple(worker_ids), len(memory_ids), memory_hash(memory_ids))
            sp.extra_args = {"kv_transfer_params": params.to_kv_transfer_params()}
            prompt["cache_salt"] = cache_salt(user_id, worker_ids, [0] + [r.version for r in recs])
        t0, ttft, sent, final = time.perf_counter(), None, 0, None
        async for out in engine.engine.generate(prompt, sp, request_id=uuid.uuid4().hex):
            c = out.outputs[0]
            if ttft is None and c.token_ids:
                ttft = (time.perf_counter() - t0) * 1000
            if len(c.text) > sent:
                yield {"text": c.text[sent:]}
                sent = len(c.text)
            final = out
        c = final.outputs[0]
        yield {"final": True, "fact_ids": [r.fact_id for r in recs], "ttft_ms": ttft or 0.0,
               "prompt_tokens": len(prompt["prompt_token_ids"]),
               "prefilled_tokens": len(prompt["prompt_token_ids"]) - (final.num_cached_tokens or 0),
               "completion_tokens": len(c.token_ids), "finish_reason": c.finish_reason or "stop"}

    async def health(self) -> str:
        await self._engine()
        await asyncio.to_thread(self.registry.ping)
        return "ok"
