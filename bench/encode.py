"""Encoding benchmark: how fast memory facts are encoded into pre-RoPE KV, and what one fact costs to keep.

For each context window w (turns of the conversation before the fact), the facts of one LoCoMo conversation
are encoded exactly as `Memory.add` encodes them: the fact's template ids ("- {fact}\\n") behind the
instruction prefix and the w rendered turns; only the fact's tokens are kept. Reported per w:

- facts/s and tokens/s (tokens = every real token of the forward passes: prefix + window + fact);
- KV bytes per fact (EncodedFact.nbytes, checked against the formula 2·L·c·h·d·b of the model's shape);
- index bytes per fact (VectorIndex.nbytes / facts: one float32 embedding of the MiniLM embedder).

Stored bytes do not depend on w (only the fact's tokens are kept); encoding time does.

    python bench/encode.py --quick
    python bench/encode.py --device cuda --dtype bfloat16 --batch-size 32
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for a hub

import torch

from bench.eval.locomo import default_data_path, load_locomo, require_data_path, window_turns
from inferscale_core.encoder import ENCODE_BATCH_SIZE
from inferscale_core.model_spec import ModelSpec

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "encode.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
USER = "bench-encode"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=default_data_path(),
                   help="LoCoMo-format JSON (default: ../shared/data/locomo_dev.json when present)")
    p.add_argument("--conversation", default="0",
                   help="which conversation of --data: an index or a sample_id (default: the first)")
    p.add_argument("--windows", default="0,5,20,50", help="context windows w, in turns (default: %(default)s)")
    p.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="model and KV dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--batch-size", type=int, default=ENCODE_BATCH_SIZE,
                   help="facts per forward (default: the shipped ENCODE_BATCH_SIZE, %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="encode only the first N facts")
    p.add_argument("--quick", action="store_true", help="a smoke run: w in {0,5} and at most 16 facts")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default: %(default)s)")
    a = p.parse_args(argv)
    try:
        a.windows = [int(w) for w in a.windows.split(",") if w.strip()]
    except ValueError:
        p.error(f"--windows must be comma-separated integers, got {a.windows!r}")
    if not a.windows or min(a.windows) < 0:
        p.error("--windows needs at least one window size, all >= 0")
    if a.quick:
        a.windows = [w for w in a.windows if w <= 5] or [0]
        a.limit = min(a.limit or 16, 16)
    if a.limit is not None and a.limit < 1:
        p.error(f"--limit must be >= 1, got {a.limit}")
    if a.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {a.batch_size}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device} requested but this torch build sees no CUDA device")
    if a.dtype == "auto":
        a.dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
    return a


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name(device)}"
    return f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pick_conversation(conversations, which: str):
    if which.isdigit():
        i = int(which)
        if i >= len(conversations):
            raise SystemExit(f"--conversation {i} is out of range: the file has {len(conversations)} conversations")
        return conversations[i]
    for c in conversations:
        if c.sample_id == which:
            return c
    raise SystemExit(f"--conversation {which!r} matches no sample_id; known: {[c.sample_id for c in conversations]}")


def run(a: argparse.Namespace) -> dict:
    from inferscale_core.embedder import default_embedder
    from inferscale_core.encoder import PreRopeEncoder
    from inferscale_core.index import VectorIndex
    from inferscale_core.models import load_model, resolve_model_path
    from inferscale_core.template import PromptTemplate

    conv = pick_conversation(load_locomo(require_data_path(a.data)), a.conversation)
    facts = list(conv.facts[: a.limit] if a.limit else conv.facts)
    if not facts:
        raise SystemExit(f"conversation {conv.sample_id} has no observation facts")

    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    model_path = resolve_model_path(a.model)
    model, tokenizer = load_model(model_path, device=device, dtype=dtype)
    spec = ModelSpec.from_config(model.config)
    encoder = PreRopeEncoder(model, tokenizer)
    template = PromptTemplate(tokenizer)
    fact_texts = [f.render() for f in facts]  # with the session date, as bench/locomo.py stores them
    fact_ids = [template.fact_ids(t) for t in fact_texts]
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes_per_token = spec.kv_bytes(1, dtype)

    # Warm up kernels and allocator once, so the first window size does not pay for it.
    encoder.encode_batch([(fact_ids[0], [template.prefix_ids])] * min(a.batch_size, 2), a.batch_size, progress=False)
    synchronize(device)

    rows = []
    for w in a.windows:
        items = [(ids, [template.prefix_ids] + [t.render() for t in window_turns(conv, f, w)])
                 for f, ids in zip(facts, fact_ids)]
        context_tokens = [sum(len(encoder.token_ids(turn)) for turn in ctx) for _, ctx in items]
        context_tokens = [min(c, encoder.max_window_tokens) for c in context_tokens]  # the encoder's cap
        synchronize(device)
        t0 = time.perf_counter()
        encoded = encoder.encode_batch(items, a.batch_size, progress=False)
        synchronize(device)
        seconds = time.perf_counter() - t0
        nbytes = [e.nbytes for e in encoded]
        formula_ok = all(e.nbytes == spec.kv_bytes(e.num_tokens, dtype) for e in encoded)
        processed = sum(context_tokens) + sum(e.num_tokens for e in encoded)
        rows.append({
            "w": w, "facts": len(encoded), "seconds": seconds,
            "facts_per_s": len(encoded) / seconds, "tokens_per_s": processed / seconds,
            "mean_context_tokens": statistics.fmean(context_tokens),
            "mean_fact_tokens": statistics.fmean(e.num_tokens for e in encoded),
            "kv_bytes_per_fact": statistics.fmean(nbytes), "kv_bytes_total": sum(nbytes),
            "kv_bytes_formula_ok": formula_ok,
        })
        del encoded

    # The retrieval side of a fact: one embedding in the per-user index (independent of w).
    embedder = default_embedder(device)
    embedder.embed(fact_texts[:1])  # loads the model; not part of the throughput
    synchronize(device)
    t0 = time.perf_counter()
    embeddings = embedder.embed(fact_texts)
    synchronize(device)
    embed_seconds = time.perf_counter() - t0
    index = VectorIndex(embedder.dim, device=device)
    index.add_many(USER, [f"f{i}" for i in range(len(facts))], embeddings)
    index_bytes_per_fact = index.nbytes(USER) / len(facts)
    for r in rows:
        r["index_bytes_per_fact"] = index_bytes_per_fact
        r["total_bytes_per_fact"] = r["kv_bytes_per_fact"] + index_bytes_per_fact

    return {
        "benchmark": "encode",
        "device": str(device), "device_description": device_description(device),
        "dtype": a.dtype, "batch_size": a.batch_size,
        "model": {"path": str(model_path), "name": model_path.name, "architecture": spec.architecture,
                  "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                  "bytes_per_element": elem, "kv_bytes_per_token": kv_bytes_per_token},
        "data": str(a.data), "conversation": conv.sample_id, "num_facts": len(facts),
        "prefix_tokens": len(template.prefix_ids),
        "embedder": {"dim": embedder.dim, "facts_per_s": len(facts) / embed_seconds,
                     "index_bytes_per_fact": index_bytes_per_fact},
        "torch": torch.__version__, "quick": a.quick,
        "rows": rows,
    }


def markdown(res: dict) -> str:
    m = res["model"]
    lines = [
        f"## Encoding: {m['name']} on {res['device_description']} ({res['dtype']}, batch {res['batch_size']})",
        "",
        f"Device: **{res['device']}**. {res['num_facts']} facts of LoCoMo conversation {res['conversation']}, "
        f"each encoded behind the {res['prefix_tokens']}-token instruction prefix and w turns. "
        f"KV per token = 2·L·h·d·b = 2·{m['num_layers']}·{m['num_kv_heads']}·{m['head_dim']}·"
        f"{m['bytes_per_element']} = {m['kv_bytes_per_token']} B.",
        "",
        "| device | w (turns) | mean context tokens | mean fact tokens | facts/s | tokens/s | KV bytes/fact "
        "| formula ok | index bytes/fact |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|---:|",
    ]
    label = res["device"].upper() if res["device"] == "cpu" else res["device"]
    for r in res["rows"]:
        lines.append(
            f"| {label} | {r['w']} | {r['mean_context_tokens']:.0f} | {r['mean_fact_tokens']:.1f} "
            f"| {r['facts_per_s']:.2f} | {r['tokens_per_s']:.0f} | {r['kv_bytes_per_fact']:.0f} "
            f"| {'yes' if r['kv_bytes_formula_ok'] else 'NO'} | {r['index_bytes_per_fact']:.0f} |")
    e = res["embedder"]
    lines += ["", f"Embedder (dim {e['dim']}): {e['facts_per_s']:.1f} facts/s on {res['device']}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    res = run(a)
    print(markdown(res))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
