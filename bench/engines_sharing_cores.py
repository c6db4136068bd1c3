"""Several vLLM CPU engines on one node: bound to the same cores, or each to its own (issue 18, 2 engine replicas).

vLLM's CPU engine runs each layer as OpenMP parallel regions ending in a barrier, with one thread pinned per
core it is given (VLLM_CPU_OMP_THREADS_BIND). Two engines given the same cores preempt each other's threads
inside those regions. This script measures what that costs and what `engine_cpu_cores` (services/
engine_replica/placement.py bind_engine_cpus: each replica its own run of cores by node-local rank) gives back. In one run:

  one      one engine bound to every usable core, all requests
  shared   E engines, each with a thread per usable core (what engine replicas did before engine_cpu_cores)
  threads  E engines, each with cores // E threads, not bound (is the thread count alone enough?)
  own      E engines, engine i bound to inferscale_core.vllm_env.engine_cpus(cores // E, i, cpus) with
           engine_bind_env (what an engine replica with engine_cpu_cores does)

Each engine is a process of its own (as an engine replica is) running vLLM's AsyncLLM with the model; the E engines
start together and send at once (a file barrier). The same prompts everywhere (~190 tokens of text, plain prompts:
the contention is the engine's, whatever fills the prompt), greedy, --max-tokens tokens, --concurrency requests in
flight in all (split evenly), --requests in all. Prints req/s per configuration and its ratio to `one`.

    python bench/engines_sharing_cores.py --dtype bfloat16            # ~3 min on 2 cores
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = "Alice adopted a cat named Pixel in March and she likes hiking on weekends with Bob. " * 8


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=2, help="engines sharing the node (default 2)")
    ap.add_argument("--requests", type=int, default=200, help="requests per configuration, in all")
    ap.add_argument("--concurrency", type=int, default=100, help="requests in flight, in all")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "engines_sharing_cores.md")
    ap.add_argument("--worker", nargs=4, metavar=("TAG", "REQUESTS", "CONCURRENCY", "BARRIER_DIR"),
                    help=argparse.SUPPRESS)
    return ap.parse_args(argv)


async def worker(args) -> None:
    """One engine: warm up, wait at the barrier for the others, send the requests, print one JSON line."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from inferscale_core.models import default_model_path

    tag, n_req, conc, barrier = args.worker[0], int(args.worker[1]), int(args.worker[2]), Path(args.worker[3])
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(default_model_path()), dtype=args.dtype,
                                                       max_model_len=2048, enable_prefix_caching=False))
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    async def one(i: int) -> None:
        async for _ in engine.generate(f"{i} {TEXT} Question {i}: what is the cat called?", sp,
                                       request_id=f"{tag}-{i}"):
            pass

    for i in range(4):  # one-off kernel setup, as a serving engine has done before its load
        await one(1_000_000 + i)
    (barrier / f"ready-{tag}").touch()
    expected = int((barrier / "expected").read_text())
    deadline = time.monotonic() + 600
    while len(list(barrier.glob("ready-*"))) < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    sem = asyncio.Semaphore(conc)

    async def limited(i: int) -> None:
        async with sem:
            await one(i)

    t = time.perf_counter()
    await asyncio.gather(*(limited(i) for i in range(n_req)))
    wall = time.perf_counter() - t
    print(json.dumps({"tag": tag, "requests": n_req, "wall_s": wall}), flush=True)
    engine.shutdown()


def run_config(args, name: str, binds: list[list[int]]) -> dict:
    """Start one engine process per bind, all at once; req/s over the slowest engine's wall time."""
    from inferscale_core.vllm_env import cpu_list, engine_bind_env, vllm_cpu_env

    n = len(binds)
    with tempfile.TemporaryDirectory() as barrier:
        (Path(barrier) / "expected").write_text(str(n))
        procs = []
        for i, cpus in enumerate(binds):
            env = {**os.environ, **vllm_cpu_env(), "VLLM_CPU_KVCACHE_SPACE": "1",  # 1 GiB per engine
                   "PYTHONPATH": str(ROOT)}
            if name == "own":
                env.update(engine_bind_env(cpus))  # what an engine replica with engine_cpu_cores sets
            else:
                env["OMP_NUM_THREADS"] = str(len(cpus))
            cmd = [sys.executable, __file__, "--dtype", args.dtype, "--max-tokens", str(args.max_tokens),
                   "--worker", f"{name}{i}", str(args.requests // n), str(max(1, args.concurrency // n)), barrier]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        lines = [p.communicate(timeout=900)[0] for p in procs]
    results = [json.loads(line) for out in lines for line in out.splitlines() if line.startswith("{")]
    if len(results) != n:
        raise SystemExit(f"{name}: {n - len(results)} engine process(es) failed")
    requests = sum(r["requests"] for r in results)
    wall = max(r["wall_s"] for r in results)
    placement = (" / ".join(f"bound to {cpu_list(b)}" for b in binds) if name == "own"
                 else f"{len(binds[0])} threads each, not bound")
    return {"config": name, "engines": n, "placement": placement, "requests": requests,
            "wall_s": wall, "req_s": requests / wall}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        asyncio.run(worker(args))
        return 0
    from bench.service import cpu_description, cpu_line, load_average
    from inferscale_core.vllm_env import engine_cpus, usable_cpus

    cpus = usable_cpus()
    if len(cpus) < args.engines:
        raise SystemExit(f"--engines {args.engines} needs at least as many usable cores; this process has {cpus}")
    per = len(cpus) // args.engines
    configs = {"one": [cpus], "shared": [cpus] * args.engines, "threads": [cpus[:per]] * args.engines,
               "own": [engine_cpus(per, i, cpus) for i in range(args.engines)]}
    cpu = cpu_description()
    head = [f"# {cpu_line(cpu)}", f"# load average before: {load_average():.1f}",
            f"# {args.requests} requests per configuration, {args.concurrency} in flight in all, "
            f"{args.max_tokens} tokens each, SmolLM2-135M-Instruct {args.dtype}, vllm AsyncLLM per process"]
    print("\n".join(head), flush=True)
    rows = []
    for name, binds in configs.items():
        rows.append(run_config(args, name, binds))
        print(f"  {name}: {rows[-1]['req_s']:.2f} req/s", flush=True)
    base = rows[0]["req_s"]
    table = ["| configuration | engines | OpenMP threads | req/s | vs one engine |", "|---|---|---|---|---|"]
    table += [f"| {r['config']} | {r['engines']} | {r['placement']} | {r['req_s']:.2f} | "
              f"{r['req_s'] / base:.2f} |" for r in rows]
    text = "\n".join(head + [f"# load average after: {load_average():.1f}", ""] + table) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
