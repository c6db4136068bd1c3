"""Composition: place encoded chunks at contiguous virtual positions 0..m-1 and re-rotate their keys there."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .rope import ChunkedRope
from .types import EncodedFact


@dataclass
class Composition:
    prompt_ids: list[int]  # memory ids followed by query ids
    memory_len: int  # m: the query starts at position m
    k: torch.Tensor  # [L, m, H, D] post-RoPE keys of the memory
    v: torch.Tensor  # [L, m, H, D]


def memory_ids(chunks: Sequence[EncodedFact]) -> list[int]:
    return [int(t) for c in chunks for t in c.token_ids.tolist()]


def compose(rope: ChunkedRope, chunks: Sequence[EncodedFact], query_ids: Sequence[int]) -> Composition:
    """`chunks` in serving order: the prefix chunk first, then the facts, the most relevant LAST (next to
    the query)."""
    if not chunks:
        raise ValueError("compose needs at least one chunk")
    if not query_ids:
        raise ValueError("compose needs at least one query token")
    k_pre = torch.cat([c.k_pre for c in chunks], dim=1)
    v = torch.cat([c.v for c in chunks], dim=1)
    m = k_pre.shape[1]
    positions = torch.arange(m, device=k_pre.device)
    k = rope.rotate(k_pre, positions)
    return Composition(memory_ids(chunks) + [int(t) for t in query_ids], m, k, v)
