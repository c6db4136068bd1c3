"""What a filtered listing costs the gateway (issue 31): the CPU of a scan (a fact read from Redis and matched against
a filter) as a function of the facts scanned and the filter's size, against the CPU of one token the model forwards
(a work unit, services/gateway/work_budget.py): the measurement behind the work budget's scan weights.

A real redis-server (bench/local_redis.py, as the unit tests start it), a RedisRegistry and a GatewayCore in
registry-only mode behind the real Mem0 HTTP app (services/gateway/mem0_http.py, called in this process through
httpx's ASGI transport, HS256 auth on), so the code paths are the gateway's own. Facts are stored with a 384-float
embedding and metadata at the Mem0 door's limits (32 entries: `agent_id`, `n`, `note` a 1,000-character text,
`tags` a list of 255 empty strings, 28 keys `k0`..`k27` = "v"): the heaviest facts a caller may store to match.

Filters, each at the size limits (services/filters.py: MAX_NODES keys and list items, MAX_FILTER_BYTES characters):

  eq-1                   {"agent_id": "bot"}                                  1 condition
  in-254                 {"n": {"in": [0..253]}}                     256 nodes, 2 conditions (a set lookup per fact)
  and-255-eq             {"AND": [{"k<i%28>": "v"}] x 255}           256 conditions, all true: every one evaluated
  or-255-eq              {"OR": [{"k<i%28>": "no"}] x 255}           256 conditions, all false: every one evaluated
  or-127-icontains-text  {"OR": [{"note": {"icontains": "zz<i>"}}] x 127}   255 conditions, 127 text ones on
                         a 1,000-character value
  or-127-icontains-list  {"OR": [{"tags": {"icontains": "zz<i>"}}] x 127}   255 conditions, 127 text ones, each a
                         walk of a 255-item list (the worst a text condition costs: a Python loop per item)

Measured, each with time.process_time (this process: the door, the registry client, the matching; all threads) and
Redis's own used_cpu_user+sys (INFO cpu) for the server:
  compile     compile_filter(filter) alone, per call
  match       the compiled predicate over facts already read, per fact
  read        registry.list 1,000 at a time (the scan of get_all and filtered deletes), per fact: this process and Redis
  request     POST /v3/memories/ (Mem0's get_all) with the filter over a user of N facts: the median of --reps
              requests, this process and Redis together; and the least-squares slope over N (0 and --facts) per fact
The unit: --token-ms, the CPU (ms of one core) of one token the model forwards; with --measure-token, measured
here as SmolLM2-135M fp32 prefill of 256 tokens on one thread (transformers; loads the model: a heavy job).

    python bench/filter_cost.py --facts 100,1000 --out bench/results/filter_cost.md
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

META_KEYS = 28  # k0..k27, beside agent_id, n, note and tags: the door's 32 metadata entries
NOTE = ("The caller's longest metadata value: a note of a thousand characters that a filter may scan. " * 12)[:1000]
TAGS = [""] * 255  # 1,020 characters of JSON, within the door's 1,024: the longest list a text condition may walk


def filters_at_the_limits() -> dict[str, dict]:
    return {
        "eq-1": {"agent_id": "bot"},
        "in-254": {"n": {"in": list(range(254))}},
        "and-255-eq": {"AND": [{f"k{i % META_KEYS}": "v"} for i in range(255)]},
        "or-255-eq": {"OR": [{f"k{i % META_KEYS}": "no"} for i in range(255)]},
        "or-127-icontains-text": {"OR": [{"note": {"icontains": f"zz{i}"}} for i in range(127)]},
        "or-127-icontains-list": {"OR": [{"tags": {"icontains": f"zz{i}"}} for i in range(127)]},
    }


def metadata(i: int) -> dict:
    return {"agent_id": "bot", "n": i, "note": NOTE, "tags": TAGS, **{f"k{j}": "v" for j in range(META_KEYS)}}


def fill(reg, uid: str, n: int, rng: np.random.Generator) -> None:
    from inferscale_server.registry import NewFact

    for start in range(0, n, 200):
        batch = []
        for i in range(start, min(n, start + 200)):
            emb = rng.standard_normal(384).astype(np.float32)
            batch.append(NewFact(f"Fact {i} of the scanned user: a sentence about the weather, tea and a bicycle.",
                                 metadata(i), embedding=emb / np.linalg.norm(emb)))
        reg.create(uid, batch)


def redis_cpu(client) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


@contextlib.contextmanager
def cpu(client=None):
    """Yields a dict that holds, on exit, this process's CPU seconds ('here') and Redis's ('redis')."""
    out: dict = {}
    r0, t0 = (redis_cpu(client) if client is not None else 0.0), time.process_time()
    yield out
    out["here"] = time.process_time() - t0
    out["redis"] = (redis_cpu(client) - r0) if client is not None else 0.0


def token_ms_measured() -> float:
    """ms of one core per token: SmolLM2-135M fp32 prefill of 256 tokens, one thread, median of 5 (after 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    from inferscale_core.models import default_model_path

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), torch_dtype=torch.float32).eval()
    ids = torch.randint(100, 10_000, (1, 256))
    times = []
    with torch.inference_mode():
        for _ in range(6):
            t0 = time.process_time()
            model(ids)
            times.append(time.process_time() - t0)
    return statistics.median(times[1:]) / 256 * 1000


