"""What one streamed piece of an answer costs in CPU through Ray Serve, with no model: why an engine replica
gathers tokens into pieces (EngineReplicaConfig.stream_interval, services/engine_replica/answering.py).

An answer reaches a caller through two Serve streams: engine replica -> gateway (a deployment handle call with
stream=True) and gateway -> Serve's proxy. This runs the same shape on a local Ray: a `Source` deployment yields
AnswerPiece messages (services/messages.py), a `Middle` deployment re-yields them from its own handle stream, and
this driver reads them as the proxy would, `--concurrency` requests at a time. It reports the CPU seconds of the
whole process tree (driver, Ray's daemons, both replicas) per request, for answers of 1, 3 and 9 pieces (a 8-token
answer at stream_interval 1 is 8 pieces and the end; at 8 it is the first token, the other 7, the end), in
alternating rounds, and the cost of one piece from the differences. CPU seconds, on this machine's cores; lscpu
flags printed.

  python bench/stream_pieces.py                      # 300 requests per size and round, 2 rounds; ~1 min
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.cpu_ledger import CpuLedger  # noqa: E402 - the process tree's CPU between marks (bench/service.py's too)

SIZES = (9, 3, 1)  # pieces per answer


def build_app():
    from ray import serve

    from inferscale_server.messages import AnswerPiece

    @serve.deployment(max_ongoing_requests=256)
    class Source:
        async def answer(self, pieces: int):
            for i in range(pieces):
                await asyncio.sleep(0.002)  # a decode step apart
                yield AnswerPiece(f"token{i} ")

    @serve.deployment(max_ongoing_requests=256)
    class Middle:
        def __init__(self, source):
            self.source = source

        async def answer(self, pieces: int):
            async for piece in self.source.options(stream=True).answer.remote(pieces):
                yield piece

    return Middle.bind(Source.bind())


async def load(handle, pieces: int, requests: int, concurrency: int) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one():
        async with sem:
            got = 0
            async for _ in handle.options(stream=True).answer.remote(pieces):
                got += 1
            if got != pieces:
                raise RuntimeError(f"{got} pieces of {pieces}")

    await asyncio.gather(*(one() for _ in range(requests)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="requests per size and round")
    ap.add_argument("--concurrency", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    a = ap.parse_args(argv)

    import ray
    from ray import serve

    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = sorted({f for f in flags.split() if f.startswith(("avx512", "amx"))})
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        handle = serve.run(build_app(), name="stream-pieces", route_prefix=None)
        loop = asyncio.new_event_loop()
        loop.run_until_complete(load(handle, 3, 50, a.concurrency))  # warm: replicas, routers, connections
        per_request: dict[int, list[float]] = {n: [] for n in SIZES}
        ledger = CpuLedger()
        for _ in range(a.rounds):
            for n in SIZES:
                ledger.start()
                loop.run_until_complete(load(handle, n, a.requests, a.concurrency))
                per_request[n].append(sum(ledger.mark(f"{n} pieces").values()) / a.requests * 1000)
        serve.shutdown()
    finally:
        ray.shutdown()
    mean = {n: sum(v) / len(v) for n, v in per_request.items()}
    lines = [f"# Streamed pieces through two Serve hops ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"`python bench/stream_pieces.py --requests {a.requests} --concurrency {a.concurrency} --rounds "
             f"{a.rounds}`; {os.cpu_count()} cores; lscpu flags: {' '.join(keep) or 'none of avx512/amx'}; CPU of the "
             "driver, Ray and both replicas.", "",
             "| pieces per answer | CPU ms per request (each round) | mean |", "|---|---|---|"]
    for n in SIZES:
        lines.append(f"| {n} | {' / '.join(f'{x:.1f}' for x in per_request[n])} | {mean[n]:.1f} |")
    lines += ["", f"One piece: {(mean[9] - mean[3]) / 6:.2f} ms of CPU (9 against 3 pieces), "
                  f"{(mean[3] - mean[1]) / 2:.2f} ms (3 against 1)."]
    report = "\n".join(lines) + "\n"
    print(report)
    if a.out:
        a.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
