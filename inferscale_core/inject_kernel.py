"""Fused injection for CUDA caches: gather a request's pre-RoPE chunks, re-rotate the keys to their memory
positions (chunked RoPE) and write K and V into every layer's paged cache in ONE Triton kernel launch.

Why: on a GPU the injection is bound by memory traffic and kernel launches. The unfused path
(`connector_worker._write_group`) copies the chunks into staging buffers, rotates the keys there in place, then
calls the attention backend's cache write once per layer: the keys cross memory three times and a request costs
2 + L launches. Here each token's K and V rows are read once from the fact store and written once into the cache.

Bits: the rotation is vLLM's rotary op's arithmetic in the model's dtype. vLLM's CUDA kernel computes
`x * cos - y * sin` on c10 16-bit scalars, which rounds each product to the dtype and then the difference;
the kernel does the same in bf16 (`ROUND_BF16`, to nearest even), so a bf16/fp16 key written here has the bits a prefill writes (the tests compare
bit for bit against that arithmetic). In fp32 the products are not rounded and the compilers may contract a
product into a fused multiply-add: keys may differ from vLLM's in the last bit.

Layout: the cache's K and V views are not assumed per backend (vLLM 0.32's FlashAttention keeps
`[blocks, heads, block_size, 2 * head_dim]`, other backends and versions differ). `CacheViews.probe` writes random
K/V for two slots of the null block (block 0, which vLLM never gives a request) through the backend's own
cache-write op and keeps the strided `[blocks, block_size, heads, head_dim]` views that read back exactly what
was written, in every layer. A layout that no candidate explains, a quantized cache, or a missing Triton keeps
the unfused path.

Addressing: Triton takes one base pointer per argument, so the pieces of a group (views into many store
tensors) and the layers' caches (separate allocations) are addressed as element offsets from the lowest address
among them: all offsets are non-negative and every pointer stays inside its own allocation.
"""
import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

try:
    import triton  # type: ignore[import-untyped]  # no stubs
    import triton.language as tl  # type: ignore[import-untyped]
except ImportError:  # the CPU install may lack Triton; without it the unfused path is used
    triton = None

# Columns of the per-token metadata the kernel reads: source offsets of K and V (layer 0), the source's layer
# stride, the memory position and the cache slot.
_META_COLUMNS = 5


