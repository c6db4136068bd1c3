"""The serving defaults the accuracy and latency measurements chose (BENCHMARKS.md, "Accuracy against TTFT").

`inferscale demo`, the service (services/gateway/core.py for the windows, services/engine_replica.py for the
connector options) and the benchmarks' defaults all read them from here. `InjectingEngine` and `Memory`
themselves keep the bare mechanism (no windows unless given, nothing recomputed unless told), so the exactness
tests say exactly what they test.

NEIGHBOUR_WINDOW = 5: a new fact is encoded behind the 5 facts its user stored most recently before it, whatever
call they came in (the earlier facts of its own call included), rendered as the memory lines they are served as
(`PromptTemplate.neighbour_windows`); so adding facts one by one or together gives the same windows and the same
KV. A fact the caller sends with its own window (conversation turns) keeps it. The window is stored with the
fact (a re-encode reproduces it); when a neighbour is later deleted or its text changes, the facts encoded
behind it get the line removed or replaced and are re-encoded (`rewindow`), so a deleted text survives in no
other fact's window or KV (docs/architecture.md, "Neighbour windows").
RECOMPUTE_FACTS = 1 with RECOMPUTE_FACTS_MAX_K = 9: a memory of at most 9 facts leaves its last fact (the one
nearest the question) to vLLM, computed with the query; larger memories are injected whole (RECOMPUTE_TOKENS = 0),
only the query is prefilled. With facts added one at a time, injecting everything lost to prompt injection at
k=5 (pooled -0.009 [-0.017, -0.002], conv-47 below 0) and at k=8 (conv-47 below 0, 3 conversations run);
recomputing the last fact closed both (k=5 -0.002 [-0.008, +0.005], k=8 +0.000 [-0.006, +0.007], no conversation
below 0) for ~35 ms of TTFT on a 2-core CPU; at k=10-50 injecting everything lost nothing, and recomputing would
cost TTFT where the 10x target is measured (k=50). Measured on all 1,035 LoCoMo
development questions (7 conversations, SmolLM2-135M, bf16), conversation by conversation: BENCHMARKS.md, "Facts
added one at a time", with what was tried before (recomputing the last 32 tokens, windows of conversation turns).
The service's default k is 5 (services/limits.py), so the default request recomputes one fact.
"""
from __future__ import annotations

from collections.abc import Sequence

from .template import PromptTemplate

NEIGHBOUR_WINDOW = 5
RECOMPUTE_TOKENS = 0
RECOMPUTE_FACTS = 1
RECOMPUTE_FACTS_MAX_K = 9


def serving_store_options(overrides: dict | None = None) -> dict:
    """The connector/store options a serving engine starts with: the shipped default, then `overrides`."""
    return {"recompute_tokens": RECOMPUTE_TOKENS, "recompute_facts": RECOMPUTE_FACTS,
            "recompute_facts_max_k": RECOMPUTE_FACTS_MAX_K, **(overrides or {})}


def default_windows(fact_texts: Sequence[str], windows: Sequence[Sequence[str]] | None = None,
                    w: int = NEIGHBOUR_WINDOW, stored: Sequence[str] = ()) -> list[tuple[str, ...]]:
    """The window each of `fact_texts` (added together, in order) is encoded behind: the caller's own when it
    gave one (non-empty), else the w facts the user stored most recently before it, as memory lines.
    `stored`: the texts of the user's facts stored before this call, oldest first (the last w are enough)."""
    neighbours = PromptTemplate.neighbour_windows(fact_texts, w, stored)
    given = list(windows) if windows is not None else [()] * len(fact_texts)
    if len(given) != len(neighbours):
        raise ValueError(f"{len(fact_texts)} facts but {len(given)} windows")
    return [tuple(g) if g else n for g, n in zip(given, neighbours)]


def rewindow(window: Sequence[str], old_text: str, new_text: str | None) -> tuple[str, ...] | None:
    """A stored window after a neighbour's text `old_text` was deleted (`new_text` None: its line leaves the
    window) or changed to `new_text` (its line is replaced); None when the window does not hold that line."""
    old_line = PromptTemplate.render_fact(old_text)
    if old_line not in window:
        return None
    if new_text is None:
        return tuple(line for line in window if line != old_line)
    new_line = PromptTemplate.render_fact(new_text)
    return tuple(new_line if line == old_line else line for line in window)


def add_recompute_arguments(parser) -> None:
    """The benchmarks' --recompute-tokens / --recompute-facts, defaulting to what ships."""
    parser.add_argument("--recompute-tokens", type=int, default=RECOMPUTE_TOKENS,
                        help="KV mode: leave the memory's last N tokens to vLLM to compute with the query "
                             "(default: the shipped default, %(default)s)")
    parser.add_argument("--recompute-facts", type=int, default=RECOMPUTE_FACTS,
                        help="KV mode: leave the memory's last R facts, whole, to vLLM to compute with the query; "
                             "with --recompute-tokens the longer suffix wins (default: the shipped default, "
                             "%(default)s)")
    parser.add_argument("--recompute-facts-max-k", type=int, default=RECOMPUTE_FACTS_MAX_K,
                        help="KV mode: --recompute-facts applies only to memories of at most this many facts; 0: any "
                             "(default: the shipped default, %(default)s)")
