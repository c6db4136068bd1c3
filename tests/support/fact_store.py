"""Toy facts and FactStores for the store and tier tests: random KV of a tiny model's shape, compared bit for bit."""
from __future__ import annotations

import torch

from inferscale_core.store import FactStore
from inferscale_core.types import EncodedFact

L, H, D = 3, 2, 8  # layers, kv heads, head dim of a toy model


def make_fact(tokens: int, dtype=torch.float32, seed: int = 0, layers=L, heads=H, head_dim=D) -> EncodedFact:
    g = torch.Generator().manual_seed(seed)
    return EncodedFact(
        token_ids=torch.randint(0, 50_000, (tokens,), generator=g),
        k_pre=torch.randn(layers, tokens, heads, head_dim, generator=g).to(dtype),
        v=torch.randn(layers, tokens, heads, head_dim, generator=g).to(dtype),
    )


def assert_same(a: EncodedFact, b: EncodedFact) -> None:
    assert a.k_pre.dtype == b.k_pre.dtype and a.v.dtype == b.v.dtype
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.k_pre, b.k_pre)
    assert torch.equal(a.v, b.v)


def store(tmp_path=None, **kw) -> FactStore:
    kw.setdefault("dtype", torch.float32)
    return FactStore(disk_dir=tmp_path, num_layers=L, num_kv_heads=H, head_dim=D, **kw)
