"""The fused injection kernel against the unfused path, on one device (issue 30 item 6: injection at copy speed).

What the connector's worker does per request on CUDA (connector_worker.py), in bytes moved and launches:
- **unfused**: copy the k chunks' pre-RoPE K and V into staging buffers (`torch.cat`), rotate every layer's keys in
  place (vLLM's rotary op: one kernel), then one cache write per layer (vLLM's `reshape_and_cache_flash`).
- **fused** (`inferscale_core/inject_kernel.py`): one Triton launch reads each chunk row once, rotates the keys,
  and writes K and V into every layer's cache.

vLLM is not needed (the GPU machines lent to this project have none): the cache is vLLM 0.32's FlashAttention
layout `[blocks, heads, block_size, 2 * head_dim]`, one allocation per layer; the unfused path is emulated with
torch ops and is reported piece by piece: `cat` (measured), `rotate` (the rotation written in torch ops, several
kernels) and `rotate_floor` (one device copy of the keys' bytes: a lower bound for vLLM's one-kernel rotary op),
and `write` (per layer an index_put of K and one of V: two launches where vLLM's op takes one). Two totals:
`unfused` = cat + rotate_floor + write (the emulation, its write slower than vLLM's own op), and the
**three-pass floor** = two device copies of K+V plus one of K (gather, rotate, write, each at copy speed, launches
free): no unfused implementation can beat it, whatever its write kernel. Every run checks that the
fused kernel wrote the same bits as the unfused path (bf16/fp16) before timing anything.

  python bench/fused_inject.py --out bench/results/fused_inject_h200.json      # Llama-3.1-8B's shape, bf16
  python bench/fused_inject.py --tiny                                           # seconds, CPU (Triton's interpreter)
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inferscale_core import inject_kernel
from inferscale_core.inject_kernel import CacheViews

LLAMA_8B = dict(layers=32, kv_heads=8, head_dim=128)
TINY = dict(layers=2, kv_heads=2, head_dim=16)


def flash_views(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.32 FlashAttention's K and V views `[blocks, block_size, heads, head_dim]` of a layer's cache."""
    return cache.transpose(1, 2).split(head_dim, dim=-1)


