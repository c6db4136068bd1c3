"""Answering on one engine replica: a prepared request admitted against the KV cache (services/admission.py) and
streamed from the engine as AnswerPiece messages and one AnswerEnd (services/messages.py), for the gRPC Answer and
for OpenAI chat (n choices, logprobs, stop, structured outputs, forced tool calls); plain chat without memory
(Mem0's extraction step). The facts are the caller's business (core.py syncs them and makes their KV reachable).
Pieces after each choice's first are gathered `stream_interval` tokens at a time (PieceCoalescer); at most
CHOICES_AT_ONCE of a request's choices decode at a time (choice_outputs)."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import grpc

from ..admission import Admission
from ..errors import ApiError
from ..messages import AnswerEnd, AnswerPiece, AnswerRequest, Choice
from ..modes import wire_mode
from ..openai_params import logprobs_content, request, tool_calls
from .engine import ServingEngine, engine_timings, ms

# A request's choices (OpenAI's n) that decode at once; the others start as those finish. Why: every running
# sequence makes each engine step longer for everyone beside it, and one request may ask for 128 choices. On the
# reference node (one core of an AMD EPYC for the engine, fp32), small answers streamed beside one request of n x 780
# tokens took 1.12x (n=4), 1.45x (n=8), 1.89-2.11x (n=16, two runs) their time alone (bench/choices_beside.py, BENCHMARKS.md
# "Noisy neighbour"); logprobs added little to that. At 4, a request of n=16 takes about 4x longer for its own
# caller, and no longer for the others.
CHOICES_AT_ONCE = 4


async def choice_outputs(generate: Callable[[Any], AsyncIterator[Any]], sampling, at_once: int = CHOICES_AT_ONCE
                         ) -> AsyncGenerator[tuple[int, Any, Any], None]:
    """Every choice's outputs of a request with `sampling` (vLLM's SamplingParams, n choices) as (choice index,
    CompletionOutput, the RequestOutput it came in), from `generate(sampling_params)` (one vLLM request). Up to
    `at_once` choices: one request of n, as vLLM runs it. More: a request per choice, `at_once` of them decoding at a
    time, each with what vLLM gives its own children of an n-choice request (parallel_sampling.ParentRequest: n=1,
    the seed + the choice's index when a seed is set), so the choices are the same as vLLM's n would make them.
    Closing this iterator (the caller gone) ends every request it started; a choice's error ends it and is raised."""
    n = sampling.n
    if n <= at_once:
        async for out in generate(sampling):
            for c in out.outputs:
                yield c.index, c, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    todo = iter(range(n))
    done = object()

    async def run_choices() -> None:
        for index in todo:  # shared: each runner takes the next choice not yet started
            child = copy.copy(sampling)
            child.n = 1
            if sampling.seed is not None:
                child.seed = sampling.seed + index
            async for out in generate(child):
                for c in out.outputs:
                    await queue.put((index, c, out))

    async def runner() -> None:
        try:
            await run_choices()
        except BaseException as e:  # handed to the consumer, which raises it and ends the other runners
            await queue.put(e)
            raise
        finally:
            await queue.put(done)

    runners = [asyncio.create_task(runner()) for _ in range(min(at_once, n))]
    try:
        running = len(runners)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in runners:
            t.cancel()
        await asyncio.gather(*runners, return_exceptions=True)


class PieceCoalescer:
    """A streamed answer in fewer, larger pieces, as vLLM's `--stream-interval` sends them: each choice's first
    piece goes out at once (the first token's latency is what a caller waits on), then the choice's text (and
    logprobs) is held until `interval` tokens have gathered, and what is held goes out when the choice finishes or
    before the answer's end. Why: every piece crosses two Ray hops (engine replica -> gateway -> Serve's proxy),
    about 2 ms of CPU on these cores per piece (bench/stream_pieces.py; lab notes "Fewer pieces per answer"), on the
    cores the engine needs. `interval` 1: every piece as the engine made it."""

    def __init__(self, interval: int):
        self.interval = interval
        self._started: set[int] = set()
        self._held: dict[int, tuple[str, list | None, int]] = {}  # choice -> (text, logprobs, tokens)

    def add(self, piece: AnswerPiece, tokens: int, finished: bool = False) -> AnswerPiece | None:
        """The piece to send now, if any; `tokens`: the engine tokens behind `piece`, `finished`: its choice ended."""
        if self.interval <= 1:
            return piece
        if piece.index not in self._started:
            self._started.add(piece.index)
            return piece
        text, logprobs, count = self._held.pop(piece.index, ("", None, 0))
        if piece.logprobs is not None:
            logprobs = (logprobs or []) + piece.logprobs
        text, count = text + piece.text, count + tokens
        if count >= self.interval or finished:
            return AnswerPiece(text, piece.index, logprobs)
        self._held[piece.index] = (text, logprobs, count)
        return None

    def flush(self) -> list[AnswerPiece]:
        """What is held, by choice, before the answer's end."""
        held, self._held = self._held, {}
        return [AnswerPiece(text, index, logprobs) for index, (text, logprobs, _) in sorted(held.items())]


class Answering:
    def __init__(self, engine: ServingEngine, admission: Admission, metrics, stream_interval: int):
        self.engine, self.admission, self.metrics = engine, admission, metrics
        self.stream_interval = stream_interval  # tokens a streamed piece gathers after the first (PieceCoalescer)
        self.max_model_len = engine.max_model_len()  # as vLLM resolved it (the model's own when not given)

    def check_fits(self, prompt_len: int) -> None:
        if prompt_len >= self.max_model_len:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"the prompt is {prompt_len} tokens (memory, conversation and query); the model's "
                           f"context is {self.max_model_len} tokens: send fewer or shorter messages")

    async def stream(self, p, req: AnswerRequest, t_in: float,
                     hops: dict[str, float]) -> AsyncIterator[AnswerPiece | AnswerEnd]:
        """The answer to prepared request `p`; `hops`: the replica's timings so far (AnswerEnd.timings_ms)."""
        from vllm import SamplingParams

        self.check_fits(len(p.prompt_ids))
        if req.openai is not None:
            async with contextlib.aclosing(self._stream_openai(p, req, t_in, hops)) as pieces_of_openai:
                async for piece in pieces_of_openai:
                    yield piece
            return
        sp = SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens)
        pieces = PieceCoalescer(self.stream_interval)
        with self.admission.admit(req.user_id, min(len(p.prompt_ids) + req.max_tokens, self.max_model_len)):
            t_submit = time.perf_counter()
            async for text, ans in self.engine.stream(p, sp):
                if ans is None:  # the new text of an engine step: one token (counted as one when vLLM merged
                    # several steps' text for a busy loop: a piece then holds more than the interval)
                    piece = pieces.add(AnswerPiece(text), tokens=1)
                    if piece is not None:
                        yield piece
                    continue
                for piece in pieces.flush():
                    yield piece
                if ans.ttft_s is not None:
                    self.metrics.ttft.observe(ans.ttft_s, tags={"mode": wire_mode(req.mode)})
                yield AnswerEnd(fact_ids=list(ans.fact_ids), ttft_ms=(ans.ttft_s or 0.0) * 1000,
                                prompt_tokens=ans.prompt_len, prefilled_tokens=ans.prompt_len - ans.num_cached_tokens,
                                completion_tokens=len(ans.token_ids), finish_reason=ans.finish_reason or "stop",
                                timings_ms={**hops, "admission_wait": ms(t_submit - t_in), **engine_timings(ans)})

    async def _stream_openai(self, p, req: AnswerRequest, t_in: float, hops: dict[str, float]):
        """An OpenAI chat request's answer: vLLM's SamplingParams from the request (n choices, logprobs, stop,
        structured outputs, forced tool calls), streamed by choice."""
        from inferscale_core.connector_types import LoadReport

        chat = req.openai
        assert chat is not None  # stream sends only OpenAI chat requests here
        oai = request(chat.sampling or {}, len(p.prompt_ids), self.max_model_len, self.engine.sampling_defaults())
        sp, n = oai.sampling, oai.sampling.n
        assert sp.max_tokens is not None  # request() always sets it (the room left in the context at most)
        tokenizer = self.engine.tokenizer()
        texts, counts, finish = [""] * n, [0] * n, [None] * n
        pieces = PieceCoalescer(self.stream_interval)
        running = min(n, CHOICES_AT_ONCE)  # choices holding KV at once (choice_outputs)
        with self.admission.admit(req.user_id, min(len(p.prompt_ids) + running * sp.max_tokens,
                                                   running * self.max_model_len)):
            t_submit = time.perf_counter()
            ttft, final = None, None
            try:
                # closed as soon as this answer ends or its caller leaves, not when it is garbage-collected: every
                # choice it started is aborted in vLLM then
                async with contextlib.aclosing(choice_outputs(lambda s: self.engine.generate(p, s), sp)) as outputs:
                    async for index, c, out in outputs:
                        if index == 0 or n == running:  # the request (or the first choice's) that prefilled
                            final = out
                        if ttft is None and c.token_ids:
                            ttft = time.perf_counter() - t_submit
                        logprobs = (logprobs_content(c.token_ids, c.logprobs, oai.top_logprobs, tokenizer)
                                    if oai.top_logprobs is not None and c.logprobs else None)
                        texts[index] += c.text
                        counts[index] += len(c.token_ids)
                        finish[index] = c.finish_reason or finish[index]
                        if c.text or logprobs is not None:
                            piece = pieces.add(AnswerPiece(c.text, index, logprobs), tokens=len(c.token_ids),
                                               finished=c.finish_reason is not None)
                            if piece is not None:
                                yield piece
            except ValueError as e:  # vLLM's input checks (e.g. more logprobs than the engine's max_logprobs)
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(e).splitlines()[0][:500]) from None
        for piece in pieces.flush():
            yield piece
        if ttft is not None:
            self.metrics.ttft.observe(ttft, tags={"mode": wire_mode(req.mode)})
        choices = []
        for i in range(n):
            reason = finish[i] or "stop"
            calls = tool_calls(texts[i], oai.tool_choice) if oai.tool_choice is not None else None
            if calls is not None and oai.tool_choice == "required":
                reason = "tool_calls"
            choices.append(Choice(i, reason, counts[i], calls))
        stats = SimpleNamespace(ttft_s=ttft, engine_stats=getattr(final, "metrics", None),  # engine_timings' view
                                kv_load=LoadReport.from_kv_transfer_params(getattr(final, "kv_transfer_params", None)))
        yield AnswerEnd(fact_ids=list(p.fact_ids), ttft_ms=(ttft or 0.0) * 1000, prompt_tokens=len(p.prompt_ids),
                        prefilled_tokens=len(p.prompt_ids) - ((final.num_cached_tokens or 0) if final else 0),
                        completion_tokens=sum(counts), finish_reason=choices[0].finish_reason, choices=choices,
                        max_tokens=sp.max_tokens,
                        timings_ms={**hops, "admission_wait": ms(t_submit - t_in), **engine_timings(stats)})

    async def chat(self, user_id: str, messages: list[dict], max_tokens: int, temperature: float,
                   structured: dict | None) -> str:
        """Plain chat generation with the serving model for `user_id`, no memory (the user's text stays text, the
        prompt under the user's cache salt). `structured`: the fields of vLLM's StructuredOutputsParams
        (json_object, json, regex, ...). Admitted like answers: it shares the KV cache. Tokenized in a thread,
        once: the replica's event loop streams other answers meanwhile."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        sp = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(**structured) if structured else None)
        prompt = await asyncio.to_thread(self.engine.chat_prompt, messages, user_id)
        with self.admission.admit(user_id, min(len(prompt["prompt_token_ids"]) + max_tokens, self.max_model_len)):
            # Background: its ~1.5k-token prompt prefills in the steps the answers leave (background_prefill.py).
            text, _, _ = await self.engine.chat(prompt, sp, background=True)
        return text

    async def chat_room(self, user_id: str, messages: list[dict]) -> int:
        """Tokens left in the context after these messages of `user_id` (negative when they do not fit)."""
        prompt = await asyncio.to_thread(self.engine.chat_prompt, messages, user_id)
        return self.max_model_len - len(prompt["prompt_token_ids"])
