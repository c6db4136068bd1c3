"""The serving defaults the accuracy and latency measurements chose (BENCHMARKS.md, "Accuracy against TTFT").

`inferscale demo`, the service (services/gateway/core.py for the windows, services/engine_replica.py for the
connector options) and the benchmarks' defaults all read them from here. `InjectingEngine` and `Memory`
themselves keep the bare mechanism (no windows unless given, nothing recomputed unless told), so the exactness
tests say exactly what they test.

NEIGHBOUR_WINDOW = 5: facts added together (one AddFacts/AddMemory call, one `engine.add`) are each encoded
behind the 5 facts added before them, rendered as the memory lines they are served as
(`PromptTemplate.neighbour_windows`); a fact the caller sends with its own window (conversation turns) keeps it.
RECOMPUTE_TOKENS = RECOMPUTE_FACTS = 0: the whole memory is injected, only the query is prefilled.
Measured on all 1,035 LoCoMo development questions (7 conversations, SmolLM2-135M, bf16), conversation by
conversation: see BENCHMARKS.md for the table and for what was tried instead (recomputing the last 32 tokens or
the last fact, windows of conversation turns).
"""
from __future__ import annotations

from collections.abc import Sequence

from .template import PromptTemplate

NEIGHBOUR_WINDOW = 5
RECOMPUTE_TOKENS = 0
RECOMPUTE_FACTS = 0


def serving_store_options(overrides: dict | None = None) -> dict:
    """The connector/store options a serving engine starts with: the shipped default, then `overrides`."""
    return {"recompute_tokens": RECOMPUTE_TOKENS, "recompute_facts": RECOMPUTE_FACTS, **(overrides or {})}


def default_windows(fact_texts: Sequence[str], windows: Sequence[Sequence[str]] | None = None,
                    w: int = NEIGHBOUR_WINDOW) -> list[tuple[str, ...]]:
    """The window each of `fact_texts` (added together, in order) is encoded behind: the caller's own when it
    gave one (non-empty), else the w facts before it in this call, as memory lines."""
    neighbours = PromptTemplate.neighbour_windows(fact_texts, w)
    given = list(windows) if windows is not None else [()] * len(fact_texts)
    if len(given) != len(neighbours):
        raise ValueError(f"{len(fact_texts)} facts but {len(given)} windows")
    return [tuple(g) if g else n for g, n in zip(given, neighbours)]


def add_recompute_arguments(parser) -> None:
    """The benchmarks' --recompute-tokens / --recompute-facts, defaulting to what ships."""
    parser.add_argument("--recompute-tokens", type=int, default=RECOMPUTE_TOKENS,
                        help="KV mode: leave the memory's last N tokens to vLLM to compute with the query "
                             "(default: the shipped default, %(default)s)")
    parser.add_argument("--recompute-facts", type=int, default=RECOMPUTE_FACTS,
                        help="KV mode: leave the memory's last R facts, whole, to vLLM to compute with the query; "
                             "with --recompute-tokens the longer suffix wins (default: the shipped default, "
                             "%(default)s)")
