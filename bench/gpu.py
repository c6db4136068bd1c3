"""GPU microbenchmarks of the serving path, with only torch + transformers (no vLLM needed).

(a) TTFT, KV injection vs prompt injection, for a memory of k facts (~30 tokens each) and a ~30-token query:
    PI = prefill of the whole prompt (memory + query) -> first token;
    KV = compose (gather the stored pre-RoPE chunks + chunked RoPE, on the device) + prefill of the query only,
         with the composed memory passed as `past_key_values` -> first token.
(b) Bandwidth: KV bytes composed per second (compose; compose + scatter into a paged-layout cache buffer)
    next to a plain device-to-device copy of the same bytes and a pinned host-to-device copy.
(c) Latency of exact vector search (`VectorIndex`) on the device for 1e3 / 1e4 / 1e5 facts, batch 1 and 64.

The model has the shape of Llama-3.1-8B (32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128,
llama3 RoPE) with RANDOM weights in bf16: its outputs are meaningless, only the timings are. `--tiny` uses a
2-layer model of the same family so the script also runs (and is tested) on CPU; CPU numbers are labelled
CPU everywhere and say nothing about a GPU.

    python bench/gpu.py                       # on a CUDA machine
    python bench/gpu.py --device cpu --tiny   # smoke run on CPU
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.hf_inject import as_past_key_values
from inferscale_core.compose import compose
from inferscale_core.encoder import PreRopeEncoder
from inferscale_core.index import VectorIndex
from inferscale_core.model_spec import ModelSpec
from inferscale_core.rope import ChunkedRope

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "gpu.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
BLOCK_SIZE = 16  # tokens per block of the emulated paged cache (vLLM's default)
USER = "bench-user"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family (CPU smoke run)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--k", default="5,10,20,50", help="facts per memory (default: %(default)s)")
    p.add_argument("--fact-tokens", type=int, default=30)
    p.add_argument("--query-tokens", type=int, default=30)
    p.add_argument("--index-sizes", default=None, help="facts in the index (default: 1000,10000,100000; "
                   "--tiny: 1000,10000)")
    p.add_argument("--index-batches", default="1,64")
    p.add_argument("--index-dim", type=int, default=384, help="embedding width (MiniLM: 384)")
    p.add_argument("--top-k", type=int, default=10, help="facts returned per search")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 3; --tiny 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs, median reported (default 20; --tiny 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default: %(default)s)")
    a = p.parse_args(argv)

    def ints(name: str, text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            p.error(f"--{name} must be comma-separated integers, got {text!r}")
        if not values or min(values) < 1:
            p.error(f"--{name} needs at least one value, all >= 1")
        return values

    a.k = ints("k", a.k)
    a.index_sizes = ints("index-sizes", a.index_sizes or ("1000,10000" if a.tiny else "1000,10000,100000"))
    a.index_batches = ints("index-batches", a.index_batches)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 3)
    a.repeats = a.repeats if a.repeats is not None else (3 if a.tiny else 20)
    for name in ("fact_tokens", "query_tokens", "index_dim", "top_k", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    a.device = torch.device(a.device)
    if a.device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {a.device} requested but this torch build sees no CUDA device")
    if a.device.type != "cuda" and not a.tiny:
        p.error("the Llama-3.1-8B shape (16 GB of bf16 weights) is meant for a GPU; on CPU add --tiny")
    return a


# ---------------------------------------------------------------------------------------------- helpers

def device_label(device: torch.device) -> str:
    """The label every number carries: 'CPU' or 'GPU <name>'."""
    return f"GPU {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "CPU"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> dict:
    """Median (and spread) of wall time in ms; the device is synchronized before and after each run, so a
    number covers everything the call launched, host overhead included (as a user would wait for it)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"median_ms": statistics.median(times), "min_ms": times[0], "max_ms": times[-1], "runs": repeats}


def model_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        shape = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    else:  # Llama-3.1-8B
        shape = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    return LlamaConfig(max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2, rope_parameters=dict(LLAMA3_ROPE), **shape)


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    # Initialized directly on the device: 8B random parameters would take minutes on the host.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(tiny), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


# ---------------------------------------------------------------------------------------------- (a) TTFT

