"""The background-prefill scheduler (inferscale_core/background_prefill.py) in a real engine: the serving engine as the
engine replica starts it (AsyncLLM with the connector, the replica's long-prefill cap and scheduler_cls; SmolLM2 fp32).
A background request (Mem0's extraction prompts) answers exactly what the same prompt answers as a foreground one;
beside a decoding stream its prefill takes one step in BACKGROUND_EVERY_STEPS, so it neither slows every step of
that stream nor starves."""
from __future__ import annotations

import asyncio
import os

import pytest
import torch

from inferscale_core.vllm_env import vllm_cpu_env

pytestmark = pytest.mark.slow
VLLM_ENV = {**vllm_cpu_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
LONG_TOKENS = 1500  # ~ mem0's compact extraction prompt; 6 steps of 256 tokens
STREAM_TOKENS = 120


def _long_text(tokenizer, tag: str) -> str:
    text, i = f"[{tag}] ", 0
    while len(tokenizer.encode(text)) < LONG_TOKENS:
        text += f"The ferry to the island leaves at {i} past the hour when the harbour is calm. "
        i += 1
    return text


def test_a_background_prefill_runs_in_the_steps_others_leave_and_answers_the_same(smollm2_path):
    for k, v in VLLM_ENV.items():
        os.environ[k] = v
    from vllm import SamplingParams

    from inferscale_core.background_prefill import BACKGROUND_EVERY_STEPS, SCHEDULER_CLS
    from inferscale_core.engine import AsyncMemoryEngine
    from inferscale_core.memory import Memory
    from inferscale_server.engine_replica.config import LONG_PREFILL_TOKENS

    chunks = -(-LONG_TOKENS // LONG_PREFILL_TOKENS)

    async def run():
        aeng = await AsyncMemoryEngine(Memory(smollm2_path, dtype=torch.float32), smollm2_path, dtype=torch.float32,
                                       max_model_len=2048, scheduler_cls=SCHEDULER_CLS,
                                       long_prefill_token_threshold=LONG_PREFILL_TOKENS).start()
        try:
            tok = aeng.tokenizer()
            greedy = SamplingParams(temperature=0.0, max_tokens=12)

            def prompt(tag: str, user: str) -> dict:
                msgs = [{"role": "user", "content": _long_text(tok, tag) + "\nWhen does the ferry leave?"}]
                return aeng.chat_prompt(msgs, user)

            # Alone: the same text either way (different users: different cache salts, so no prefix-cache hit).
            fg_text = (await aeng.chat(prompt("same", "fg-user"), greedy))[0]
            bg_text = (await aeng.chat(prompt("same", "bg-user"), greedy, background=True))[0]

            # Beside a stream decoding STREAM_TOKENS tokens: the stream's tokens when the background request ended.
            stream_tokens: list[int] = []
            started = asyncio.Event()

            async def stream():
                sp = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True)
                async for out in aeng.engine.generate(aeng.chat_prompt([{"role": "user", "content": "Count."}], "s"),
                                                      sp, request_id="stream"):
                    stream_tokens[:] = [len(out.outputs[0].token_ids)]
                    if stream_tokens[0] >= 4:
                        started.set()

            async def background():
                await started.wait()
                at_start = stream_tokens[0]
                await aeng.chat(prompt("beside", "bg-user-2"), SamplingParams(temperature=0.0, max_tokens=1),
                                background=True)
                return at_start, stream_tokens[0]

            _, (at_start, at_end) = await asyncio.gather(stream(), background())
            return fg_text, bg_text, at_start, at_end
        finally:
            aeng.shutdown()

    fg_text, bg_text, at_start, at_end = asyncio.run(run())
    assert bg_text == fg_text and fg_text
    steps_beside = at_end - at_start  # the stream takes one token per step
    # Held out of the other steps, its chunks ran one step in BACKGROUND_EVERY_STEPS: vLLM's own scheduler runs them
    # in the next `chunks` steps (~7 of the stream's tokens).
    assert steps_beside >= (chunks - 1) * BACKGROUND_EVERY_STEPS, (at_start, at_end, chunks)
    assert at_end < STREAM_TOKENS, (at_start, at_end)  # and it never starves: done before the stream ended
