"""The cluster KV tier's read path on a local Mooncake Store (loopback TCP, no model): reading the k facts of a
request through ClusterStore.get_many (get_batch + unpack, what the engine replica does) against Mooncake's
zero-copy batch_get_into into a registered buffer, and the write path (put_many). Facts have SmolLM2-135M's
shape (30 layers, 3 KV heads, dim 64) in bf16 and fp32, 25 tokens each.

    python bench/kv_tier.py --k 50 --repeats 30
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from inferscale_core.cluster_store import ClusterConfig, ClusterStore, pack, unpack
from inferscale_core.types import EncodedFact
from inferscale_server.registry.local_mooncake import local_mooncake

LAYERS, HEADS, DIM, TOKENS = 30, 3, 64, 25


def fact(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return EncodedFact(torch.randint(0, 49152, (TOKENS,), generator=g),
                       torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=g).to(dtype),
                       torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=g).to(dtype))


def ms(xs):
    return f"{statistics.median(xs) * 1000:.1f}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = next((ln for ln in flags.splitlines() if ln.startswith("Flags")), "")
    keep = [f for f in flags.split() if f.startswith(("avx512", "amx", "avx2"))]
    rows = []
    with local_mooncake(segment_bytes=3 << 30) as m:
        for dtype in (torch.bfloat16, torch.float32):
            tier = ClusterStore(ClusterConfig.from_dict(m.config), "f" * 16)
            assert tier.wait_available(60)
            client = tier._store()
            user = f"bench-{dtype}"
            facts = [(f"f{i}@v1", fact(dtype, i)) for i in range(a.k)]
            puts, gets, raw, into = [], [], [], []
            for r in range(a.repeats):
                batch = [(f"r{r}-{kv}", f) for kv, f in facts]
                t = time.perf_counter()
                assert all(tier.put_many(user, batch))
                puts.append(time.perf_counter() - t)
            ids = [f"r{a.repeats - 1}-{kv}" for kv, _ in facts]  # the newest: earlier rounds may be evicted
            keys = [tier.key(user, i) for i in ids]
            sizes = [len(pack(tier.fingerprint, user, i, f)) for i, (_, f) in zip(ids, facts)]
            buf = torch.empty(sum(sizes), dtype=torch.uint8)
            assert client.register_buffer(buf.data_ptr(), buf.numel()) == 0
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            for _ in range(a.repeats):
                t = time.perf_counter()
                got = tier.get_many(user, ids)
                gets.append(time.perf_counter() - t)
                assert all(g is not None for g in got)
                t = time.perf_counter()
                client.get_batch(keys)
                raw.append(time.perf_counter() - t)
                t = time.perf_counter()
                n = client.batch_get_into(keys, [buf.data_ptr() + o for o in offsets], sizes)
                out = [unpack(memoryview(buf.numpy())[o:o + s]) for o, s in zip(offsets, sizes)]
                into.append(time.perf_counter() - t)
                assert list(n) == sizes and len(out) == a.k
            client.unregister_buffer(buf.data_ptr())
            mb = sum(f.nbytes for _, f in facts) / 1e6
            rows.append((str(dtype).split(".")[1], mb, ms(puts), ms(gets), ms(raw), ms(into)))
            tier.close()
    print(f"cluster KV tier, local Mooncake (TCP loopback), k={a.k} facts of {TOKENS} tokens, SmolLM2-135M "
          f"shape, median of {a.repeats}; lscpu flags: {' '.join(keep)}")
    print("| dtype | KV read (MB) | put_many (ms) | get_many = get_batch + unpack (ms) | get_batch alone (ms) | "
          "batch_get_into registered buffer + unpack (ms) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]} | {r[3]} | {r[4]} | {r[5]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