if triton is not None:  # the kernel's compile-time parameters are told by the annotation object itself
    def _inject_kernel(src_k, src_v, meta, cos_sin, dst_k, dst_v, layer_offsets, num_tokens, block_size,
                       block_stride, slot_stride, head_stride, rot_stride, H: tl.constexpr, D: tl.constexpr,
                       HALF: tl.constexpr, TOKENS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       BLOCK_REST: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_BF16: tl.constexpr):
        # One program: TOKENS tokens of one layer, every head. The key's two rotated halves and the unrotated
        # rest are loaded as separate contiguous tiles (a gathered partner index would cost vector loads).
        t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)[:, None, None]
        layer = tl.program_id(1)
        h = tl.arange(0, BLOCK_H)[None, :, None]
        j = tl.arange(0, BLOCK_HALF)[None, None, :]
        live = t < num_tokens
        row = meta + t * 5
        k_off = tl.load(row, mask=live, other=0)
        v_off = tl.load(row + 1, mask=live, other=0)
        layer_stride = tl.load(row + 2, mask=live, other=0)
        pos = tl.load(row + 3, mask=live, other=0)
        slot = tl.load(row + 4, mask=live, other=0)
        heads = live & (h < H)
        src = src_k + k_off + layer * layer_stride + h * D
        dst = (dst_k + tl.load(layer_offsets + 2 * layer) + (slot // block_size) * block_stride
               + (slot % block_size) * slot_stride + h * head_stride)
        half = heads & (j < HALF)
        x_raw = tl.load(src + j, mask=half, other=0.0)
        x = x_raw.to(tl.float32)
        y = tl.load(src + HALF + j, mask=half, other=0.0).to(tl.float32)
        c = tl.load(cos_sin + pos * rot_stride + j, mask=live & (j < HALF), other=0.0).to(tl.float32)
        s = tl.load(cos_sin + pos * rot_stride + HALF + j, mask=live & (j < HALF), other=0.0).to(tl.float32)
        xc = x * c
        ys = y * s
        yc = y * c
        xs = x * s
        # bf16 rounds on the bits, to nearest even: Triton's interpreter truncates a cast to bf16 where the
        # compiled kernel rounds; after it the cast is exact in both.
        if ROUND_BF16:  # bits + 0x7FFF + the lowest kept bit, low 16 bits cleared: to nearest, ties to even
            bits = xc.to(tl.uint32, bitcast=True)
            xc = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
            bits = ys.to(tl.uint32, bitcast=True)
            ys = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
            bits = yc.to(tl.uint32, bitcast=True)
            yc = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
            bits = xs.to(tl.uint32, bitcast=True)
            xs = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
            bits = (xc - ys).to(tl.uint32, bitcast=True)
            first = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
            bits = (yc + xs).to(tl.uint32, bitcast=True)
            second = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
        else:  # fp32: nothing to round
            first = xc - ys
            second = yc + xs
        tl.store(dst + j, first.to(x_raw.dtype), mask=half)
        tl.store(dst + HALF + j, second.to(x_raw.dtype), mask=half)
        if BLOCK_REST > 0:  # a partial rotary: the key's dimensions past 2 * HALF are copied as they are
            r = 2 * HALF + tl.arange(0, BLOCK_REST)[None, None, :]
            rest = heads & (r < D)
            tl.store(dst + r, tl.load(src + r, mask=rest, other=0.0), mask=rest)
        d = tl.arange(0, BLOCK_D)[None, None, :]
        vd = heads & (d < D)
        v_dst = (dst_v + tl.load(layer_offsets + 2 * layer + 1) + (slot // block_size) * block_stride
                 + (slot % block_size) * slot_stride + h * head_stride)
        tl.store(v_dst + d, tl.load(src_v + v_off + layer * layer_stride + h * D + d, mask=vd, other=0.0), mask=vd)


_KERNELS: dict[bool, Callable] = {}
# The dtypes the worker fuses. fp16 is left to the unfused path: on an H200 (Triton 3.6) some fp16 keys came out
# one unit in the last place away from the rounded arithmetic the interpreter matches exactly; not explained yet.
FUSED_DTYPES = (torch.bfloat16, torch.float32)


def available() -> bool:
    return triton is not None


def kernel(interpret: bool):
    """The compiled kernel, or Triton's interpreter over the same function (tests on a machine without a GPU)."""
    if interpret not in _KERNELS:
        if triton is None:
            raise RuntimeError("Triton is not installed")
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction  # type: ignore[import-untyped]
            _KERNELS[interpret] = InterpretedFunction(_inject_kernel)
        else:
            _KERNELS[interpret] = triton.jit(_inject_kernel)
    return _KERNELS[interpret]


def _element_offsets(ptrs: np.ndarray, size: int) -> tuple[int, np.ndarray]:
    """The index of the lowest address among `ptrs` (int64 byte addresses) and every address's offset from it in
    elements of `size` bytes (all >= 0); ValueError where one is not a whole number of elements."""
    first = int(ptrs.argmin())
    delta = ptrs - ptrs[first]
    if (delta % size).any():
        raise ValueError("tensors not aligned to their element size")
    return first, delta // size


@dataclass
class CacheViews:
    """Every layer's K and V cache as strided `[blocks, block_size, heads, head_dim]` views sharing one layout,
    addressed from one base pointer each."""

    k_base: torch.Tensor
    v_base: torch.Tensor
    layer_offsets: torch.Tensor  # int64 [L, 2] on the device: (K, V) element offsets of layer l's views
    block_stride: int
    slot_stride: int
    head_stride: int
    block_size: int

    @classmethod
    def of(cls, views: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> "CacheViews | None":
        """Views (in layer order) that one kernel can address, or None."""
        first = views[0][0]
        if any(t.stride() != first.stride() or t.dtype != first.dtype or t.shape != first.shape
               for kv in views for t in kv):
            return None
        ptrs = np.array([(k.data_ptr(), v.data_ptr()) for k, v in views], dtype=np.int64)
        try:
            k_first, k_offsets = _element_offsets(ptrs[:, 0], first.element_size())
            v_first, v_offsets = _element_offsets(ptrs[:, 1], first.element_size())
        except ValueError:
            return None
        offsets = torch.from_numpy(np.stack([k_offsets, v_offsets], axis=1)).to(first.device)
        return cls(views[k_first][0], views[v_first][1], offsets, first.stride(0), first.stride(1), first.stride(2),
                   block_size)

    @classmethod
    def probe(cls, kv_caches: list[torch.Tensor], write: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None],
              num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> "CacheViews | None":
        """The views of every layer's cache (in layer order) that read back what the backend's own cache write
        (`write(layer, key, value, slot_mapping)`) put into two slots of block 0, or None where no candidate
        layout does, the cache's dtype is not the model's (a quantized cache) or the dtype is not fused."""
        if dtype not in FUSED_DTYPES or any(c.dtype != dtype for c in kv_caches):
            return None
        slots = torch.tensor([0, 1], dtype=torch.int64, device=kv_caches[0].device)
        found = []
        for layer, cache in enumerate(kv_caches):
            key = torch.randn(2, num_kv_heads, head_dim, device=cache.device).to(dtype)
            value = torch.randn(2, num_kv_heads, head_dim, device=cache.device).to(dtype)
            write(layer, key, value, slots)
            match = next((kv for kv in candidate_views(cache, num_kv_heads, head_dim, block_size)
                          if all(torch.equal(kv[0][0, i], key[i]) and torch.equal(kv[1][0, i], value[i])
                                 for i in range(2))), None)
            if match is None:
                return None
            found.append(match)
        return cls.of(found, block_size)


def candidate_views(cache: torch.Tensor, num_kv_heads: int, head_dim: int,
                    block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every way to read `cache` as K and V views `[blocks, block_size, heads, head_dim]` with a contiguous last
    dimension: K and V on a dimension of size 2 (`[2, blocks, ...]`, `[blocks, 2, ...]`), or as the two halves of
    a last dimension of 2 x head_dim; the other dimensions in any order that fits the sizes."""
    pairs = []
    if cache.dim() == 5:
        pairs += [(cache.select(d, 0), cache.select(d, 1)) for d in range(4) if cache.shape[d] == 2]
    if cache.dim() == 4 and cache.shape[-1] == 2 * head_dim:
        pairs.append((cache[..., :head_dim], cache[..., head_dim:]))
    out = []
    for k, v in pairs:
        if k.dim() != 4:
            continue
        for order in itertools.permutations(range(4)):
            kp, vp = k.permute(order), v.permute(order)
            if (kp.shape[1:] == (block_size, num_kv_heads, head_dim) and kp.stride(-1) == 1
                    and vp.stride(-1) == 1):
                out.append((kp, vp))
    return out


def inject(views: CacheViews, pieces: list[tuple[torch.Tensor, torch.Tensor]], positions: np.ndarray,
           slots: np.ndarray, cos_sin: torch.Tensor, interpret: bool = False, num_warps: int = 4,
           tokens_per_program: int = 1) -> None:
    """Write the pieces' K (re-rotated to `positions`) and V into the cache `slots`, all layers, one launch.

    pieces: `(k_pre, v)` views `[L, t, H, D]` in the caches' dtype and on their device, in token order; positions
    and slots: int64 `[N]` (N = sum of t), one per token; cos_sin: vLLM's `[positions, rotary_dim]` table (cos
    halves then sin halves, neox style)."""
    num_layers, _, num_heads, head_dim = pieces[0][0].shape
    step = num_heads * head_dim
    # One row per piece, vectorized below: the per-piece Python work is what a k=200 request pays on the host.
    info = np.array([(k.data_ptr(), v.data_ptr(), *k.stride(), *v.stride(), k.shape[1]) for k, v in pieces],
                    dtype=np.int64)
    rows_contiguous = ((info[:, 3:6] == (step, head_dim, 1)) & (info[:, 7:10] == (step, head_dim, 1))).all(axis=1)
    if not (rows_contiguous.all() and (info[:, 2] == info[:, 6]).all()):  # K and V rows as the kernel reads them
        pieces = [(k.contiguous(), v.contiguous()) for k, v in pieces]
        info = np.array([(k.data_ptr(), v.data_ptr(), *k.stride(), *v.stride(), k.shape[1]) for k, v in pieces],
                        dtype=np.int64)
    counts = info[:, 10]
    n = int(counts.sum())
    if positions.shape != (n,) or slots.shape != (n,):
        raise ValueError(f"{n} tokens in the pieces, {positions.shape} positions, {slots.shape} slots")
    # Element offsets from the lowest address (Triton adds offsets to one base pointer per argument).
    k_first, k_offsets = _element_offsets(info[:, 0], pieces[0][0].element_size())
    v_first, v_offsets = _element_offsets(info[:, 1], pieces[0][0].element_size())
    within = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)  # each token's index in its piece
    meta = np.empty((n, _META_COLUMNS), dtype=np.int64)
    meta[:, 0] = np.repeat(k_offsets, counts) + step * within
    meta[:, 1] = np.repeat(v_offsets, counts) + step * within
    meta[:, 2] = np.repeat(info[:, 2], counts)
    meta[:, 3], meta[:, 4] = positions, slots
    k_base, v_base = pieces[k_first][0], pieces[v_first][1]
    meta_dev = torch.from_numpy(meta).to(k_base.device)
    half = cos_sin.shape[1] // 2
    kernel(interpret)[(triton.cdiv(n, tokens_per_program), num_layers)](
        k_base, v_base, meta_dev, cos_sin, views.k_base, views.v_base, views.layer_offsets, n, views.block_size,
        views.block_stride, views.slot_stride, views.head_stride, cos_sin.stride(0),
        H=num_heads, D=head_dim, HALF=half, TOKENS=tokens_per_program, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_REST=triton.next_power_of_2(head_dim - 2 * half) if head_dim > 2 * half else 0,
        BLOCK_D=triton.next_power_of_2(head_dim), ROUND_BF16=k_base.dtype == torch.bfloat16,
        **({} if interpret else {"num_warps": num_warps}))
