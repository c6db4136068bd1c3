"""Serving with an in-process Memory: `(user_id, query, k, w)` -> retrieve -> compose ids -> vLLM generate with the
memory's KV injected by InferScaleConnector, or (mode="pi") the Mem0-style baseline that puts the same token ids in
the prompt as text. `InjectingEngine` wraps `vllm.LLM`; `AsyncMemoryEngine` is the streaming serving engine
(inferscale_core/serving_engine.py) over a Memory. Tests, benchmarks and `inferscale demo` use them; the service's
engine replica runs the serving engine alone (no Memory).

The engine sits on `memory.Memory` (texts, index, encoder, the service-side KV): adding a fact encodes it
there, then pushes its KV once into the fact store inside vLLM's worker (`collective_rpc`). Requests carry
ids only. `w` names the context-window size a fact was encoded with: `add(..., ws=(0, 2))` keeps one encoding
per w in the worker (keyed `kv_id(fact_id, version, w)`); Memory itself keeps the first.

The request types (Query, Prepared, Answer) are in inferscale_core/requests.py, vLLM's set-up in vllm_setup.py.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from .connector import check_vllm_version
from .memory import PREFIX_FACT, Memory
from .ordering import check_serving_order
from .requests import Answer, Prepared, Query, RequestCore, check_w
from .serving_engine import AsyncInjectingEngine
from .types import SHARED_USER_ID, Mode, kv_id
from .vllm_setup import default_dtype, default_sampling, engine_kwargs, model_folder, shutdown_llm, vllm_metrics


class MemoryCore(RequestCore):
    """A RequestCore over an in-process Memory: keeps the worker store in step with Memory (one encoding per
    context-window size w, keyed `kv_id(fact_id, version, w)`) and retrieves the facts of a request itself."""

    def __init__(self, memory: Memory, serving_order: str = "relevance"):
        super().__init__(memory.template, memory.store.get(SHARED_USER_ID, PREFIX_FACT))
        self.memory, self.serving_order = memory, check_serving_order(serving_order)  # before vLLM starts
        # user -> fact -> (version, ws) of the encodings the worker holds
        self._variants: dict[str, dict[str, tuple[int, set[int]]]] = {}
        self._lock = threading.RLock()

    def existing_payloads(self) -> dict[str, list[tuple]]:
        """Every fact Memory already holds (reopened from disk), as its recorded w variant."""
        out: dict[str, list[tuple]] = {}
        for user in self.memory.users():
            for rec in self.memory.get_all(user):
                w = int(rec.metadata.get("w", len(rec.window)))
                out.setdefault(user, []).append(self.payload(kv_id(rec.fact_id, rec.version, w),
                                                             self.memory.store.get(user, rec.fact_id)))
                self._variants.setdefault(user, {})[rec.fact_id] = (rec.version, {w})
        return out

    def encode_variants(self, user_id: str, facts: Sequence[str], windows: Sequence[Sequence[str]] | None,
                        fact_ids: Sequence[str] | None, ws: Sequence[int]
                        ) -> tuple[list[str], list[int], list[tuple]]:
        """Memory.add for the first w, plain encodes for the others; returns (fact ids, their versions, worker
        payloads)."""
        memory = self.memory
        ws = [check_w(w) for w in ws]
        if not ws or len(set(ws)) != len(ws):
            raise ValueError(f"ws must be distinct window sizes, got {ws!r}")
        facts = [facts] if isinstance(facts, str) else list(facts)
        full = [list(w) for w in windows] if windows is not None else [[] for _ in facts]
        cut = lambda w: [win[max(0, len(win) - w):] if w else [] for win in full]  # noqa: E731 - last w turns
        ids = memory.add(user_id, facts, cut(ws[0]), fact_ids, metadata={"w": ws[0]})
        versions = [memory.get(user_id, fid).version for fid in ids]
        payloads = [self.payload(kv_id(fid, v, ws[0]), memory.store.get(user_id, fid)) for fid, v in zip(ids, versions)]
        for w in ws[1:]:
            items = [(self.template.fact_ids(t), memory.context(win)) for t, win in zip(facts, cut(w))]
            for fid, v, enc in zip(ids, versions, memory.encoder.encode_batch(items, progress=False)):
                payloads.append(self.payload(kv_id(fid, v, w), enc))
        return ids, versions, payloads

    def stale_variants(self, user_id: str, ids: Sequence[str], versions: Sequence[int], ws: Sequence[int]) -> list[str]:
        """kv_ids of encodings a re-add does not refresh: older versions, and windows it was not re-encoded for."""
        with self._lock:
            facts = self._variants.get(user_id, {})
            out = []
            for fid, version in zip(ids, versions):
                old_version, old_ws = facts.get(fid, (version, set()))
                out += [kv_id(fid, old_version, w) for w in old_ws if old_version != version or w not in ws]
            return out

    def record_added(self, user_id: str, ids: Sequence[str], versions: Sequence[int], ws: Sequence[int]) -> None:
        with self._lock:
            facts = self._variants.setdefault(user_id, {})
            for fid, version in zip(ids, versions):
                facts[fid] = (version, set(ws))  # a re-added fact loses variants it was not re-encoded for

    def forget(self, user_id: str, fact_id: str | None) -> list[str]:
        """Drop the bookkeeping of one fact (or the user); returns the kv_ids to delete."""
        with self._lock:
            facts = self._variants.get(user_id, {})
            fids = [fact_id] if fact_id is not None else list(facts)
            out = []
            for f in fids:
                version, ws = facts.pop(f, (0, set()))
                out += [kv_id(f, version, w) for w in ws]
            if not facts:
                self._variants.pop(user_id, None)
            return out

    # ---- requests
    def prepare(self, q: Query) -> Prepared:
        """Retrieve the user's top-k facts from Memory, then `prepare_facts`."""
        memory = self.memory
        self.check_query(q)
        t0 = time.perf_counter()
        fact_ids = memory.retrieve(q.user_id, q.query, q.k, self.serving_order)
        recs = [memory.get(q.user_id, f) for f in fact_ids]
        if q.mode == Mode.KV and fact_ids:
            with self._lock:
                held = self._variants.get(q.user_id, {})
                missing = [f for f in fact_ids if q.w not in held.get(f, (0, ()))[1]]
            if missing:
                raise ValueError(f"facts {missing} of user {q.user_id!r} have no encoding with window w={q.w}; "
                                 f"add them with ws including {q.w}")
        return self.prepare_facts(q, fact_ids, [r.text for r in recs], [r.version for r in recs], started=t0)


