"""Does the encoder pool's process grow with every fact it encodes? FactEncoder (what EncoderPool runs) in this
process, SmolLM2-135M, facts encoded in rounds as the gateway sends them (batches of up to 8), the process's
RSS after each round; the encoded KV is dropped after each round, as the pool does once Serve has it.

    python bench/encoder_memory.py --dtype float32 --rounds 4 --per-round 500 [--threads 6]
    MALLOC_ARENA_MAX=2 python bench/encoder_memory.py ...   # the encoder pool's environment (services/app.py)
    python bench/encoder_memory.py --dtype bfloat16 --varied ...   # facts of many lengths, batches of 1-8, as in
                                                                   # the service: many distinct forward shapes
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
    p.add_argument("--varied", action="store_true",
                   help="facts of 3-60 words behind windows of 0-5 facts, in batches of 1-8, so forwards come in "
                        "many shapes as in the service (default: 5 fact lengths, batches of 8)")
    a = p.parse_args()
    import torch

    torch.set_num_threads(2)
    from inferscale_server.encoder_pool import FactEncoder

    fe = FactEncoder(dtype=a.dtype, device="cpu")
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = next((ln for ln in flags.splitlines() if ln.startswith("Flags")), "")
    malloc_env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")} or "none"
    onednn_env = {k: v for k, v in os.environ.items() if k.startswith(("ONEDNN_", "DNNL_"))} or "none"
    print(f"lscpu flags: {' '.join(f for f in flags.split() if f.startswith(('avx512', 'amx')))}; load "
          f"{os.getloadavg()[0]:.1f}; threads {a.threads}; varied {a.varied}; glibc malloc env: {malloc_env}; "
          f"oneDNN env: {onednn_env}")
    print("| fact ids | facts encoded in the round | RSS (MB) | seconds | KV bytes of the round (MB) |\n"
          f"|---|---|---|---|---|\n| 0 | | {rss_mb():.0f} | | |")

    def fact_text(i: int) -> str:
        if not a.varied:
            return f"User {i} said fact number {i}: they like " + "tea and biscuits " * (1 + i % 5)
        words = 3 + (i * 37) % 58  # 3-60 words, spread over consecutive facts
        return f"User {i} said:" + "".join(f" word{(i + w) % 97}" for w in range(words))

    def encode_batch(first: int) -> tuple[int, int]:  # the gateway's requests: facts, each behind its neighbours
        size = 1 + (first // 8) % 8 if a.varied else 8  # --varied: 1-8 facts a call
        texts = [fact_text(i) for i in range(first, first + size)]
        out = fe.encode([(t_, texts[:j][-5:]) for j, t_ in enumerate(texts)])
        return size, sum(e.nbytes for e in out)

    n = 0
    with ThreadPoolExecutor(a.threads) as pool:
        for _ in range(a.rounds):
            t = time.perf_counter()
            firsts = range(n, n + a.per_round, 8)  # a call per 8 fact ids (--varied: 1-8 of them encoded)
            done = list(pool.map(encode_batch, firsts))
            n += 8 * len(firsts)
            gc.collect()
            encoded, kv = sum(d[0] for d in done), sum(d[1] for d in done)
            print(f"| {n} | {encoded} | {rss_mb():.0f} | {time.perf_counter() - t:.0f} | {kv / 1e6:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
