"""Timed requests through `InjectingEngine` for the benchmarks.

Engine TTFT comes from vLLM's own per-request stats (`RequestOutput.metrics`, a `RequestStateStats`):
`first_token_latency` is the time from the request's arrival in the engine to its first token leaving the
output processor; the memory's injection (connector) and the query's prefill both happen inside it.
Question-to-first-token adds what happens before the engine sees the request (embed the question, search
the index, compose the ids) and the submission itself; question-to-full-answer adds the decode
(`last_token_ts - first_token_ts`, both engine-core timestamps). A batch of requests counts all of them
as arriving when the batch began, which is what N users asking at once means.

`prepare_fixed` builds a request over an explicit list of facts (no retrieval, any number of them), for
the position test.
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")  # the lscpu flags CPU inference rides on


def machine() -> dict:
    """What the numbers were measured on: CPU count, model name and speed flags (lscpu's), load average now."""
    model, flags = "", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"device": f"CPU x{os.cpu_count()}", "cpu_model": model,
            "cpu_flags": [f for f in SPEED_FLAGS if f in flags], "loadavg": list(os.getloadavg())}


@dataclass
class Timed:
    answer: object          # inferscale_core.engine.Answer
    prepare_s: float        # embed + search + compose ids
    ttft_s: float           # engine arrival -> first token (vLLM first_token_latency)
    q2ft_s: float           # question arrival -> first token
    q2full_s: float         # question arrival -> last token
    num_cached_tokens: int  # prompt tokens not prefilled: injected + local prefix-cache hits


def run_prepared(engine, prepared: Sequence, sampling, t_arrive: float | None = None) -> list[Timed]:
    """Submit prepared requests as one vLLM batch; `t_arrive` (time.time()) is when their questions arrived,
    by default the moment of submission."""
    if not prepared:
        return []
    t_submit = time.time()
    t_arrive = t_submit if t_arrive is None else t_arrive
    outs = engine.llm.generate([p.prompt() for p in prepared], [p.sampling(sampling) for p in prepared],
                               use_tqdm=False)
    timed = []
    for p, out in zip(prepared, outs):
        m = out.metrics
        if m is None or not m.first_token_ts:
            raise RuntimeError("vLLM returned no per-request stats: the engine must run with disable_log_stats=False")
        first = m.arrival_time + m.first_token_latency  # wall clock of the first token
        timed.append(Timed(engine.core.answer(p, out), p.retrieve_s, m.first_token_latency, first - t_arrive,
                           first + (m.last_token_ts - m.first_token_ts) - t_arrive, out.num_cached_tokens or 0))
    return timed


def timed_queries(engine, queries: Sequence, sampling, batch: bool = False) -> list[Timed]:
    """`inferscale_core.engine.Query`s, one request at a time (latency), or all in one batch that arrives at
    once (throughput)."""
    if batch:
        t_arrive = time.time()
        return run_prepared(engine, [engine.core.prepare(q) for q in queries], sampling, t_arrive)
    out = []
    for q in queries:
        t_arrive = time.time()
        out += run_prepared(engine, [engine.core.prepare(q)], sampling, t_arrive)
    return out


def reset_prefix_cache(engine) -> None:
    """Empty vLLM's prefix cache (no request may be running)."""
    if not engine.llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")


def prepare_fixed(engine, user_id: str, fact_ids: Sequence[str], question: str, mode: str, w: int = 0):
    """A request over exactly `fact_ids` in this order (the last next to the query), bypassing retrieval."""
    from inferscale_core.requests import Query

    recs = [engine.memory.get(user_id, f) for f in fact_ids]
    return engine.core.prepare_facts(Query(user_id, question, len(fact_ids), w, mode), fact_ids,
                                     [r.text for r in recs], [r.version for r in recs])
