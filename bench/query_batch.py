"""Retrieval under concurrent searches: waiting queries embedded in one batch (QueryBatcher, shipped) against
one embedder call per query (max_batch=1, as before), same process, same MiniLM, same index.

A burst of N searches of one user (LoCoMo conv-26: its dialogue turns as facts, its questions as queries)
is submitted at once from N threads, as the Retrieval deployment's search threads do. Prints per burst size
the wall time of the burst, the queries' median and p95 latency, the ratio, and how far the two modes' results
are apart (largest embedding difference, top-5 lists that differ). Torch runs the threads the deployment
uses on a CPU machine (one, inferscale_core/vllm_env.py) unless --threads says otherwise.

    python bench/query_batch.py --data ../shared/data/locomo_dev.json
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _conversation(path: str, sample_id: str, n_facts: int) -> tuple[list[str], list[str]]:
    conv = next(c for c in json.load(open(path)) if c["sample_id"] == sample_id)
    turns = [t["text"] for key, session in sorted(conv["conversation"].items())
             if key.startswith("session_") and isinstance(session, list) for t in session]
    return turns[:n_facts], [q["question"] for q in conv["qa"]]


def _burst(core, user: str, queries: list[str], k: int) -> tuple[float, list[float], list]:
    def one(q):
        t = time.perf_counter()
        hits = core.search(user, q, k)
        return time.perf_counter() - t, hits

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(queries)) as pool:
        out = list(pool.map(one, queries))
    return time.perf_counter() - t0, [s for s, _ in out], [h for _, h in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data/locomo_dev.json")
    ap.add_argument("--sample-id", default="conv-26")
    ap.add_argument("--facts", type=int, default=200)
    ap.add_argument("--bursts", default="1,8,32,64", help="queries submitted at once")
    ap.add_argument("--rounds", type=int, default=5, help="bursts of each size per mode (modes alternate)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from bench.eval.serving import machine
    from inferscale_core.embedder import default_embedder
    from inferscale_server.registry import EmbeddedRegistry, NewFact
    from inferscale_server.retrieval import QUERY_BATCH, QueryBatcher, RetrievalCore

    facts, questions = _conversation(args.data, args.sample_id, args.facts)
    registry = EmbeddedRegistry()
    registry.create("u", [NewFact(t) for t in facts])
    core = RetrievalCore(registry, default_embedder())
    core.search("u", "warm up", args.k)  # indexes the facts, loads the model
    modes = {"batched": QueryBatcher(core._embed, QUERY_BATCH), "one_by_one": QueryBatcher(core._embed, 1)}

    print(json.dumps({"machine": machine(), "torch_threads": torch.get_num_threads(), "facts": len(facts),
                      "k": args.k, "sample_id": args.sample_id}))
    print("| queries at once | one by one: burst ms | batched: burst ms | ratio | one by one: p50 / p95 ms "
          "| batched: p50 / p95 ms | batched calls per burst | max emb diff | top-5 lists differing |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in [int(x) for x in args.bursts.split(",")]:
        queries = (questions * (n // len(questions) + 1))[:n]
        walls = {m: [] for m in modes}
        lats = {m: [] for m in modes}
        hits = {}
        calls_before = modes["batched"].calls
        for r in range(args.rounds):
            for m in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                core.queries = modes[m]
                wall, lat, h = _burst(core, "u", queries, args.k)
                walls[m].append(wall)
                lats[m] += lat
                hits[m] = h
        calls = (modes["batched"].calls - calls_before) / args.rounds
        emb = default_embedder().embed(queries)
        diff = max(float((modes["batched"].embed(q) - emb[i]).abs().max()) for i, q in enumerate(queries[:8]))
        differ = sum([f for f, _ in a] != [f for f, _ in b] for a, b in zip(hits["batched"], hits["one_by_one"]))

        def ms(xs, q=0.5):
            xs = sorted(xs)
            return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]

        one, bat = statistics.median(walls["one_by_one"]), statistics.median(walls["batched"])
        print(f"| {n} | {1000 * one:.0f} | {1000 * bat:.0f} | {one / bat:.2f} | {ms(lats['one_by_one']):.0f} / "
              f"{ms(lats['one_by_one'], 0.95):.0f} | {ms(lats['batched']):.0f} / {ms(lats['batched'], 0.95):.0f} | "
              f"{calls:.1f} | {diff:.1e} | {differ} of {n} |")


if __name__ == "__main__":
    main()
