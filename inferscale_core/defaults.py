"""The serving default the accuracy and latency measurements chose (BENCHMARKS.md, "Shipped default").

`inferscale demo`, the service's engine replicas (services/engine_replica.py) and the benchmarks' defaults all
read it from here. `InjectingEngine` itself keeps the bare mechanism (nothing recomputed) unless told otherwise,
so the exactness tests say exactly what they test.

recompute_tokens = 32: the memory's last 32 tokens (the most relevant fact sits last, next to the question) are
computed by vLLM together with the query, so they attend to the whole memory. On all 1,035 LoCoMo development
questions (7 conversations, SmolLM2-135M, bf16) it brings KV injection's F1 closer to prompt injection's at every
k and w measured, with every pooled KV-PI interval including 0 (injecting everything: 3 of 4 below 0), at
TTFT(PI)/TTFT(KV) k=50 of 11.9x instead of 19.9x on 2 CPU cores. BENCHMARKS.md, "Shipped default".
"""
from __future__ import annotations

RECOMPUTE_TOKENS = 32


def serving_store_options(overrides: dict | None = None) -> dict:
    """The connector/store options a serving engine starts with: the shipped default, then `overrides`."""
    return {"recompute_tokens": RECOMPUTE_TOKENS, **(overrides or {})}


def add_recompute_arguments(parser) -> None:
    """The benchmarks' --recompute-tokens / --recompute-facts, defaulting to what ships."""
    parser.add_argument("--recompute-tokens", type=int, default=RECOMPUTE_TOKENS,
                        help="KV mode: leave the memory's last N tokens to vLLM to compute with the query "
                             "(default: the shipped default, %(default)s)")
    parser.add_argument("--recompute-facts", type=int, default=0,
                        help="KV mode: leave the memory's last R facts, whole, to vLLM to compute with the query; "
                             "with --recompute-tokens the longer suffix wins (default %(default)s)")
