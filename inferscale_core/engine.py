"""Serving with memory: `(user_id, query, k, w)` -> retrieve -> compose ids -> vLLM generate with the memory's
KV injected by InferScaleConnector, or (mode="pi") the Mem0-style baseline that puts the same token ids in the
prompt as text. `InjectingEngine` wraps `vllm.LLM` (tests, benchmarks); `AsyncInjectingEngine` wraps vLLM's
`AsyncLLM` (serving).

The engine sits on `memory.Memory` (texts, index, encoder, the service-side KV): adding a fact encodes it
there, then pushes its KV once into the fact store inside vLLM's worker (`collective_rpc`). Requests carry
ids only. `w` names the context-window size a fact was encoded with: `add(..., ws=(0, 2))` keeps one encoding
per w in the worker (keyed `"{fact_id}@w{w}"`); Memory itself keeps the first.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .connector import (CONNECTOR_MODULE, CONNECTOR_NAME, METRIC_PREFIX, SHARED_NAMESPACE, WORKER_EXTENSION,
                        InjectionParams, cache_salt, check_vllm_version, memory_hash, pack_fact)
from .errors import check_id
from .memory import PREFIX_FACT, PREFIX_USER, Memory

Mode = Literal["kv", "pi"]
MODES = ("kv", "pi")
assert SHARED_NAMESPACE == PREFIX_USER, "the worker's shared namespace must be Memory's prefix namespace"


def variant_id(fact_id: str, w: int) -> str:
    """Worker-store id of a fact's encoding with a w-turn context window."""
    return f"{fact_id}@w{w}"


def _check_w(w) -> int:
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
        raise ValueError(f"w (context-window turns) must be an int >= 0, got {w!r}")
    return w


