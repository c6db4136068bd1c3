"""The retrieval replica's query embedding in bfloat16 against float32: what it costs and what it changes.

Every answer embeds its query with all-MiniLM-L6-v2 on the retrieval replica (about half of that replica's CPU per
request at N=100 on the 2-core reference node, BENCHMARKS.md). Fact embeddings are computed once and stored in
float32; this asks whether the QUERY may run in bfloat16 (CPUs with AVX512-bf16 or AMX, and GPUs), in two parts,
one process, one thread (the deployment's, inferscale_core/vllm_env.py one_thread_beside_the_engine):

1. CPU time per query of the forward in each dtype, at batch sizes 1 and 16 and 64 (QueryBatcher embeds waiting
   queries together), the modes alternating so drift hits both; printed with the ratio.
2. Retrieval agreement per LoCoMo conversation: each conversation's facts (its `observation`s) embedded once in
   float32; every question searched with a float32 query and a bfloat16 one; the share of the float32 top-k the
   bfloat16 top-k keeps (k = 5, 50, 200, capped at the conversation's facts), and the questions whose evidence
   (dia_ids) the top-k reaches in each dtype (evidence recall: the retrieval's own accuracy, not the answer's).

    python bench/query_dtype.py --data ../shared/data/locomo_dev.json --out bench/results/query_dtype.md
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

KS = (5, 50, 200)


def cpu_text() -> str:
    from bench.service import cpu_description, cpu_line  # lscpu's model and flags, as every benchmark prints

    return cpu_line(cpu_description())


def time_per_query(model, texts: list[str], batch: int, rounds: int) -> float:
    """CPU seconds per query of `model.encode` over `rounds` batches of `batch` texts."""
    import torch

    spent = 0.0
    with torch.inference_mode():
        for r in range(rounds):
            chunk = [texts[(r * batch + i) % len(texts)] for i in range(batch)]
            t = time.process_time()
            model.encode(chunk, batch_size=batch, convert_to_tensor=True, normalize_embeddings=True,
                         show_progress_bar=False)
            spent += time.process_time() - t
    return spent / (rounds * batch)


def embed(model, texts: list[str]):
    import torch

    with torch.inference_mode():
        out = model.encode(texts, batch_size=64, convert_to_tensor=True, normalize_embeddings=True,
                           show_progress_bar=False)
    return out.float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=None, help="LoCoMo json (default ../shared/data/locomo_dev.json)")
    ap.add_argument("--rounds", type=int, default=6, help="timed batches per dtype and batch size")
    ap.add_argument("--out", default=None, help="write the report here too (markdown)")
    args = ap.parse_args()

    import torch

    from bench.eval.locomo import answerable, default_data_path, load_locomo, require_data_path
    from inferscale_core.embedder import Embedder

    torch.set_num_threads(1)
    conversations = load_locomo(require_data_path(args.data or default_data_path()))
    model = Embedder().model
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)  # what a bfloat16 query embedder would hold
    lines = ["# Query embedding in bfloat16 against float32 (`python bench/query_dtype.py`)", "",
             f"CPU: {cpu_text()}. **CPU times.** One torch thread. all-MiniLM-L6-v2 (packaged); facts always float32; "
             f"bfloat16 = a copy of the model in bfloat16 for the query.", "",
             "| batch | float32 ms CPU / query | bfloat16 ms CPU / query | float32 / bfloat16 |", "|---|---|---|---|"]
    queries = [q.question for c in conversations for q in answerable(c.questions)]
    embed(model, queries[:8]), embed(model_bf16, queries[:8])  # warm both
    for batch in (1, 16, 64):
        f32 = b16 = 0.0
        for _ in range(2):  # alternate, twice
            f32 += time_per_query(model, queries, batch, args.rounds)
            b16 += time_per_query(model_bf16, queries, batch, args.rounds)
        lines.append(f"| {batch} | {f32 / 2 * 1e3:.2f} | {b16 / 2 * 1e3:.2f} | {f32 / b16:.2f}x |")
    lines += ["", "Retrieval agreement per conversation (float32 facts; the query in each dtype):", "",
              "| conversation | facts | questions | " + " | ".join(f"top-{k} kept" for k in KS)
              + " | " + " | ".join(f"evidence in top-{k} f32 / bf16" for k in KS) + " |",
              "|---|---|---|" + "---|" * (2 * len(KS))]
    worst = {k: 1.0 for k in KS}
    for conv in conversations:
        facts = [f.text for f in conv.facts]
        qs = answerable(conv.questions)
        if not facts or not qs:
            continue
        fact_rows = embed(model, facts)
        q32, q16 = embed(model, [q.question for q in qs]), embed(model_bf16, [q.question for q in qs])
        s32, s16 = q32 @ fact_rows.T, q16 @ fact_rows.T
        kept, reach = [], []
        for k in KS:
            kk = min(k, len(facts))
            top32, top16 = s32.topk(kk).indices, s16.topk(kk).indices
            share = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top32, top16)) / (kk * len(qs))
            worst[k] = min(worst[k], share)
            kept.append(f"{share:.4f}")
            hit = []
            for top in (top32, top16):
                n = sum(bool(set(q.evidence) & {d for i in row.tolist() for d in conv.facts[i].dia_ids})
                        for q, row in zip(qs, top))
                hit.append(n)
            reach.append(f"{hit[0]} / {hit[1]}")
        lines.append(f"| {conv.sample_id} | {len(facts)} | {len(qs)} | " + " | ".join(kept) + " | "
                     + " | ".join(reach) + " |")
    lines += ["", "Worst conversation's share of the float32 top-k kept: "
              + ", ".join(f"k={k} {worst[k]:.4f}" for k in KS) + "."]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