async def door_requests(app, token: str, flt: dict | None, reps: int) -> None:
    import httpx

    body = {"filters": flt} if flt is not None else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        for _ in range(reps):
            r = await client.post("/v3/memories/", json=body, headers={"authorization": f"Token {token}"})
            if r.status_code != 200:
                raise RuntimeError(f"the listing answered {r.status_code}: {r.text[:300]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--facts", default="100,1000", help="users' sizes, comma-separated (default 100,1000)")
    ap.add_argument("--reps", type=int, default=5, help="requests per (filter, size) (default 5)")
    ap.add_argument("--token-ms", type=float, default=7.8,
                    help="ms of one core per model token (default 7.8: ~256 tokens/s forwarded on the reference "
                         "node's 2 cores, docs/security.md)")
    ap.add_argument("--measure-token", action="store_true", help="measure it: SmolLM2-135M fp32 prefill, 1 thread")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sizes = [int(s) for s in args.facts.split(",") if s]
    if not sizes or min(sizes) < 1 or max(sizes) > 100_000 or args.reps < 1:
        ap.error("--facts: sizes in 1..100000; --reps >= 1")

    import redis

    from bench.local_redis import local_redis_server
    from bench.service import cpu_description, cpu_line
    from inferscale_server import filters
    from inferscale_server.auth import AuthConfig, Authenticator, mint
    from inferscale_server.gateway import GatewayCore, build_http_app
    from inferscale_server.limits import Limits
    from inferscale_server.registry import RedisRegistry

    token_ms = token_ms_measured() if args.measure_token else args.token_ms
    shapes = filters_at_the_limits()
    rng = np.random.default_rng(0)
    lines = [f"# Filter cost on the gateway ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"CPU: {cpu_line(cpu_description())}.",
             f"Command: `python bench/filter_cost.py --facts {args.facts} --reps {args.reps}"
             f"{' --measure-token' if args.measure_token else f' --token-ms {args.token_ms:g}'}`", "",
             f"One work unit = one model token = {token_ms:.2f} ms of one core"
             f" ({'measured: SmolLM2-135M fp32 prefill of 256 tokens, 1 thread' if args.measure_token else 'given'}).",
             ""]
    with tempfile.TemporaryDirectory(prefix="filtercost-") as tmp, local_redis_server() as url:
        secret = uuid.uuid4().hex.encode()
        (Path(tmp) / "secret").write_bytes(secret)
        reg = RedisRegistry(url, prefix=f"fc{uuid.uuid4().hex[:6]}:")
        raw = redis.Redis.from_url(url)
        # a budget nobody reaches: this measures what a scan costs, not what the budget refuses (the users of
        # several sizes, one after the other, would put each other in debt and be refused under the weights)
        core = GatewayCore(reg, limits=Limits(work_units_per_s_per_caller=1e9, work_burst_per_caller=1e12),
                           auth=Authenticator(AuthConfig(hs256_secret_file=str(Path(tmp) / "secret"))))
        app = build_http_app(lambda: core)
        users = {n: f"scanned-{n}" for n in sizes}
        empty = "scanned-0"
        for n, uid in users.items():
            fill(reg, uid, n, rng)
        biggest = users[max(sizes)]
        recs = []
        offset: int | None = 0
        while offset is not None:
            page, offset = reg.list(biggest, offset, 1000)
            recs += page

        # read: the scan's registry reads, per fact
        with cpu(raw) as read:
            for _ in range(args.reps):
                offset = 0
                while offset is not None:
                    _, offset = reg.list(biggest, offset, 1000)
        read_here = read["here"] / (args.reps * len(recs)) * 1e6
        read_redis = read["redis"] / (args.reps * len(recs)) * 1e6
        lines += [f"Registry read (`registry.list`, 1,000 a page) of facts with an embedding and 32 metadata entries: "
                  f"{read_here:.1f} us here + {read_redis:.1f} us in Redis = "
                  f"{read_here + read_redis:.1f} us of CPU a fact.", "",
                  "| filter | conditions / text | compile us | match us/fact | request N=0 ms | "
                  + " | ".join(f"request N={n:,} ms" for n in sizes)
                  + " | request us/fact (fit) | units/fact measured | facts per unit |",
                  "|---|---|---|---|---|" + "---|" * len(sizes) + "---|---|---|"]

        def per_request(uid: str, flt: dict | None) -> float:
            """The median over --reps requests of this process's and Redis's CPU, in ms."""
            token = mint(secret, uid)
            asyncio.run(door_requests(app, token, flt, 1))  # a first call: imports, caches
            each = []
            for _ in range(args.reps):
                with cpu(raw) as c:
                    asyncio.run(door_requests(app, token, flt, 1))
                each.append(c["here"] + c["redis"])
            return statistics.median(each) * 1000

        for name, flt in {"none (a page of 100)": None, **shapes}.items():
            shape = "-"
            compile_us = match_us = float("nan")
            if flt is not None:
                t0 = time.process_time()
                for _ in range(200):
                    match = filters.compile_filter(flt, "x")
                compile_us = (time.process_time() - t0) / 200 * 1e6
                assert match is not None
                shape = f"{match.conditions} / {match.text_conditions}"
                t0 = time.process_time()
                for _ in range(args.reps):
                    for r in recs:
                        match(r)
                match_us = (time.process_time() - t0) / (args.reps * len(recs)) * 1e6
            ms = {0: per_request(empty, flt), **{n: per_request(users[n], flt) for n in sizes}}
            slope = np.polyfit(list(ms), [ms[n] for n in ms], 1)[0] * 1000  # us a fact
            units = slope / 1000 / token_ms
            lines.append(f"| {name} | {shape} | {compile_us:,.0f} | {match_us:.2f} | {ms[0]:.2f} | "
                         + " | ".join(f"{ms[n]:,.1f}" for n in sizes)
                         + f" | {slope:.1f} | {units:.4f} | {1 / units:.0f} |")
        reg.close()
        raw.close()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