def kv_transfer_config(store_options: dict[str, Any] | None = None):
    """The KVTransferConfig that loads InferScaleConnector into vLLM. A failed injection (a fact deleted
    between retrieval and scheduling) makes vLLM recompute those tokens instead of failing the request."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE,
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config=dict(store_options or {}))


def engine_kwargs(model: str, dtype: torch.dtype | str, block_size: int, max_model_len: int,
                  enable_prefix_caching: bool, store_options: dict | None, **overrides) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` / `AsyncEngineArgs` with the connector and its worker extension."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    kw = dict(model=model, tokenizer=model, dtype=dtype, block_size=block_size, max_model_len=max_model_len,
              enable_prefix_caching=enable_prefix_caching, enforce_eager=True,
              worker_extension_cls=WORKER_EXTENSION, kv_transfer_config=kv_transfer_config(store_options),
              disable_log_stats=False)
    kw.update(overrides)
    return kw


@dataclass
class Query:
    user_id: str
    query: str
    k: int = 10
    w: int = 0
    mode: Mode = "kv"


@dataclass
class Prepared:
    """A request ready for vLLM: token ids and, in KV mode, the connector parameters and cache salt."""

    query: Query
    fact_ids: list[str]  # retrieved, in serving order (best last)
    prompt_ids: list[int]
    memory_len: int
    params: InjectionParams | None
    salt: str | None
    retrieve_s: float  # embed + search + compose

    def prompt(self) -> dict:
        p: dict[str, Any] = {"prompt_token_ids": self.prompt_ids}
        if self.salt is not None:
            p["cache_salt"] = self.salt
        return p

    def sampling(self, base):
        sp = base.clone()
        if self.params is not None:
            sp.extra_args = {**(sp.extra_args or {}), "kv_transfer_params": self.params.to_kv_transfer_params()}
        return sp


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    fact_ids: list[str]
    mode: Mode
    k: int
    w: int
    prompt_len: int
    memory_len: int
    num_cached_tokens: int  # prompt tokens vLLM did not prefill (injected + local prefix-cache hits)
    retrieve_s: float
    ttft_s: float | None = None  # submit -> first token (streaming engine only)
    logprobs: list | None = field(default=None, repr=False)


class _EngineCore:
    """What both engines share: keeping the worker store in step with Memory, and preparing requests."""

    def __init__(self, memory: Memory):
        self.memory = memory
        self.template = memory.template
        self.prefix_id = f"prefix-{memory_hash(self.template.prefix_ids)[:16]}"
        self._variants: dict[str, dict[str, set[int]]] = {}  # user -> fact -> ws held by the worker
        self._lock = threading.RLock()

    # ---- payloads for the worker extension (ids and packed bytes)
    @staticmethod
    def payload(fact_id: str, fact) -> tuple:
        return (fact_id, pack_fact(fact))

    def prefix_payload(self) -> list[tuple]:
        return [self.payload(self.prefix_id, self.memory.store.get(PREFIX_USER, PREFIX_FACT))]

    def existing_payloads(self) -> dict[str, list[tuple]]:
        """Every fact Memory already holds (reopened from disk), as its recorded w variant."""
        out: dict[str, list[tuple]] = {}
        for user in self.memory.users():
            for rec in self.memory.get_all(user):
                w = int(rec.metadata.get("w", len(rec.window)))
                out.setdefault(user, []).append(self.payload(variant_id(rec.fact_id, w),
                                                             self.memory.store.get(user, rec.fact_id)))
                self._variants.setdefault(user, {}).setdefault(rec.fact_id, set()).add(w)
        return out

    def encode_variants(self, user_id: str, facts: Sequence[str], windows: Sequence[Sequence[str]] | None,
                        fact_ids: Sequence[str] | None, ws: Sequence[int]) -> tuple[list[str], list[tuple]]:
        """Memory.add for the first w, plain encodes for the others; returns (fact ids, worker payloads)."""
        ws = [_check_w(w) for w in ws]
        if not ws or len(set(ws)) != len(ws):
            raise ValueError(f"ws must be distinct window sizes, got {ws!r}")
        facts = [facts] if isinstance(facts, str) else list(facts)
        full = [list(w) for w in windows] if windows is not None else [[] for _ in facts]
        cut = lambda w: [win[max(0, len(win) - w):] if w else [] for win in full]  # noqa: E731 - last w turns
        ids = self.memory.add(user_id, facts, cut(ws[0]), fact_ids, metadata={"w": ws[0]})
        payloads = [self.payload(variant_id(fid, ws[0]), self.memory.store.get(user_id, fid)) for fid in ids]
        for w in ws[1:]:
            items = [(self.template.fact_ids(t), self._context(win)) for t, win in zip(facts, cut(w))]
            for fid, enc in zip(ids, self.memory.encoder.encode_batch(items, progress=False)):
                payloads.append(self.payload(variant_id(fid, w), enc))
        return ids, payloads

    def _context(self, window: Sequence[str]) -> list:
        # Same context rule as Memory.add (instruction prefix first when Memory encodes behind it).
        return ([self.template.prefix_ids] if self.memory.prefix_window else []) + list(window)

    def stale_variants(self, user_id: str, ids: Sequence[str], ws: Sequence[int]) -> list[str]:
        """Worker ids of encodings a re-add does not refresh (their text may be outdated)."""
        with self._lock:
            facts = self._variants.get(user_id, {})
            return [variant_id(f, w) for f in ids for w in facts.get(f, ()) if w not in ws]

    def record_added(self, user_id: str, ids: Sequence[str], ws: Sequence[int]) -> None:
        with self._lock:
            facts = self._variants.setdefault(user_id, {})
            for fid in ids:
                facts[fid] = set(ws)  # a re-added fact loses variants it was not re-encoded for

    def forget(self, user_id: str, fact_id: str | None) -> list[str]:
        """Drop the bookkeeping of one fact (or the user); returns the worker ids to delete."""
        with self._lock:
            facts = self._variants.get(user_id, {})
            fids = [fact_id] if fact_id is not None else list(facts)
            out = [variant_id(f, w) for f in fids for w in facts.pop(f, ())]
            if not facts:
                self._variants.pop(user_id, None)
            return out

    # ---- requests
    def prepare(self, q: Query) -> Prepared:
        check_id("user_id", q.user_id)
        _check_w(q.w)
        if q.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {q.mode!r}")
        t0 = time.perf_counter()
        fact_ids = self.memory.retrieve(q.user_id, q.query, q.k)
        texts = [self.memory.get(q.user_id, f).text for f in fact_ids]
        memory_ids = list(self.template.prefix_ids)
        for t in texts:
            memory_ids += self.template.fact_ids(t)
        prompt_ids = memory_ids + self.template.query_ids(q.query)
        params = salt = None
        if q.mode == "kv" and fact_ids:
            with self._lock:
                held = self._variants.get(q.user_id, {})
                missing = [f for f in fact_ids if q.w not in held.get(f, ())]
            if missing:
                raise ValueError(f"facts {missing} of user {q.user_id!r} have no encoding with window w={q.w}; "
                                 f"add them with ws including {q.w}")
            worker_ids = [self.prefix_id] + [variant_id(f, q.w) for f in fact_ids]
            params = InjectionParams(q.user_id, tuple(worker_ids), len(memory_ids), memory_hash(memory_ids))
            versions = [0] + [self.memory.get(q.user_id, f).version for f in fact_ids]
            salt = cache_salt(q.user_id, worker_ids, versions)
        return Prepared(q, fact_ids, prompt_ids, len(memory_ids), params, salt, time.perf_counter() - t0)

    def answer(self, p: Prepared, out, ttft_s: float | None = None) -> Answer:
        c = out.outputs[0]
        return Answer(text=c.text, token_ids=list(c.token_ids), fact_ids=p.fact_ids, mode=p.query.mode,
                      k=p.query.k, w=p.query.w, prompt_len=len(p.prompt_ids), memory_len=p.memory_len,
                      num_cached_tokens=out.num_cached_tokens or 0, retrieve_s=p.retrieve_s, ttft_s=ttft_s,
                      logprobs=c.logprobs)


def default_sampling(max_tokens: int = 64):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def vllm_metrics() -> dict[str, float]:
    """InferScale counters and prompt tokens by source from this process's vLLM metrics registry."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    out: dict[str, float] = {}
    for m in get_metrics_snapshot():
        if m.name.startswith(METRIC_PREFIX):
            key = m.name.removeprefix(METRIC_PREFIX)
        elif m.name == "vllm:prompt_tokens_by_source":
            key = f"prompt_tokens_{m.labels['source']}"
        else:
            continue
        out[key] = out.get(key, 0) + getattr(m, "value", 0)
    return out