def cos_sin_table(positions: int, rotary_dim: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    inv = 1.0 / (500000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(dtype=dtype, device=device)


def rotate(k: torch.Tensor, pos: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """vLLM's rotary arithmetic in the dtype (each product rounded, then the sum), in torch ops. k: [L, n, H, D]."""
    half = cos_sin.shape[1] // 2
    c = cos_sin[pos, :half].float()[None, :, None, :]
    s = cos_sin[pos, half:].float()[None, :, None, :]
    x, y = k[..., :half].float(), k[..., half:2 * half].float()

    def r(t):
        return t.to(k.dtype).float()
    return torch.cat([(r(x * c) - r(y * s)).to(k.dtype), (r(y * c) + r(x * s)).to(k.dtype)], dim=-1)


class Timer:
    """Median wall time of a function on the device, synchronized before and after each call."""

    def __init__(self, device: str, warmup: int, repeats: int):
        self.device, self.warmup, self.repeats = device, warmup, repeats

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3


def run(args) -> dict:
    shape = TINY if args.tiny else LLAMA_8B
    layers, heads, head_dim = shape["layers"], shape["kv_heads"], shape["head_dim"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    interpret = device == "cpu"
    dtype = getattr(torch, args.dtype)
    bs, fact_tokens = args.block_size, args.fact_tokens
    ks = [2] if args.tiny else args.k
    gen = torch.Generator().manual_seed(0)
    max_tokens = max(ks) * fact_tokens
    num_blocks = max(8 if args.tiny else args.blocks, 2 * (max_tokens // bs + 2))
    caches = [torch.zeros(num_blocks, heads, bs, 2 * head_dim, dtype=dtype, device=device) for _ in range(layers)]

    def backend_write(layer, key, value, slots):
        kc, vc = flash_views(caches[layer], head_dim)
        kc[slots // bs, slots % bs] = key
        vc[slots // bs, slots % bs] = value
    views = CacheViews.probe(caches, backend_write, heads, head_dim, bs, dtype)
    if views is None:
        raise SystemExit("the probe found no view of the FlashAttention layout")
    facts = [(torch.randn(layers, fact_tokens, heads, head_dim, generator=gen).to(dtype).to(device),
              torch.randn(layers, fact_tokens, heads, head_dim, generator=gen).to(dtype).to(device)) for _ in range(max(ks))]
    cos_sin = cos_sin_table(max_tokens + 64, head_dim, dtype, device)
    timer = Timer(device, 1 if args.tiny else args.warmup, 2 if args.tiny else args.repeats)
    rng = np.random.default_rng(0)
    rows = []
    for k in ks:
        pieces = facts[:k]
        n = k * fact_tokens
        positions = np.arange(n, dtype=np.int64)
        blocks = rng.choice(np.arange(1, num_blocks), size=-(-n // bs), replace=False)  # never the null block
        slots = (blocks[positions // bs] * bs + positions % bs).astype(np.int64)
        pos_dev, slots_dev = torch.from_numpy(positions).to(device), torch.from_numpy(slots).to(device)
        kbuf = torch.empty(layers, n, heads, head_dim, dtype=dtype, device=device)
        vbuf = torch.empty_like(kbuf)
        nbytes = 2 * kbuf.numel() * kbuf.element_size()

        def fused(num_warps=args.num_warps[0], tokens=args.tokens_per_program[0]):
            inject_kernel.inject(views, pieces, positions, slots, cos_sin, interpret=interpret, num_warps=num_warps,
                                 tokens_per_program=tokens)

        def cat():
            torch.cat([p for p, _ in pieces], dim=1, out=kbuf)
            torch.cat([p for _, p in pieces], dim=1, out=vbuf)

        def rotate_torch():
            kbuf.copy_(rotate(kbuf, pos_dev, cos_sin))

        rotate_src = torch.empty_like(kbuf)

        def rotate_floor():
            rotate_src.copy_(kbuf)

        def write():
            for layer in range(layers):
                kc, vc = flash_views(caches[layer], head_dim)
                kc[slots_dev // bs, slots_dev % bs] = kbuf[layer]
                vc[slots_dev // bs, slots_dev % bs] = vbuf[layer]

        copy_dst = torch.empty(nbytes // kbuf.element_size(), dtype=dtype, device=device)
        copy_src = torch.randn(copy_dst.numel(), generator=gen).to(dtype).to(device)

        def device_copy():
            copy_dst.copy_(copy_src)

        # the same bits first: the unfused path's cache, then the fused kernel's over it (earlier k's slots
        # cleared first: both write only this k's slots)
        for c in caches:
            c[1:].zero_()
        cat()
        kbuf.copy_(rotate(kbuf, pos_dev, cos_sin))
        write()
        want = [c.clone() for c in caches]
        for c in caches:
            c[1:].zero_()
        fused()
        same = all(torch.equal(a[1:], b[1:]) for a, b in zip(caches, want))
        if not same and dtype != torch.float32:
            raise SystemExit(f"k={k}: the fused kernel's cache differs from the unfused path's")
        del want
        t = {name: timer(fn) for name, fn in [("fused", fused), ("cat", cat), ("rotate_torch", rotate_torch),
                                              ("rotate_floor", rotate_floor), ("write", write),
                                              ("device_copy", device_copy)]}
        for w in args.num_warps:  # other launch shapes, for the record
            for tp in args.tokens_per_program:
                if (w, tp) != (args.num_warps[0], args.tokens_per_program[0]):
                    t[f"fused_w{w}t{tp}"] = timer(lambda: fused(w, tp))
        unfused = t["cat"] + t["rotate_floor"] + t["write"]
        # three passes at copy speed (K+V gathered, K rotated, K+V written), launches free: no unfused path beats it
        floor = 2 * t["device_copy"] + t["rotate_floor"]
        rows.append(dict(k=k, tokens=n, kv_bytes=nbytes, same_bits=same, **{f"{n_}_ms": v for n_, v in t.items()},
                         unfused_ms=unfused, three_pass_floor_ms=floor, fused_gbps=nbytes / t["fused"] / 1e6,
                         copy_gbps=nbytes / t["device_copy"] / 1e6, unfused_over_fused=unfused / t["fused"],
                         floor_over_fused=floor / t["fused"]))
    return dict(device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__, triton=getattr(inject_kernel.triton, "__version__", None),
                num_warps=args.num_warps, tokens_per_program=args.tokens_per_program, dtype=args.dtype, shape=shape, block_size=bs, fact_tokens=fact_tokens, blocks=num_blocks,
                warmup=timer.warmup, repeats=timer.repeats, rows=rows)


def table(result: dict) -> str:
    lines = [f"{result['device']}, torch {result['torch']}, triton {result['triton']}, {result['dtype']}, "
             f"L={result['shape']['layers']} H={result['shape']['kv_heads']} D={result['shape']['head_dim']}, "
             f"block {result['block_size']}, {result['fact_tokens']} tokens a fact, median of {result['repeats']}",
             "",
             "| k | tokens | KV MB | fused ms | unfused ms (cat + rotate floor + write) | unfused/fused | "
             "three-pass floor ms | floor/fused | fused GB/s | device copy GB/s | same bits |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        others = " ".join(f"{key[len('fused_'):]}: {v:.3f}" for key, v in r.items()
                          if key.startswith("fused_w"))
        lines.append(f"| {r['k']} | {r['tokens']} | {r['kv_bytes'] / 1e6:.1f} | {r['fused_ms']:.3f}"
                     f"{f' ({others})' if others else ''} | {r['unfused_ms']:.3f} ({r['cat_ms']:.3f} + "
                     f"{r['rotate_floor_ms']:.3f} + {r['write_ms']:.3f}) | {r['unfused_over_fused']:.2f}x | "
                     f"{r['three_pass_floor_ms']:.3f} | {r['floor_over_fused']:.2f}x | {r['fused_gbps']:.0f} | "
                     f"{r['copy_gbps']:.0f} | {r['same_bits']} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[5, 10, 20, 50, 100, 200])
    p.add_argument("--fact-tokens", type=int, default=30)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--blocks", type=int, default=4096, help="cache blocks per layer (requests land at random ones)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--num-warps", type=lambda s: [int(x) for x in s.split(",")], default=[4],
                   help="the kernel's warps per program; the first is the one reported, the others are timed too")
    p.add_argument("--tokens-per-program", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                   help="tokens one program writes; the first is the one reported, the others are timed too")
    p.add_argument("--tiny", action="store_true", help="a tiny shape, k=2, for a smoke run (CPU: Triton's interpreter)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not inject_kernel.available():
        raise SystemExit("Triton is not installed")
    result = run(args)
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
