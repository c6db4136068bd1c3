"""The serving default the accuracy and latency measurements chose (BENCHMARKS.md, "Shipped default").

`inferscale demo`, the service's engine replicas (services/engine_replica.py) and the benchmarks' defaults all
read it from here. `InjectingEngine` itself keeps the bare mechanism (nothing recomputed) unless told otherwise,
so the exactness tests say exactly what they test.

recompute_tokens = 32: the memory's last 32 tokens (the most relevant fact sits last, next to the question) are
computed by vLLM together with the query, so they attend to the whole memory. On all 1,035 LoCoMo development
questions this keeps KV injection's F1 within the noise of prompt injection, where injecting everything loses
0.7-1.8 points, and costs TTFT(PI)/TTFT(KV) at k=50 19.9x -> 11.9x on 2 CPU cores.
"""
from __future__ import annotations

RECOMPUTE_TOKENS = 32


def serving_store_options(overrides: dict | None = None) -> dict:
    """The connector/store options a serving engine starts with: the shipped default, then `overrides`."""
    return {"recompute_tokens": RECOMPUTE_TOKENS, **(overrides or {})}
