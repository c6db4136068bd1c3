"""KV injection into a plain transformers model (`past_key_values`): the reference the vLLM path is tested
against (tests/engine/test_core_exactness.py, test_connector.py, ...), and the injection path of the GPU benchmark
(bench/gpu.py, which has no vLLM). Not part of the product: the service injects through vLLM's connector only."""
from __future__ import annotations

import torch

from inferscale_core.compose import Composition


def as_past_key_values(comp: Composition):
    """A transformers DynamicCache holding the composed memory (batch of one)."""
    from transformers import DynamicCache

    layers = [(comp.k[i].transpose(0, 1)[None], comp.v[i].transpose(0, 1)[None]) for i in range(comp.k.shape[0])]
    return DynamicCache(ddp_cache_data=layers)


@torch.no_grad()
def query_logits(model, comp: Composition) -> torch.Tensor:
    """Logits at every query position `[q, vocab]` with the memory injected as KV (only the query runs)."""
    dev = next(model.parameters()).device
    query = torch.tensor(comp.prompt_ids[comp.memory_len:], device=dev)[None]
    positions = torch.arange(comp.memory_len, comp.memory_len + query.shape[1], device=dev)[None]
    out = model(input_ids=query, position_ids=positions, past_key_values=as_past_key_values(comp), use_cache=True)
    return out.logits[0]


def greedy_with_injection(model, comp: Composition, max_new_tokens: int) -> list[int]:
    """Greedy decoding after injecting the memory; the query is the only prefill."""
    return _greedy(model, as_past_key_values(comp), comp.prompt_ids[comp.memory_len:], comp.memory_len,
                   max_new_tokens)


def greedy_prompt(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding of a plain prompt with the same step-by-step loop (prompt injection reference)."""
    from transformers import DynamicCache

    return _greedy(model, DynamicCache(), prompt_ids, 0, max_new_tokens)


@torch.no_grad()
def _greedy(model, cache, first_ids: list[int], start: int, max_new_tokens: int) -> list[int]:
    """Feed `first_ids` at positions start.., then one greedy token at a time."""
    dev = next(model.parameters()).device
    ids = torch.tensor(first_ids, device=dev)[None]
    pos = start
    out_tokens: list[int] = []
    for _ in range(max_new_tokens):
        positions = torch.arange(pos, pos + ids.shape[1], device=dev)[None]
        out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
        nxt = int(out.logits[0, -1].argmax())
        out_tokens.append(nxt)
        pos += ids.shape[1]
        ids = torch.tensor([[nxt]], device=dev)
    return out_tokens


def block_diagonal_mask(chunk_lengths: list[int], query_len: int, dtype=torch.float32) -> torch.Tensor:
    """Additive 4-D mask `[1, 1, N, N]`: each memory chunk sees only itself (causally), the query sees
    everything before it. This is what composing separately encoded chunks computes."""
    n = sum(chunk_lengths) + query_len
    allowed = torch.zeros(n, n, dtype=torch.bool)
    start = 0
    for length in chunk_lengths:
        allowed[start:start + length, start:start + length] = True
        start += length
    allowed[start:, :] = True
    allowed &= torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.zeros(n, n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