def bench_ttft(model, facts, query_ids, a, label: str) -> list[dict]:
    device = a.device
    rope = ChunkedRope(model.config, device=device, dtype=model.dtype)
    spec = ModelSpec.from_config(model.config)
    rows = []
    for k in a.k:
        chunks = facts[:k]
        memory = [int(t) for c in chunks for t in c.token_ids.tolist()]
        m = len(memory)

        @torch.no_grad()
        def prompt_injection():
            ids = torch.tensor(memory + query_ids, device=device)[None]
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            return int(out.logits[0, -1].argmax())

        @torch.no_grad()
        def kv_injection():
            comp = compose(rope, chunks, query_ids)
            ids = torch.tensor(query_ids, device=device)[None]
            positions = torch.arange(m, m + len(query_ids), device=device)[None]
            out = model(input_ids=ids, position_ids=positions, past_key_values=as_past_key_values(comp),
                        use_cache=True, logits_to_keep=1)
            return int(out.logits[0, -1].argmax())

        def compose_only():
            return compose(rope, chunks, query_ids)

        pi = measure(prompt_injection, device, a.warmup, a.repeats)
        kv = measure(kv_injection, device, a.warmup, a.repeats)
        comp = measure(compose_only, device, a.warmup, a.repeats)
        rows.append({"device": label, "k": k, "memory_tokens": m, "query_tokens": len(query_ids),
                     "memory_kv_bytes": spec.kv_bytes(m, model.dtype),
                     "pi_ttft_ms": pi["median_ms"], "kv_ttft_ms": kv["median_ms"],
                     "kv_compose_ms": comp["median_ms"], "pi_over_kv": pi["median_ms"] / kv["median_ms"],
                     "pi": pi, "kv": kv, "compose": comp})
    return rows


# ---------------------------------------------------------------------------------------------- (b) bandwidth

