"""Can a JIT kernel write injected KV into vLLM's CPU cache faster than vLLM's own op? (issue 21, item 4)

The worker writes a k=50 memory (SmolLM2: 30 layers x 3 KV heads x 64, 1,907 tokens, bf16) with ONE call of
vLLM's `cpu_attn_reshape_and_cache` for all layers. On the "vec"/"vec16" ISA a cache block of one head is
`[2 x block, head_dim]`: the keys transposed (`[head_dim, block]`) in the first half, the values as they are in the
second. This script writes the same bytes three ways into the same layout, checks they are equal byte for byte,
and times them interleaved (min and median of --repeats):
  - vLLM's op, one call for every layer (what the worker does), on 2 threads and on 1;
  - a numba kernel, one thread: runs of consecutive slots in one block, keys stored one element at a time;
  - the same with keys moved as 4 x 4 tiles of bf16 in 64-bit words (4 loads and 4 stores per 16 keys);
  - a plain copy of the same bytes into a contiguous buffer (2 threads and 1): what ANY writer costs at least, since
    it must read every byte of K and V and write it once.
numba is not a dependency of the project (`pip install numba` for its two rows; without it they are left out).

    python bench/cache_write.py [--repeats 20] [--isa vec]

vLLM's op writes the layout of the ISA vLLM picks on this machine (`amx` for bf16 where AMX exists, else `vec`) unless
--isa says otherwise; the numba kernels write the `vec` layout only and run only with it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS, TOKENS, HEADS, HEAD_DIM, BLOCK = 30, 1907, 3, 64, 32
BLOCKS_PER_LAYER = 200
MEMORY_START = 40  # the memory follows the instruction prefix: its first block is partial


def kernels():
    from numba import njit, uint64

    @njit(nogil=True)
    def run_end(block_start, offset, layer, n_tok, i):
        """End of the run of tokens from i on that sit in consecutive slots of one block."""
        j = i + 1
        while (j < n_tok and block_start[layer * n_tok + j] == block_start[layer * n_tok + i]
               and offset[j] == offset[i] + (j - i)):
            j += 1
        return j

    @njit(nogil=True, boundscheck=False)
    def write_scalar(k, v, cache, block_start, offset, layers, n_tok, heads, dim, bs, head_stride):
        # k, v: flat [L * N * H * D] uint16; cache: the whole buffer as flat uint16. Unsigned indices: numba
        # checks signed ones for wraparound on every access.
        tok = heads * dim
        for layer in range(layers):
            i = 0
            while i < n_tok:
                start, off0 = block_start[layer * n_tok + i], offset[i]
                j = run_end(block_start, offset, layer, n_tok, i)
                for h in range(heads):
                    kb = uint64(start + h * head_stride)
                    vb = kb + uint64(bs * dim)
                    src0 = uint64((layer * n_tok + i) * tok + h * dim)
                    for t in range(j - i):
                        s = src0 + uint64(t * tok)
                        kd = kb + uint64(off0 + t)
                        vd = vb + uint64((off0 + t) * dim)
                        for d in range(dim):
                            cache[kd + uint64(d * bs)] = k[s + uint64(d)]
                            cache[vd + uint64(d)] = v[s + uint64(d)]
                i = j

    @njit(nogil=True, boundscheck=False)
    def write_tiled(k, v, k64, cache, c64, block_start, offset, layers, n_tok, heads, dim, bs, head_stride):
        tok = heads * dim
        m16, m32 = uint64(0x0000FFFF0000FFFF), uint64(0x00000000FFFFFFFF)
        n16, n32, s16, s32 = ~m16, ~m32, uint64(16), uint64(32)
        q, rs = uint64(tok // 4), uint64(bs // 4)
        for layer in range(layers):
            i = 0
            while i < n_tok:
                start, off0 = block_start[layer * n_tok + i], offset[i]
                j = run_end(block_start, offset, layer, n_tok, i)
                n = j - i
                head = min((4 - off0 % 4) % 4, n)  # tokens before the first 4-aligned slot
                full = (n - head) // 4 * 4
                for h in range(heads):
                    kb = uint64(start + h * head_stride)
                    vb = kb + uint64(bs * dim)
                    src0 = uint64((layer * n_tok + i) * tok + h * dim)
                    for t in range(n):
                        s = src0 + uint64(t * tok)
                        vd = vb + uint64((off0 + t) * dim)
                        for d in range(dim):
                            cache[vd + uint64(d)] = v[s + uint64(d)]
                        if t < head or t >= head + full:
                            kd = kb + uint64(off0 + t)
                            for d in range(dim):
                                cache[kd + uint64(d * bs)] = k[s + uint64(d)]
                    for t in range(head, head + full, 4):
                        s = (src0 + uint64(t * tok)) >> uint64(2)
                        dst = (kb + uint64(off0 + t)) >> uint64(2)
                        for g in range(dim // 4):
                            a, b = k64[s + uint64(g)], k64[s + q + uint64(g)]
                            c, e = k64[s + q + q + uint64(g)], k64[s + q + q + q + uint64(g)]
                            ab_lo, ab_hi = (a & m16) | ((b & m16) << s16), ((a >> s16) & m16) | (b & n16)
                            ce_lo, ce_hi = (c & m16) | ((e & m16) << s16), ((c >> s16) & m16) | (e & n16)
                            r = dst + uint64(4 * g) * rs
                            c64[r] = (ab_lo & m32) | (ce_lo << s32)
                            c64[r + rs] = (ab_hi & m32) | (ce_hi << s32)
                            c64[r + rs + rs] = (ab_lo >> s32) | (ce_lo & n32)
                            c64[r + rs + rs + rs] = (ab_hi >> s32) | (ce_hi & n32)
                i = j

    return write_scalar, write_tiled


def machine() -> str:
    """bench.eval.serving.machine() (what every benchmark reports) as one line."""
    from bench.eval.serving import machine as measured_on

    m = measured_on()
    return f"{m['cpu_model']}, {m['device']}; flags: {' '.join(m['cpu_flags'])}; load {m['loadavg'][0]:.2f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--isa", default=None, help="the cache layout vLLM's op writes (default: vLLM's choice here)")
    args = ap.parse_args(argv)
    from inferscale_core.vllm_env import set_vllm_cpu_env

    set_vllm_cpu_env()
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = args.isa or _get_attn_isa(torch.bfloat16, BLOCK, HEAD_DIM)
    try:
        write_scalar, write_tiled = kernels() if isa == "vec" else (None, None)
        why_not = f"ISA {isa}: the numba rows (vec layout) are left out"
    except ImportError:
        write_scalar = write_tiled = None
        why_not = "numba not installed: its rows are left out"
    print(f"# {machine()}; vLLM's op writes the {isa!r} layout" + ("" if write_scalar else f"; {why_not}"))
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(LAYERS, TOKENS, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    v = torch.randn(LAYERS, TOKENS, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    pos = torch.arange(MEMORY_START, MEMORY_START + TOKENS)
    ids = torch.randperm(BLOCKS_PER_LAYER, generator=gen)[:(MEMORY_START + TOKENS) // BLOCK + 1]
    block, offset = ids[pos // BLOCK], pos % BLOCK
    shape = (LAYERS * BLOCKS_PER_LAYER, HEADS, BLOCK, 2 * HEAD_DIM)
    caches = {name: torch.zeros(shape, dtype=torch.bfloat16) for name in ("vllm", "scalar", "tiled")}
    combined = (np.arange(LAYERS)[:, None] * BLOCKS_PER_LAYER + block.numpy()[None, :])
    slots = torch.from_numpy((combined * BLOCK + offset.numpy()[None, :]).reshape(-1))
    block_start = (combined * HEADS * BLOCK * 2 * HEAD_DIM).reshape(-1).astype(np.int64)
    off = offset.numpy().astype(np.int64)
    k16, v16 = k.view(torch.int16).numpy().reshape(-1), v.view(torch.int16).numpy().reshape(-1)
    k64 = k.reshape(-1).view(torch.int64).numpy().view(np.uint64)
    flat = {n: c.view(torch.int16).reshape(-1).numpy() for n, c in caches.items()}
    tiled64 = caches["tiled"].reshape(-1).view(torch.int64).numpy().view(np.uint64)
    dims = (LAYERS, TOKENS, HEADS, HEAD_DIM, BLOCK, BLOCK * 2 * HEAD_DIM)

    def vllm_op():
        kc, vc = caches["vllm"].view(shape[0], HEADS, 2 * BLOCK, HEAD_DIM).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k.view(-1, HEADS, HEAD_DIM), v.view(-1, HEADS, HEAD_DIM), kc, vc, slots,
                                       isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    k_copy, v_copy = torch.empty_like(k), torch.empty_like(v)

    def plain_copy():
        k_copy.copy_(k)
        v_copy.copy_(v)

    variants = {"vLLM op, 2 threads": (vllm_op, 2), "vLLM op, 1 thread": (vllm_op, 1),
                "plain copy of the bytes, 2 threads (any writer's floor)": (plain_copy, 2),
                "plain copy of the bytes, 1 thread": (plain_copy, 1)}
    if write_scalar is not None:
        variants["numba scalar, 1 thread"] = (lambda: write_scalar(k16, v16, flat["scalar"], block_start, off,
                                                                   *dims), 1)
        variants["numba 4x4 tiles, 1 thread"] = (lambda: write_tiled(k16, v16, k64, flat["tiled"], tiled64,
                                                                     block_start, off, *dims), 1)
    for fn, _ in variants.values():  # compile, and fill every cache once
        fn()
    equal = write_scalar is None or all(torch.equal(caches["vllm"], caches[n]) for n in ("scalar", "tiled"))
    if write_scalar is not None:
        print(f"# bytes equal to vLLM's op: {equal}")
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (fn, threads) in variants.items():
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1000)
    torch.set_num_threads(2)
    mb = 2 * k.numel() * k.element_size() / 2**20
    print(f"\nK and V of {TOKENS} tokens x {LAYERS} layers ({mb:.0f} MiB) written into a paged cache ({isa} layout), "
          f"{args.repeats} interleaved repeats; {machine()}\n")
    print("| writer | min ms | median ms |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.2f} | {float(np.median(ts)):.2f} |")
    if not equal:
        sys.exit("error: a kernel wrote other bytes than vLLM's op")


if __name__ == "__main__":
    main()