class InjectingEngine:
    """Synchronous engine over `vllm.LLM`. One per process: vLLM keeps its KV connector in a global.
    `dtype` None: `default_dtype()` (bf16 on an accelerator, fp32 on the CPU), for vLLM and a Memory it builds.
    `serving_order`: how retrieved facts are ordered in the memory (`ordering.serving_order`)."""

    def __init__(self, memory: Memory | None = None, model_path=None, *, dtype: torch.dtype | None = None,
                 block_size: int = 32, max_model_len: int = 4096, enable_prefix_caching: bool = True,
                 store_options: dict | None = None, serving_order: str = "relevance", **llm_kwargs):
        check_vllm_version()
        from vllm import LLM

        dtype = default_dtype() if dtype is None else dtype
        self.memory = memory if memory is not None else Memory(model_path, dtype=dtype)
        self.core = MemoryCore(self.memory, serving_order)
        path = model_folder(model_path, self.memory.model)
        self.llm = LLM(**engine_kwargs(path, dtype, block_size, max_model_len, enable_prefix_caching,
                                       store_options, **llm_kwargs))
        self.block_size = block_size
        self._rpc("inferscale_put", SHARED_USER_ID, self.core.prefix_payload())
        for user, payloads in self.core.existing_payloads().items():
            self._rpc("inferscale_put", user, payloads)

    def _rpc(self, method: str, *args):
        return self.llm.collective_rpc(method, args=args)[0]

    # ---- memory management: Memory first, then the worker's store
    def add(self, user_id: str, facts: str | Sequence[str], windows: Sequence[Sequence[str]] | None = None,
            fact_ids: Sequence[str] | None = None, ws: Sequence[int] = (0,)) -> list[str]:
        ids, versions, payloads = self.core.encode_variants(user_id, facts, windows, fact_ids, ws)
        stale = self.core.stale_variants(user_id, ids, versions, ws)
        if stale:
            self._rpc("inferscale_delete", user_id, stale)
        self._rpc("inferscale_put", user_id, payloads)
        self.core.record_added(user_id, ids, versions, ws)
        return ids

    def update(self, user_id: str, fact_id: str, text: str, window: Sequence[str] | None = None,
               ws: Sequence[int] = (0,)) -> None:
        old = self.memory.get(user_id, fact_id)
        self.add(user_id, [text], [list(window) if window is not None else old.window], [fact_id], ws)

    def delete(self, user_id: str, fact_id: str) -> None:
        self.memory.delete(user_id, fact_id)
        self._rpc("inferscale_delete", user_id, self.core.forget(user_id, fact_id))

    def delete_user(self, user_id: str) -> None:
        self.memory.delete_user(user_id)
        self.core.forget(user_id, None)
        self._rpc("inferscale_delete", user_id, None)

    def preload(self, user_id: str) -> int:
        return self._rpc("inferscale_preload", user_id)

    # ---- generation
    def prepare(self, user_id: str, query: str, k: int = 10, w: int = 0, mode: Mode = Mode.KV) -> Prepared:
        return self.core.prepare(Query(user_id, query, k, w, mode))

    def generate(self, user_id: str, query: str, k: int = 10, w: int = 0, mode: Mode = Mode.KV,
                 sampling_params=None) -> Answer:
        return self.generate_many([Query(user_id, query, k, w, mode)], sampling_params)[0]

    def generate_many(self, queries: Sequence[Query], sampling_params=None) -> list[Answer]:
        """One vLLM batch; KV and PI requests may be mixed."""
        base = sampling_params or default_sampling()
        prepared = [self.core.prepare(q) for q in queries]
        outs = self.llm.generate([p.prompt() for p in prepared], [p.sampling(base) for p in prepared],
                                 use_tqdm=False)
        return [self.core.answer(p, o) for p, o in zip(prepared, outs)]

    # ---- observability
    def metrics(self) -> dict[str, Any]:
        """Scheduler and worker counters from vLLM's metrics, plus the worker's cumulative dict."""
        return {**vllm_metrics(), "worker": self._rpc("inferscale_stats")}

    def shutdown(self) -> None:
        """Stop the engine and release vLLM's process-global state, so another engine can start here."""
        shutdown_llm(self.llm)