def bench_bandwidth(model, facts, query_ids, a, label: str) -> list[dict]:
    device = a.device
    rope = ChunkedRope(model.config, device=device, dtype=model.dtype)
    spec = ModelSpec.from_config(model.config)
    # A paged-layout cache buffer big enough for the largest memory; each memory goes to randomly chosen
    # blocks, as a paged cache hands them out. (Plain torch index_copy_, standing in for vLLM's cache write.)
    max_tokens = max(a.k) * a.fact_tokens
    num_blocks = 2 * (max_tokens // BLOCK_SIZE + 1)
    shape = (spec.num_layers, num_blocks * BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    cache_k = torch.zeros(shape, dtype=model.dtype, device=device)
    cache_v = torch.zeros(shape, dtype=model.dtype, device=device)
    gen = torch.Generator().manual_seed(a.seed)
    rows = []
    for k in a.k:
        chunks = facts[:k]
        m = sum(c.num_tokens for c in chunks)
        nbytes = spec.kv_bytes(m, model.dtype)
        blocks = torch.randperm(num_blocks, generator=gen)[: (m + BLOCK_SIZE - 1) // BLOCK_SIZE]
        slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[:m].to(device)

        def compose_only():
            return compose(rope, chunks, query_ids)

        def compose_and_inject():
            comp = compose(rope, chunks, query_ids)
            cache_k.index_copy_(1, slots, comp.k)
            cache_v.index_copy_(1, slots, comp.v)

        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        c = measure(compose_only, device, a.warmup, a.repeats)
        ci = measure(compose_and_inject, device, a.warmup, a.repeats)
        d2d = measure(lambda: dst.copy_(src), device, a.warmup, a.repeats)
        row = {"device": label, "k": k, "memory_tokens": m, "kv_bytes": nbytes,
               "compose_ms": c["median_ms"], "compose_inject_ms": ci["median_ms"], "d2d_copy_ms": d2d["median_ms"],
               "compose_GBps": nbytes / c["median_ms"] / 1e6,
               "compose_inject_GBps": nbytes / ci["median_ms"] / 1e6,
               "d2d_copy_GBps": nbytes / d2d["median_ms"] / 1e6,
               "h2d_pinned_ms": None, "h2d_pinned_GBps": None}
        if device.type == "cuda":  # pinned host memory only exists next to a CUDA device
            host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
            h2d = measure(lambda: dst.copy_(host, non_blocking=True), device, a.warmup, a.repeats)
            row.update(h2d_pinned_ms=h2d["median_ms"], h2d_pinned_GBps=nbytes / h2d["median_ms"] / 1e6)
            del host
        rows.append(row)
        src = dst = None  # frees the device buffers before the next size
    return rows


# ---------------------------------------------------------------------------------------------- (c) index

def bench_index(a, label: str) -> list[dict]:
    device = a.device
    gen = torch.Generator(device=device).manual_seed(a.seed)
    rows = []
    for n in a.index_sizes:
        index = VectorIndex(a.index_dim, device=device)
        t0 = time.perf_counter()
        index.add_many(USER, [f"f{i}" for i in range(n)],
                       torch.randn(n, a.index_dim, device=device, generator=gen))
        synchronize(device)
        build_s = time.perf_counter() - t0
        for batch in a.index_batches:
            q = torch.randn(batch, a.index_dim, device=device, generator=gen)
            query = q[0] if batch == 1 else q  # a single query is the [dim] form the serving path uses
            r = measure(lambda: index.search(USER, query, a.top_k), device, a.warmup, a.repeats)
            rows.append({"device": label, "facts": n, "batch": batch, "dim": a.index_dim, "top_k": a.top_k,
                         "latency_ms": r["median_ms"], "per_query_us": r["median_ms"] * 1e3 / batch,
                         "build_s": build_s, "timing": r})
        index = None  # frees the device matrix before the next size
    return rows


# ---------------------------------------------------------------------------------------------- report

def markdown(res: dict) -> str:
    gpu = res["device_type"] == "cuda"
    note = "" if gpu else " — CPU numbers from a tiny model: they say nothing about a GPU"
    m = res["model"]
    out = [f"# InferScale device benchmark on {res['device_label']}{note}", "",
           f"Model: {m['shape']} shape, RANDOM weights (timings only), {m['dtype']}, {m['num_layers']} layers, "
           f"{m['num_kv_heads']} KV heads, head_dim {m['head_dim']}, {m['kv_bytes_per_token']} KV bytes/token. "
           f"Median of {res['settings']['repeats']} runs after {res['settings']['warmup']} warmup.", "",
           "## (a) Time to first token: KV injection vs prompt injection", "",
           "| device | k facts | memory tokens | query tokens | PI TTFT ms | KV TTFT ms | of which compose ms | PI/KV |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["ttft"]:
        out.append(f"| {r['device']} | {r['k']} | {r['memory_tokens']} | {r['query_tokens']} | {r['pi_ttft_ms']:.2f} "
                   f"| {r['kv_ttft_ms']:.2f} | {r['kv_compose_ms']:.2f} | {r['pi_over_kv']:.2f}x |")
    out += ["", "## (b) Bandwidth: composing KV vs plain copies of the same bytes (GB/s = 1e9 B/s)", "",
            "| device | k facts | KV MiB | compose GB/s | compose+inject GB/s | device copy GB/s | pinned H2D GB/s |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["bandwidth"]:
        h2d = f"{r['h2d_pinned_GBps']:.1f}" if r["h2d_pinned_GBps"] is not None else "n/a (no CUDA)"
        out.append(f"| {r['device']} | {r['k']} | {r['kv_bytes'] / 2**20:.2f} | {r['compose_GBps']:.2f} "
                   f"| {r['compose_inject_GBps']:.2f} | {r['d2d_copy_GBps']:.2f} | {h2d} |")
    out += ["", "## (c) Exact vector search (VectorIndex) latency", "",
            "| device | facts | batch | dim | top-k | latency ms | per query µs |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["index"]:
        out.append(f"| {r['device']} | {r['facts']} | {r['batch']} | {r['dim']} | {r['top_k']} "
                   f"| {r['latency_ms']:.3f} | {r['per_query_us']:.1f} |")
    return "\n".join(out)


def run(a: argparse.Namespace) -> dict:
    torch.manual_seed(a.seed)
    label = device_label(a.device)
    dtype = DTYPES[a.dtype]
    model = build_model(a.tiny, a.device, dtype)
    spec = ModelSpec.from_config(model.config)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(a.seed)
    fact_ids = [torch.randint(3, vocab, (a.fact_tokens,), generator=gen).tolist() for _ in range(max(a.k))]
    query_ids = torch.randint(3, vocab, (a.query_tokens,), generator=gen).tolist()
    # The memory facts, encoded once by the real encoder and kept on the device (the store's device tier).
    facts = PreRopeEncoder(model, tokenizer=None).encode_batch([(ids, []) for ids in fact_ids], batch_size=16,
                                                               progress=False)
    import transformers

    res = {
        "benchmark": "gpu", "device": str(a.device), "device_type": a.device.type, "device_label": label,
        "model": {"shape": "tiny-llama3" if a.tiny else "Llama-3.1-8B", "random_weights": True, "dtype": a.dtype,
                  "num_layers": spec.num_layers, "hidden_size": model.config.hidden_size,
                  "num_attention_heads": model.config.num_attention_heads, "num_kv_heads": spec.num_kv_heads,
                  "head_dim": spec.head_dim, "rope_type": spec.rope_type,
                  "kv_bytes_per_token": spec.kv_bytes(1, dtype),
                  "parameters": sum(p.numel() for p in model.parameters())},
        "settings": {"k": a.k, "fact_tokens": a.fact_tokens, "query_tokens": a.query_tokens,
                     "warmup": a.warmup, "repeats": a.repeats, "block_size": BLOCK_SIZE,
                     "index_sizes": a.index_sizes, "index_batches": a.index_batches, "seed": a.seed},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(),
                     "cuda": torch.version.cuda if a.device.type == "cuda" else None},
    }
    res["ttft"] = bench_ttft(model, facts, query_ids, a, label)
    res["bandwidth"] = bench_bandwidth(model, facts, query_ids, a, label)
    del model, facts
    if a.device.type == "cuda":
        torch.cuda.empty_cache()
    res["index"] = bench_index(a, label)
    return res


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
