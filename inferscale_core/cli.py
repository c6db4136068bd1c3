"""`inferscale` command line: demo (the main job on the embedded default model), serve / add / ask (the Ray
Serve application and its gRPC client), bench (the benchmark scripts)."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from .vllm_env import set_vllm_cpu_env

DEMO_FACTS = {
    "alice": ["Alice adopted a grey cat named Miso in March.",
              "Alice works as a night-shift nurse at St. Mary's hospital.",
              "Alice's favourite food is tonkotsu ramen.",
              "Alice is training for the Berlin marathon in September.",
              "Alice's sister Emma lives in Lisbon."],
    "bob": ["Bob plays bass guitar in a jazz band called Blue Hour.",
            "Bob has a golden retriever named Pixel.",
            "Bob is allergic to peanuts.",
            "Bob moved from Toronto to Seattle two years ago."],
}
DEMO_QUESTIONS = [("alice", "What is the name of my cat?"), ("alice", "Which marathon am I training for?"),
                  ("bob", "What is my dog called?"), ("bob", "Which city did I move from?")]


def demo(args) -> int:
    """Two users' facts encoded once, each question answered with KV injection and with prompt injection on the
    same vLLM engine; prints both answers, their latency and where vLLM got the memory tokens from."""
    set_vllm_cpu_env()
    import torch

    from .engine import InjectingEngine

    dtype = getattr(torch, args.dtype)
    print(f"loading {args.model or 'SmolLM2-135M-Instruct (embedded default)'} on vLLM ({args.dtype}, CPU) ...")
    engine = InjectingEngine(model_path=args.model, dtype=dtype)
    try:
        for user, facts in DEMO_FACTS.items():
            t = time.perf_counter()
            engine.add(user, facts)
            print(f"{user}: {len(facts)} facts encoded once in {time.perf_counter() - t:.2f} s")
        for mode in ("kv", "pi"):  # first requests pay one-off kernel set-up; keep it out of the timings
            engine.generate("alice", "Hello!", k=args.k, mode=mode)
        for user, question in DEMO_QUESTIONS:
            print(f"\n[{user}] {question}")
            for mode in ("kv", "pi"):
                t = time.perf_counter()
                ans = engine.generate(user, question, k=args.k, mode=mode)
                took = time.perf_counter() - t
                label = "KV injection    " if mode == "kv" else "prompt injection"
                print(f"  {label} {took * 1000:7.1f} ms  prompt {ans.prompt_len} tok, "
                      f"not prefilled {ans.num_cached_tokens}: {ans.text.strip()!r}")
        m = engine.metrics()
        by_source = {k.removeprefix("prompt_tokens_"): int(v) for k, v in m.items() if k.startswith("prompt_tokens_")}
        print(f"\nprompt tokens by source (vLLM counters, both modes): {by_source}")
        worker = m.get("worker", {})
        print(f"injected tokens: {int(worker.get('injected_tokens', 0))}, injection time "
              f"{worker.get('injection_seconds', 0) * 1000:.1f} ms in all")
        print("KV answers differ from prompt injection where facts were encoded apart (each fact behind the "
              "instruction prefix only); jointly encoded memory gives identical answers (tests prove it).")
    finally:
        engine.shutdown()
    return 0


def bench(args) -> int:
    script = Path(__file__).resolve().parent.parent / "bench" / f"{args.name}.py"
    if not script.exists():
        print(f"no benchmark named {args.name!r} (looked for {script})", file=sys.stderr)
        return 2
    set_vllm_cpu_env()
    return subprocess.call([sys.executable, str(script), *args.rest])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferscale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="answer questions from two users' memories, KV injection vs prompt injection")
    p.add_argument("--model", default=None, help="local HF model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--k", type=int, default=3)
    p.set_defaults(fn=demo)
    p = sub.add_parser("bench", help="run a benchmark script from bench/ (encode, ttft, locomo, gpu)")
    p.add_argument("name")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=bench)
    try:
        from services import cli as service_cli  # serve / add / ask need the [serve] extra
    except ImportError:
        service_cli = None
    if service_cli is not None:
        service_cli.add_commands(sub)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
