"""Empirical equivalence: KV injection and prompt injection, identical prompt token ids, greedy decoding.

3 users (LoCoMo conversations) x 2 query types (the first single-hop and the first temporal question of
each) x each k: the k retrieved facts are served two ways, and the two greedy outputs are compared.

  apart   the facts as InferScale stores them: each encoded on its own (behind the instruction prefix),
          re-rotated to its position at serving time. Fact i never attended to facts 1..i-1, so the KV
          differs from a prefill of the same tokens and outputs MAY differ.
  joint   the same k facts stored as ONE memory chunk ("- f1\\n- f2\\n...") encoded in one forward pass
          behind the prefix: the KV is what vLLM's own prefill computes, so outputs MUST be identical
          (up to fp32 rounding between the HF encoder and vLLM's kernels; run in float32).

Prints counts of identical / different outputs, the first differing token, and the largest difference
of the chosen tokens' logprobs over the common prefix.

    python bench/equivalence.py            # ~3 minutes on 2 CPU cores
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferscale_core.vllm_env import set_vllm_cpu_env

set_vllm_cpu_env(2)  # before vLLM is imported

from bench.eval import serving  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
QUERY_TYPES = {4: "single-hop", 2: "temporal"}


def parse_args(argv=None):
    from bench.eval.locomo import default_data_path, require_data_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data_path(), help="LoCoMo-format JSON file")
    ap.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--users", default="conv-26,conv-30,conv-41", help="conversations, one user each")
    ap.add_argument("--k", default="10,50", help="facts per prompt (comma-separated)")
    ap.add_argument("--max-facts", type=int, default=80, help="the first N facts of each conversation are its memory")
    ap.add_argument("--max-tokens", type=int, default=50)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    require_data_path(a.data)
    a.users = [u for u in a.users.split(",") if u]
    a.k = [int(k) for k in a.k.split(",")]
    if max(a.k) > a.max_facts:
        ap.error(f"k={max(a.k)} is more than --max-facts {a.max_facts}")
    return a


def compare(a, b) -> dict:
    """Identical token ids? Else the first differing position; max |logprob diff| of the common prefix."""
    n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
             min(len(a.token_ids), len(b.token_ids)))
    diffs = [abs(la[t].logprob - lb[t].logprob)
             for t, la, lb in zip(a.token_ids[:n], a.logprobs or [], b.logprobs or []) if t in la and t in lb]
    return {"identical": a.token_ids == b.token_ids, "first_diff": None if a.token_ids == b.token_ids else n,
            "max_logprob_diff": max(diffs, default=0.0), "kv": a.text, "pi": b.text}


def main(argv=None) -> dict:
    args = parse_args(argv)  # a bad --data is named before torch and vLLM are imported (seconds)
    import torch
    from vllm import SamplingParams

    from bench.eval.locomo import load_locomo
    from inferscale_core.engine import InjectingEngine
    from inferscale_core.memory import Memory
    from inferscale_core.requests import Query

    convs = {c.sample_id: c for c in load_locomo(args.data)}
    missing = [u for u in args.users if u not in convs]
    if missing:
        sys.exit(f"error: no conversation {missing} in {args.data}")
    dtype = getattr(torch, args.dtype)
    limit = 4096  # a joint chunk holds k facts
    memory = Memory(args.model, dtype=dtype, max_fact_tokens=limit)
    engine = InjectingEngine(memory, args.model, dtype=dtype, max_model_len=4096, enable_prefix_caching=True,
                             store_options={"max_fact_tokens": limit})
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1)
    rows = []
    for uid in args.users:
        conv = convs[uid]
        facts = conv.facts[: args.max_facts]
        engine.add(uid, [f.render() for f in facts], fact_ids=[f.fact_id for f in facts])
        for cat, qtype in QUERY_TYPES.items():
            q = next(q for q in conv.questions if q.category == cat)
            for k in args.k:
                kv, pi = engine.generate_many([Query(uid, q.question, k, 0, "kv"), Query(uid, q.question, k, 0, "pi")],
                                              greedy)
                texts = [memory.get(uid, f).text for f in pi.fact_ids]
                joint_user = f"joint-{uid}-{cat}-{k}"
                engine.add(joint_user, ["\n- ".join(t.strip() for t in texts)], fact_ids=["memory"])
                jkv, jpi = engine.generate_many([Query(joint_user, q.question, 1, 0, "kv"),
                                                 Query(joint_user, q.question, 1, 0, "pi")], greedy)
                p_apart = engine.prepare(uid, q.question, k, mode="pi").prompt_ids
                p_joint = engine.prepare(joint_user, q.question, 1, mode="pi").prompt_ids
                assert kv.prompt_len == pi.prompt_len and jkv.prompt_len == jpi.prompt_len
                assert kv.num_cached_tokens >= kv.memory_len // 32 * 32, "the KV request was not injected"
                rows.append({"user": uid, "query_type": qtype, "k": k, "question": q.question,
                             "prompt_tokens": pi.prompt_len, "same_ids_joint_vs_apart": p_apart == p_joint,
                             "apart": compare(kv, pi), "joint": compare(jkv, jpi),
                             "kv_injected_tokens": kv.num_cached_tokens, "joint_kv_injected": jkv.num_cached_tokens})
                print(json.dumps({k2: v for k2, v in rows[-1].items() if k2 != "question"}), flush=True)

    summary = {}
    for kind in ("apart", "joint"):
        same = sum(r[kind]["identical"] for r in rows)
        summary[kind] = {"pairs": len(rows), "identical": same, "different": len(rows) - same,
                         "max_logprob_diff": max(r[kind]["max_logprob_diff"] for r in rows)}
    lines = ["| memory encoding | pairs | identical | different | max logprob diff (common prefix) |",
             "|---|---|---|---|---|"]
    for kind, s in summary.items():
        lines.append(f"| {kind} | {s['pairs']} | {s['identical']} | {s['different']} | {s['max_logprob_diff']:.2e} |")
    table = "\n".join(lines)
    print("\n" + table)
    result = {"summary": summary, "rows": rows, "dtype": args.dtype, "k": args.k, "users": args.users,
              "max_facts": args.max_facts, "max_tokens": args.max_tokens, "machine": serving.machine()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "equivalence.json").write_text(json.dumps(result, indent=1))
    (args.out / "equivalence.md").write_text(table + "\n")
    engine.shutdown()
    if summary["joint"]["different"]:
        print("WARNING: jointly encoded memory gave different outputs: KV injection is not exact here")
    return result


if __name__ == "__main__":
    main()