class AsyncMemoryEngine(AsyncInjectingEngine):
    """The serving engine over an in-process Memory (as InjectingEngine, streaming): Memory work (encoding,
    embedding) runs in a thread so the event loop keeps streaming tokens. Tests and benchmarks; the service runs
    AsyncInjectingEngine, which never carries a Memory."""

    core: MemoryCore

    def __init__(self, memory: Memory | None = None, model_path=None, *, dtype: torch.dtype | None = None,
                 block_size: int = 32, max_model_len: int = 4096, enable_prefix_caching: bool = True,
                 store_options: dict | None = None, stat_loggers: list | None = None, **engine_overrides):
        dtype = default_dtype() if dtype is None else dtype
        self.memory = memory if memory is not None else Memory(model_path, dtype=dtype)
        self._setup(MemoryCore(self.memory), model_folder(model_path, self.memory.model), dtype, block_size,
                    max_model_len, enable_prefix_caching, store_options, stat_loggers, engine_overrides)

    async def start(self) -> "AsyncMemoryEngine":
        await super().start()
        for user, payloads in self.core.existing_payloads().items():
            await self._rpc("inferscale_put", user, payloads)
        return self

    async def add(self, user_id: str, facts, windows=None, fact_ids=None, ws: Sequence[int] = (0,)) -> list[str]:
        ids, versions, payloads = await asyncio.to_thread(self.core.encode_variants, user_id, facts, windows,
                                                          fact_ids, ws)
        stale = self.core.stale_variants(user_id, ids, versions, ws)
        if stale:
            await self._rpc("inferscale_delete", user_id, stale)
        await self._rpc("inferscale_put", user_id, payloads)
        self.core.record_added(user_id, ids, versions, ws)
        return ids

    async def delete(self, user_id: str, fact_id: str) -> None:
        await asyncio.to_thread(self.memory.delete, user_id, fact_id)
        await self._rpc("inferscale_delete", user_id, self.core.forget(user_id, fact_id))

    async def delete_user(self, user_id: str) -> None:
        await asyncio.to_thread(self.memory.delete_user, user_id)
        self.core.forget(user_id, None)
        await self._rpc("inferscale_delete", user_id, None)

    # The Memory facade's generate (a user and a question, as InjectingEngine's) in place of the base class's
    # generate(prepared, sampling_params), which streams vLLM's outputs of a prepared request.
    async def generate(self, user_id: str, query: str, k: int = 10, w: int = 0,  # type: ignore[override]
                       mode: Mode = Mode.KV, sampling_params=None) -> Answer:
        """Runs to completion; `Answer.ttft_s` is submit -> first token, `retrieve_s` the time before it."""
        self._started()
        p = await asyncio.to_thread(self.core.prepare, Query(user_id, query, k, w, mode))
        answer = None
        async for _, answer in self.stream(p, sampling_params):
            pass
        assert answer is not None  # stream ends with the Answer
        return answer