class InjectingEngine:
    """Synchronous engine over `vllm.LLM`. One per process: vLLM keeps its KV connector in a global."""

    def __init__(self, memory: Memory | None = None, model_path=None, *, dtype: torch.dtype = torch.float32,
                 block_size: int = 32, max_model_len: int = 4096, enable_prefix_caching: bool = True,
                 store_options: dict | None = None, **llm_kwargs):
        check_vllm_version()
        from vllm import LLM

        self.memory = memory if memory is not None else Memory(model_path, dtype=dtype)
        self.core = _EngineCore(self.memory)
        path = _model_path(self.memory, model_path)
        self.llm = LLM(**engine_kwargs(path, dtype, block_size, max_model_len, enable_prefix_caching,
                                       store_options, **llm_kwargs))
        self.block_size = block_size
        self._rpc("inferscale_put", SHARED_NAMESPACE, self.core.prefix_payload())
        for user, payloads in self.core.existing_payloads().items():
            self._rpc("inferscale_put", user, payloads)

    def _rpc(self, method: str, *args):
        return self.llm.collective_rpc(method, args=args)[0]

    # ---- memory management: Memory first, then the worker's store
    def add(self, user_id: str, facts: str | Sequence[str], windows: Sequence[Sequence[str]] | None = None,
            fact_ids: Sequence[str] | None = None, ws: Sequence[int] = (0,)) -> list[str]:
        ids, payloads = self.core.encode_variants(user_id, facts, windows, fact_ids, ws)
        stale = self.core.stale_variants(user_id, ids, ws)
        if stale:
            self._rpc("inferscale_delete", user_id, stale)
        self._rpc("inferscale_put", user_id, payloads)
        self.core.record_added(user_id, ids, ws)
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
    def prepare(self, user_id: str, query: str, k: int = 10, w: int = 0, mode: Mode = "kv") -> Prepared:
        return self.core.prepare(Query(user_id, query, k, w, mode))

    def generate(self, user_id: str, query: str, k: int = 10, w: int = 0, mode: Mode = "kv",
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
        _shutdown_llm(self.llm)


class AsyncInjectingEngine:
    """Streaming engine over vLLM's AsyncLLM: the serving path. Memory work (encoding, embedding) runs in a
    thread so the event loop keeps streaming tokens."""

    def __init__(self, memory: Memory | None = None, model_path=None, *, dtype: torch.dtype = torch.float32,
                 block_size: int = 32, max_model_len: int = 4096, enable_prefix_caching: bool = True,
                 store_options: dict | None = None, **engine_overrides):
        check_vllm_version()
        self.memory = memory if memory is not None else Memory(model_path, dtype=dtype)
        self.core = _EngineCore(self.memory)
        self._args = engine_kwargs(_model_path(self.memory, model_path), dtype, block_size, max_model_len,
                                   enable_prefix_caching, store_options, **engine_overrides)
        self.engine = None

    async def start(self) -> "AsyncInjectingEngine":
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._args))
        await self._rpc("inferscale_put", SHARED_NAMESPACE, self.core.prefix_payload())
        for user, payloads in self.core.existing_payloads().items():
            await self._rpc("inferscale_put", user, payloads)
        return self

    async def _rpc(self, method: str, *args):
        if self.engine is None:
            raise RuntimeError("AsyncInjectingEngine is not started: await engine.start() first")
        return (await self.engine.collective_rpc(method, args=args))[0]

    async def add(self, user_id: str, facts, windows=None, fact_ids=None, ws: Sequence[int] = (0,)) -> list[str]:
        ids, payloads = await asyncio.to_thread(self.core.encode_variants, user_id, facts, windows, fact_ids, ws)
        stale = self.core.stale_variants(user_id, ids, ws)
        if stale:
            await self._rpc("inferscale_delete", user_id, stale)
        await self._rpc("inferscale_put", user_id, payloads)
        self.core.record_added(user_id, ids, ws)
        return ids

    async def delete(self, user_id: str, fact_id: str) -> None:
        await asyncio.to_thread(self.memory.delete, user_id, fact_id)
        await self._rpc("inferscale_delete", user_id, self.core.forget(user_id, fact_id))

    async def delete_user(self, user_id: str) -> None:
        await asyncio.to_thread(self.memory.delete_user, user_id)
        self.core.forget(user_id, None)
        await self._rpc("inferscale_delete", user_id, None)

    async def preload(self, user_id: str) -> int:
        return await self._rpc("inferscale_preload", user_id)

    async def generate(self, user_id: str, query: str, k: int = 10, w: int = 0, mode: Mode = "kv",
                       sampling_params=None) -> Answer:
        """Runs to completion; `Answer.ttft_s` is submit -> first token, `retrieve_s` the time before it."""
        if self.engine is None:
            raise RuntimeError("AsyncInjectingEngine is not started: await engine.start() first")
        p = await asyncio.to_thread(self.core.prepare, Query(user_id, query, k, w, mode))
        sp = p.sampling(sampling_params or default_sampling())
        t0 = time.perf_counter()
        ttft = final = None
        async for out in self.engine.generate(p.prompt(), sp, request_id=uuid.uuid4().hex):
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            final = out
        return self.core.answer(p, final, ttft)

    async def metrics(self) -> dict[str, Any]:
        return {**vllm_metrics(), "worker": await self._rpc("inferscale_stats")}

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _model_path(memory: Memory, model_path) -> str:
    """The folder vLLM loads: `model_path`, else the folder Memory's model came from, else the default."""
    from pathlib import Path

    from .models import default_model_path, resolve_model_path

    if model_path is not None:
        return str(resolve_model_path(model_path))
    name = getattr(memory.model.config, "_name_or_path", "") or ""
    if name and (Path(name) / "config.json").exists():
        return name
    return str(default_model_path())


def _shutdown_llm(llm) -> None:
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
