"""`inferscale serve | add | ask`: the Ray Serve application on this machine and its gRPC client.

    inferscale serve [--redis-url redis://127.0.0.1:6379/0]     # Ctrl-C stops it
    inferscale add alice "Alice adopted a grey cat named Pixel." "Alice lives in Lisbon."
    inferscale ask alice "What is my cat called?"

`serve` starts a local Ray, the four deployments at one replica each (services/app.py:single_node_deployments)
on the embedded default model (SmolLM2-135M-Instruct) unless --model names another, and prints the
addresses. Without --redis-url the registry lives in a Ray actor and is gone when `serve` stops; KV is
written to --kv-dir either way. Mounted by inferscale_core/cli.py.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from inferscale_core.vllm_env import vllm_cpu_env


def add_commands(sub) -> None:
    p = sub.add_parser("serve", help="run the InferScale service (Ray Serve, gRPC + HTTP) on this machine")
    p.add_argument("--redis-url", default=None, help="registry (default: in memory, lost when serve stops)")
    p.add_argument("--model", default=None, help="local HF model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--grpc-port", type=int, default=9000)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (gRPC listens on all addresses)")
    p.add_argument("--kv-dir", default=None, help="disk tier of the engine's fact store "
                                                  "(default: <inferscale cache>/kv)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may schedule on (default: all)")
    p.set_defaults(fn=serve_cmd)

    p = sub.add_parser("add", help="store facts for a user (gRPC)")
    p.add_argument("user")
    p.add_argument("facts", nargs="+")
    p.add_argument("--target", default="127.0.0.1:9000", help="gRPC address of the service")
    p.set_defaults(fn=add_cmd)

    p = sub.add_parser("ask", help="answer a question with the user's memory injected; streams the answer (gRPC)")
    p.add_argument("user")
    p.add_argument("question")
    p.add_argument("--k", type=int, default=0, help="facts to inject (0: the server's default)")
    p.add_argument("--max-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--mode", default="inject", choices=["inject", "prompt"],
                   help="inject: facts as KV; prompt: the Mem0 baseline, facts as text")
    p.add_argument("--target", default="127.0.0.1:9000", help="gRPC address of the service")
    p.set_defaults(fn=ask_cmd)


# ------------------------------------------------------------------------------------------ serve
def start(cfg, host: str = "127.0.0.1") -> None:
    """Serve's proxies and the application on the Ray this process is connected to."""
    from ray import serve
    from ray.serve.config import gRPCOptions

    from .app import APP_NAME, build_app, grpc_options

    serve.start(http_options={"host": host, "port": cfg.http_port}, grpc_options=gRPCOptions(**grpc_options(cfg)))
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/")


def serve_cmd(args) -> int:
    import ray

    from inferscale_core.models import cache_dir

    from .app import ServiceConfig, single_node_deployments

    cfg = ServiceConfig(model_path=args.model, registry_url=args.redis_url, dtype=args.dtype,
                        max_model_len=args.max_model_len, http_port=args.http_port, grpc_port=args.grpc_port,
                        kv_dir=args.kv_dir or str(cache_dir() / "kv"), deployments=single_node_deployments())
    os.environ.update(vllm_cpu_env())
    print(f"starting Ray and the InferScale app ({args.model or 'SmolLM2-135M-Instruct, embedded'}); "
          "the engine takes about a minute on a small CPU ...", flush=True)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": vllm_cpu_env()})  # for every Ray worker
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        t = time.monotonic()
        start(cfg, args.host)
        print(f"ready in {time.monotonic() - t:.0f} s\n"
              f"  gRPC  inferscale.v1.Memory   {args.host}:{cfg.grpc_port}\n"
              f"  HTTP  POST /v1/chat/completions   http://{args.host}:{cfg.http_port}\n"
              f"  registry  {cfg.registry_url or 'in memory (Ray actor; pass --redis-url to keep facts)'}\n"
              f"  KV disk tier  {cfg.kv_dir}\n"
              f"try: inferscale add alice \"Alice has a cat named Pixel.\" --target 127.0.0.1:{cfg.grpc_port}",
              flush=True)
        while not stop.wait(1):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        from ray import serve

        print("stopping ...", flush=True)
        serve.shutdown()
        ray.shutdown()
    return 0


# ------------------------------------------------------------------------------------------ client
def _client(target: str):
    from .client import MemoryClient

    return MemoryClient(target, timeout_s=300)


def _fail(err) -> int:
    print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
    return 1


def add_cmd(args) -> int:
    import grpc

    with _client(args.target) as c:
        try:
            facts = c.add_facts(args.user, args.facts)
        except grpc.RpcError as e:
            return _fail(e)
    for f in facts:
        print(f"{f.fact_id}  {f.text}")
    return 0


def ask_cmd(args, out=None) -> int:
    import grpc

    out = out or sys.stdout
    t0 = time.perf_counter()
    with _client(args.target) as c:
        try:
            for chunk in c.answer(args.user, args.question, k=args.k, max_tokens=args.max_tokens,
                                  temperature=args.temperature, mode=args.mode):
                if chunk.text:
                    out.write(chunk.text)
                    out.flush()
                if chunk.final:
                    total = (time.perf_counter() - t0) * 1000
                    out.write(f"\n\nTTFT {chunk.ttft_ms:.1f} ms (engine), {total:.0f} ms in all; "
                              f"prompt {chunk.prompt_tokens} tokens, {chunk.prefilled_tokens} prefilled\n"
                              f"facts ({args.mode}): {', '.join(chunk.fact_ids) or 'none'}\n")
        except grpc.RpcError as e:
            return _fail(e)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m services.cli ...` (the same commands as `inferscale ...`)."""
    parser = argparse.ArgumentParser(prog="python -m services.cli", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
