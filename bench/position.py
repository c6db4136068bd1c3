"""Position test: what the memory's ORDER costs each system, for memories of 1K / 4K / 16K tokens.

The memory is LoCoMo conversation text cut into chunks of (at most) 64 prompt tokens ("- ...\n"), one
user's facts, encoded once (w=0, behind the instruction prefix). Every request asks one question over ALL
the memory's chunks (no retrieval), and only the first token is generated (engine TTFT, from vLLM's
per-request stats). Conditions, in this order for each size:

  pi-fixed-cache     prompt injection, the same chunk order every request, prefix cache on: the first
                     request prefills everything, the next ones hit the cache (the best case for PI; it
                     needs the memory to be a stable prefix)
  pi-fixed-nocache   the same order, prefix cache emptied before each request: a full prefill each time
  pi-shuffled        a new random order per request (what retrieval does), prefix cache on: it cannot hit
                     past the instruction
  kv-shuffled        KV injection, a new random order per request: every chunk re-rotated to its new
                     position and injected, only the query prefilled

    python bench/position.py --quick          # 1K and 4K
    python bench/position.py                  # 1K, 4K, 16K (16K needs max_model_len 17K; minutes of PI prefill)

SmolLM2-135M is trained to 8192 positions; sizes beyond that are timed only (vLLM is told to allow them).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferscale_core.vllm_env import set_vllm_cpu_env

set_vllm_cpu_env(4)  # before vLLM is imported

from bench.eval import serving  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CONDITIONS = ("pi-fixed-cache", "pi-fixed-nocache", "pi-shuffled", "kv-shuffled")


def parse_args(argv=None):
    from bench.eval.locomo import default_data_path, require_data_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data_path(), help="LoCoMo-format JSON file")
    ap.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--sizes", default="1024,4096,16384", help="memory sizes in tokens (comma-separated)")
    ap.add_argument("--chunk-tokens", type=int, default=64, help="tokens per memory chunk")
    ap.add_argument("--repeats", type=int, default=3, help="requests per condition and size")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="engine (cache) dtype")
    ap.add_argument("--quick", action="store_true", help="sizes 1024,4096, 2 repeats")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for position.json and position.md")
    a = ap.parse_args(argv)
    require_data_path(a.data)
    a.sizes = [1024, 4096] if a.quick else [int(x) for x in a.sizes.split(",")]
    a.repeats = 2 if a.quick else a.repeats
    if a.chunk_tokens < 8 or any(s < a.chunk_tokens for s in a.sizes) or a.repeats < 1:
        ap.error("need chunk-tokens >= 8, every size >= chunk-tokens, repeats >= 1")
    return a


def make_chunks(template, texts: list[str], n: int, tokens: int) -> list[str]:
    """n chunk texts whose rendered ids ("- text\\n") have at most `tokens` tokens (greedy by word)."""
    words = [w for t in texts for w in t.split()]
    chunks, i = [], 0
    while len(chunks) < n:
        if i >= len(words):
            raise ValueError(f"not enough text for {n} chunks of {tokens} tokens")
        cur = [words[i]]
        i += 1
        while i < len(words) and len(template.fact_ids(" ".join(cur + [words[i]]))) <= tokens:
            cur.append(words[i])
            i += 1
        chunks.append(" ".join(cur))
    return chunks


def main(argv=None) -> dict:
    args = parse_args(argv)  # a bad --data is named before torch and vLLM are imported (seconds)
    import torch

    from bench.eval.locomo import load_locomo
    from inferscale_core.engine import InjectingEngine
    from inferscale_core.memory import Memory
    from inferscale_core.vllm_setup import default_sampling

    convs = load_locomo(args.data)
    turns = [t.render() for c in convs for t in c.turns]
    questions = [q.question for c in convs for q in c.questions if q.answerable]
    rng = random.Random(args.seed)
    n_max = max(args.sizes) // args.chunk_tokens
    max_len = max(args.sizes) + 1024  # memory + instruction + query, rounded up

    t0 = time.perf_counter()
    memory = Memory(args.model, dtype=torch.float32)
    trained = int(getattr(memory.model.config, "max_position_embeddings", max_len))
    if max_len > trained:
        # SmolLM2-135M is trained to 8192 positions: a 16K memory is timed (RoPE is defined at any position),
        # but its answers mean nothing. vLLM refuses such a max_model_len unless told.
        print(f"# note: max_model_len {max_len} > the model's {trained} trained positions; timing only", flush=True)
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    engine = InjectingEngine(memory, args.model, dtype=getattr(torch, args.dtype), max_model_len=max_len,
                             enable_prefix_caching=True)
    t_engine = time.perf_counter() - t0
    chunks = make_chunks(memory.template, turns, n_max, args.chunk_tokens)
    ids = [f"chunk{i:04d}" for i in range(n_max)]
    t0 = time.perf_counter()
    engine.add("position", chunks, fact_ids=ids)
    t_add = time.perf_counter() - t0
    chunk_lens = [len(memory.template.fact_ids(c)) for c in chunks]
    print(f"# {n_max} chunks ({statistics.mean(chunk_lens):.1f} tokens each), encoded in {t_add:.1f} s; engine "
          f"{t_engine:.1f} s; dtype {args.dtype}; {serving.machine()}", flush=True)

    first = default_sampling(max_tokens=1)
    qi = 0

    def request(order, mode):
        nonlocal qi
        q = questions[qi % len(questions)]
        qi += 1
        before = engine.metrics()["worker"].get("injection_seconds", 0.0)
        p = serving.prepare_fixed(engine, "position", order, q, mode)
        (t,) = serving.run_prepared(engine, [p], first)
        inject = engine.metrics()["worker"].get("injection_seconds", 0.0) - before
        return {"ttft_s": t.ttft_s, "q2ft_s": t.q2ft_s, "prompt_len": t.answer.prompt_len,
                "cached": t.num_cached_tokens, "inject_s": inject}

    request(ids[:16], "kv"), request(ids[:16], "pi")  # warm-up
    rows, raw = [], []
    for size in args.sizes:
        n = size // args.chunk_tokens
        fixed = ids[:n]
        serving.reset_prefix_cache(engine)
        cold = request(fixed, "pi")  # fills the cache for pi-fixed-cache
        runs = {c: [] for c in CONDITIONS}
        for _ in range(args.repeats):
            runs["pi-fixed-cache"].append(request(fixed, "pi"))
        for _ in range(args.repeats):
            serving.reset_prefix_cache(engine)
            runs["pi-fixed-nocache"].append(request(fixed, "pi"))
        for _ in range(args.repeats):
            runs["pi-shuffled"].append(request(rng.sample(fixed, n), "pi"))
        for _ in range(args.repeats):
            runs["kv-shuffled"].append(request(rng.sample(fixed, n), "kv"))
        row = {"size": size, "chunks": n, "memory_tokens": cold["prompt_len"], "pi_cold_ttft_ms": 1000 * cold["ttft_s"],
               "loadavg": serving.machine()["loadavg"][0]}
        for c, rs in runs.items():
            row[c] = {"ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in rs),
                      "ttft_min_ms": 1000 * min(r["ttft_s"] for r in rs),
                      "cached": statistics.mean(r["cached"] for r in rs),
                      "inject_ms": 1000 * statistics.mean(r["inject_s"] for r in rs)}
            raw += [{"size": size, "condition": c, **r} for r in rs]
        rows.append(row)
        print(json.dumps(row), flush=True)

    md = ["| memory tokens (prompt) | chunks | " + " | ".join(f"{c} TTFT ms" for c in CONDITIONS)
          + " | PI shuffled / KV shuffled | PI no-cache / PI cached | KV injection ms | load avg |",
          "|" + "---|" * (len(CONDITIONS) + 6)]
    for r in rows:
        cells = [f"{r[c]['ttft_ms']:.0f} (min {r[c]['ttft_min_ms']:.0f}; {r[c]['cached']:.0f} not prefilled)"
                 for c in CONDITIONS]
        md.append(f"| {r['size']} ({r['memory_tokens']}) | {r['chunks']} | " + " | ".join(cells)
                  + f" | {r['pi-shuffled']['ttft_ms'] / r['kv-shuffled']['ttft_ms']:.1f}x"
                  + f" | {r['pi-fixed-nocache']['ttft_ms'] / r['pi-fixed-cache']['ttft_ms']:.1f}x"
                  + f" | {r['kv-shuffled']['inject_ms']:.0f} | {r['loadavg']:.1f} |")
    table = "\n".join(md)
    print("\n" + table)
    result = {"rows": rows, "raw": raw, "dtype": args.dtype, "chunk_tokens": args.chunk_tokens,
              "chunk_tokens_mean": statistics.mean(chunk_lens), "repeats": args.repeats, "max_model_len": max_len,
              "machine": serving.machine(), "encode_s": t_add, "engine_start_s": t_engine,
              "model_trained_positions": trained}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "position.json").write_text(json.dumps(result, indent=1))
    (args.out / "position.md").write_text(table + "\n")
    engine.shutdown()
    return result


if __name__ == "__main__":
    main()
