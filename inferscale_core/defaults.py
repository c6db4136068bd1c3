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
