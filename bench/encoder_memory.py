"""Does the encoder pool's process grow with every fact it encodes? FactEncoder (what EncoderPool runs) in this
process, SmolLM2-135M, facts encoded in rounds as the gateway sends them (batches of up to 8), the process's
RSS after each round; the encoded KV is dropped after each round, as the pool does once Serve has it.

    python bench/encoder_memory.py --dtype float32 --rounds 4 --per-round 500 [--threads 6]
    MALLOC_ARENA_MAX=2 python bench/encoder_memory.py ...   # the encoder pool's environment (services/app.py)
"""
from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--per-round", type=int, default=500)
    p.add_argument("--threads", type=int, default=1,
                   help="encode calls spread over a pool of this many threads, as the pool's asyncio.to_thread does "
                        "(each thread that allocates gets its own glibc malloc arena)")
    a = p.parse_args()
    import torch

    torch.set_num_threads(2)
    from inferscale_server.encoder_pool import FactEncoder

    fe = FactEncoder(dtype=a.dtype, device="cpu")
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = next((ln for ln in flags.splitlines() if ln.startswith("Flags")), "")
    malloc_env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")} or "none"
    print(f"lscpu flags: {' '.join(f for f in flags.split() if f.startswith(('avx512', 'amx')))}; load "
          f"{os.getloadavg()[0]:.1f}; threads {a.threads}; glibc malloc env: {malloc_env}")
    print(f"| facts encoded | RSS (MB) | seconds | KV bytes of the round (MB) |\n|---|---|---|---|\n| 0 | {rss_mb():.0f} | | |")

    def encode_batch(first: int) -> int:  # the gateway's requests: a few facts, each behind its neighbours
        texts = [f"User {i} said fact number {i}: they like " + "tea and biscuits " * (1 + i % 5)
                 for i in range(first, first + 8)]
        out = fe.encode([(t_, texts[:j][-5:]) for j, t_ in enumerate(texts)])
        return sum(e.nbytes for e in out)

    n = 0
    with ThreadPoolExecutor(a.threads) as pool:
        for _ in range(a.rounds):
            t = time.perf_counter()
            firsts = range(n, n + a.per_round, 8)  # batches of 8 facts
            kv = sum(pool.map(encode_batch, firsts))
            n += 8 * len(firsts)
            gc.collect()
            print(f"| {n} | {rss_mb():.0f} | {time.perf_counter() - t:.0f} | {kv / 1e6:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
