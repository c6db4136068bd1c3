"""A cold request's facts put into vLLM's engine core: the put awaited before the request is sent (as before) or
sent right ahead of it (AsyncInjectingEngine.send_put, what the engine replica does now), with the engine idle
and with its step loop busy with other requests' decoding.

Real vLLM (AsyncInjectingEngine, SmolLM2-135M, the service's settings), facts encoded beforehand by the encoder
pool's FactEncoder; each measured request is a new user's k facts (not in the worker store) and one question.
Measured: put start -> first token of the request (what the engine replica's kv_fetch_put + engine TTFT were),
modes alternating, one request at a time, while --busy other requests keep decoding (each generates
--busy-tokens, and a new one starts when one ends). The connector's failed loads are counted per mode: a put that
ran after its request would be one.

    python bench/put_ahead.py --requests 12 --busy 0,32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FACTS = ["{u} keeps {n} bee hives behind the house.", "{u} sails a small boat on Lake Geneva every weekend.",
         "{u}'s sister {n} works as a nurse in Lyon.", "{u} is allergic to peanuts and shellfish.",
         "{u} learned to play the cello at the age of {n}.", "{u} moved to Porto in {n} for a new job.",
         "{u}'s favourite dessert is lemon tart.", "{u} runs a marathon every spring."]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12, help="measured requests per mode and busy level")
    ap.add_argument("--busy", default="0,32", help="other requests decoding meanwhile")
    ap.add_argument("--busy-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    from inferscale_core.vllm_env import set_vllm_cpu_env

    set_vllm_cpu_env(1)
    from vllm import SamplingParams

    from bench.eval.serving import machine
    from inferscale_core.models import default_model_path
    from inferscale_core.requests import Query
    from inferscale_core.serving_engine import AsyncInjectingEngine
    from inferscale_core.types import Mode, kv_id
    from inferscale_server.encoder_pool import FactEncoder, dtype_of

    path = str(default_model_path())
    fe = FactEncoder(path, device="cpu", dtype=args.dtype)
    engine = await AsyncInjectingEngine(model_path=path, prefix=fe.prefix(), dtype=dtype_of(args.dtype),
                                        max_model_len=2048).start()
    busy_levels = [int(x) for x in args.busy.split(",")]
    modes = ("awaited", "sent_ahead")
    users = {}  # (busy, mode, i) -> (user, fact texts, encoded)
    for b in busy_levels:
        for m in modes:
            for i in range(args.requests):
                u = f"u{b}{m[0]}{i}"
                texts = [FACTS[j % len(FACTS)].format(u=u, n=i + j) for j in range(args.k)]
                users[(b, m, i)] = (u, texts, fe.encode([(t, []) for t in texts]))
    print(json.dumps({"machine": machine(), "dtype": args.dtype, "k": args.k, "busy_tokens": args.busy_tokens}))

    async def one(user: str, texts: list[str], encoded, mode: str) -> tuple[float, float]:
        ids = [f"f{j}" for j in range(len(texts))]
        items = [(kv_id(f, 1), e) for f, e in zip(ids, encoded)]
        t0 = time.perf_counter()
        if mode == "awaited":
            await engine.put_encoded(user, items)
            reply = None
        else:
            reply = await engine.send_put(user, items)
        t_sent = time.perf_counter()
        p = engine.prepare_facts(Query(user, "Where does the user live?", k=len(ids), mode=Mode.KV), ids, texts,
                                 [1] * len(ids), [i for i, _ in items])
        first = None
        async for text, ans in engine.stream(p, SamplingParams(temperature=0.0, max_tokens=4)):
            if first is None and (text or ans is not None):
                first = time.perf_counter()
        if reply is not None:
            await reply
        return t_sent - t0, first - t0

    async def decode_forever(stop: asyncio.Event) -> None:
        sp = SamplingParams(temperature=0.0, max_tokens=args.busy_tokens, ignore_eos=True)
        while not stop.is_set():
            async for _ in engine.engine.generate("Tell me a long story about a lighthouse keeper.", sp,
                                                  request_id=uuid.uuid4().hex):
                if stop.is_set():
                    break

    print("| busy requests | mode | put sent / answered (ms, p50) | put start -> first token p50 / p90 (ms) "
          "| failed loads |")
    print("|---|---|---|---|---|")
    rows = {}
    for b in busy_levels:
        stop = asyncio.Event()
        busy = [asyncio.create_task(decode_forever(stop)) for _ in range(b)]
        await asyncio.sleep(3 if b else 0)  # the busy requests past their prefill
        times = {m: [] for m in modes}
        failed = {m: 0 for m in modes}
        for i in range(args.requests):
            for m in (modes if i % 2 == 0 else modes[::-1]):
                before = (await engine.metrics())["worker"].get("load_failures", 0)
                times[m].append(await one(*users[(b, m, i)], m))
                failed[m] += (await engine.metrics())["worker"].get("load_failures", 0) - before
        stop.set()
        await asyncio.gather(*busy)
        for m in modes:
            sent = statistics.median(s for s, _ in times[m]) * 1000
            firsts = sorted(f for _, f in times[m])
            rows[(b, m)] = statistics.median(firsts)
            print(f"| {b} | {m} | {sent:.1f} | {1000 * statistics.median(firsts):.0f} / "
                  f"{1000 * firsts[int(0.9 * (len(firsts) - 1))]:.0f} | {failed[m]} |", flush=True)
    for b in busy_levels:
        print(f"busy {b}: awaited / sent_ahead first-token ratio {rows[(b, 'awaited')] / rows[(b, 'sent_ahead')]:.2f}")
    engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
