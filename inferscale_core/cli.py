"""`inferscale` command line: demo (the main job on the embedded default model), serve / token (the Ray Serve
application, services/cli.py), add / ask / list / search / get / update / delete / status (its gRPC client,
inferscale_client/cli.py), bench (the benchmark scripts)."""
from __future__ import annotations

import argparse
import functools
import os
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
            "Bob's dog is a golden retriever named Pixel.",
            "Bob is allergic to peanuts.",
            "Bob moved from Toronto to Seattle two years ago."],
}
# (user, question, the word a right answer contains). The questions name the user: a 135M model does not map
# "my cat" onto "Alice's cat" reliably, with prompt injection or without.
DEMO_QUESTIONS = [("alice", "What is the name of Alice's cat?", "Miso"),
                  ("alice", "Which marathon is Alice training for?", "Berlin"),
                  ("alice", "Where does Alice's sister live?", "Lisbon"),
                  ("bob", "What is the name of Bob's dog?", "Pixel"),
                  ("bob", "What is the name of Bob's band?", "Blue Hour"),
                  ("bob", "Which city did Bob move from?", "Toronto")]


def engine_output_to(log_path: Path):
    """From now on, everything this process and its children write to stdout/stderr (vLLM's and torch's
    INFO/WARNING lines, C++ and OpenMP messages, the engine's shutdown and exit-time lines: the file descriptors
    themselves are redirected) goes to `log_path`. Returns a text stream on the original stdout for the caller's
    own lines. For a command that exits when its work is done: nothing is restored."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    with open(log_path, "wb") as log:  # the last run's log
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    return out


def demo(args) -> int:
    """Two users' facts encoded once, each question answered with KV injection and with prompt injection on the
    same vLLM engine, at the shipped default setting (inferscale_core/defaults.py); prints both answers, whether
    they agree and are right, their latency and where vLLM got the memory tokens from. Exits 1 if KV injection
    answers a question wrongly where prompt injection answers it right. The engine's own log lines go to
    --log-file (default <inferscale cache>/demo.log), so the terminal shows only the demo."""
    if args.log_file == "-":
        return _demo(args, sys.stdout)
    log_path = Path(args.log_file) if args.log_file else demo_log_path()
    print(f"demo: the engine's log goes to {log_path}", flush=True)
    out = engine_output_to(log_path)
    try:
        return _demo(args, out)
    except BaseException:
        out.write(f"demo failed; the error and the engine's log are in {log_path}\n")
        raise


def demo_log_path() -> Path:
    from .cache import cache_dir

    return cache_dir() / "demo.log"


def _demo(args, out) -> int:
    say = functools.partial(print, file=out, flush=True)  # the demo's own lines, on the terminal
    set_vllm_cpu_env()
    import torch

    from .defaults import NEIGHBOUR_WINDOW, default_windows, serving_store_options
    from .engine import InjectingEngine
    from .types import Mode
    from .vllm_setup import default_sampling

    dtype = getattr(torch, args.dtype)
    options = serving_store_options({} if args.recompute_tokens is None
                                    else {"recompute_tokens": args.recompute_tokens})
    w = NEIGHBOUR_WINDOW
    say(f"loading {args.model or 'SmolLM2-135M-Instruct (embedded default)'} on vLLM ({args.dtype}, CPU), "
          f"neighbour window={w}, recompute_tokens={options['recompute_tokens']}, "
          f"recompute_facts={options['recompute_facts']} (memories of up to "
          f"{options['recompute_facts_max_k'] or 'any'} facts) ...")
    engine = InjectingEngine(model_path=args.model, dtype=dtype, store_options=options)
    sampling = default_sampling(max_tokens=24)
    kv_wrong_pi_right = []
    try:
        for user, facts in DEMO_FACTS.items():
            t = time.perf_counter()
            engine.add(user, facts, default_windows(facts, w=w), ws=(w,))  # as the service adds them
            say(f"{user}: {len(facts)} facts encoded once in {time.perf_counter() - t:.2f} s")
        for mode in Mode:  # first requests pay one-off kernel set-up; keep it out of the timings
            engine.generate("alice", "Hello!", k=args.k, w=w, mode=mode, sampling_params=sampling)
        for user, question, expected in DEMO_QUESTIONS:
            say(f"\n[{user}] {question}  (expected: {expected})")
            right = {}
            texts = {}
            for mode in Mode:
                t = time.perf_counter()
                ans = engine.generate(user, question, k=args.k, w=w, mode=mode, sampling_params=sampling)
                took = time.perf_counter() - t
                texts[mode] = ans.text.strip()
                right[mode] = expected.lower() in texts[mode].lower()
                label = "KV injection    " if mode == "kv" else "prompt injection"
                say(f"  {label} {took * 1000:7.1f} ms  prompt {ans.prompt_len} tok, "
                      f"not prefilled {ans.num_cached_tokens}, {'right' if right[mode] else 'WRONG'}: "
                      f"{texts[mode]!r}")
            same = "identical answers" if texts[Mode.KV] == texts[Mode.PI] else "different words"
            verdict = ("KV and PI agree" if right[Mode.KV] == right[Mode.PI] else
                       "KV right where PI is wrong" if right[Mode.KV] else "KV WRONG where PI is right")
            say(f"  -> {verdict} ({same})")
            if right[Mode.PI] and not right[Mode.KV]:
                kv_wrong_pi_right.append(question)
        m = engine.metrics()
        by_source = {k.removeprefix("prompt_tokens_"): int(v) for k, v in m.items() if k.startswith("prompt_tokens_")}
        say(f"\nprompt tokens by source (vLLM counters, both modes): {by_source}")
        worker = m.get("worker", {})
        say(f"injected tokens: {int(worker.get('injected_tokens', 0))}, injection time "
              f"{worker.get('injection_seconds', 0) * 1000:.1f} ms in all")
    finally:
        engine.shutdown()
    n = len(DEMO_QUESTIONS)
    if kv_wrong_pi_right:
        say(f"\nFAILED: KV injection answered {len(kv_wrong_pi_right)} of {n} questions wrongly where prompt "
              f"injection was right: {kv_wrong_pi_right}")
        return 1
    say(f"\nOK: on all {n} questions KV injection is right wherever prompt injection is right.")
    return 0


# The benchmark scripts live in the repository's bench/, beside this package in a checkout; a wheel does not carry
# them (nor the test fixtures and reference code they import).
BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


def bench(args) -> int:
    if not BENCH_DIR.is_dir():
        print("inferscale bench runs the benchmark scripts of a source checkout (bench/), which an installed wheel "
              "does not carry: clone the repository, `pip install -e '.[serve,bench]'` there and run "
              f"`inferscale bench {args.name}` from it", file=sys.stderr)
        return 2
    script = BENCH_DIR / f"{args.name}.py"
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
    p.add_argument("--recompute-tokens", type=int, default=None,
                   help="memory tokens vLLM computes with the query instead of injecting them "
                        "(default: the shipped default in inferscale_core/defaults.py)")
    p.add_argument("--log-file", default=None,
                   help="where the engine's INFO/WARNING lines go (default: <inferscale cache>/demo.log; "
                        "'-': the terminal)")
    p.set_defaults(fn=demo)
    p = sub.add_parser("bench", help="run a benchmark script from bench/ (encode, ttft, locomo, gpu): in a source "
                                     "checkout only")
    p.add_argument("name")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=bench)
    try:
        from inferscale_server import cli as service_cli  # serve / add / ask need the [serve] extra
    except ImportError:
        pass
    else:
        service_cli.add_commands(sub)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
