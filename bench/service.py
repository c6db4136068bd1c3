"""The service under concurrent load, through its real front doors, against the engine alone on the same requests.

1. Starts the application as `inferscale serve` runs it (local Ray on 127.0.0.1, Serve's proxies on 127.0.0.1,
   one replica of each deployment unless told otherwise, the packaged SmolLM2, --dtype float32, a redis-server
   started here on a free loopback port; `--registry cluster` a 3-master Redis Cluster started here on loopback
   instead, the app given one node's URL as `--redis-url` would be; `--registry embedded` the in-memory Ray-actor
   registry), or targets a running one (`--target 127.0.0.1:GRPC,HTTP` with `--jwt-secret-file` or an admin `--token`).
2. Gives each simulated user its own memory: ~60 LoCoMo observation facts (a window over the conversations'
   sessions, a different window per user; `--data`, default ../shared/data/locomo_dev.json; `--quick` uses the
   repository's synthetic tests/fixtures/locomo_mini.json), and questions of the same conversations.
3. Drives it with clients the project did not write, in an interpreter of their own (bench/service_client.py):
   gRPC with stubs compiled from protos/inferscale/v1/memory.proto by grpcio-tools into a temporary folder at
   run time, HTTP with the official `openai` package; streamed answers, 8 tokens, greedy. N users at once, each
   asking its questions one after another; KV injection (mode inject) and prompt injection (mode prompt) side
   by side, k = 5 and 50. Per request: client time to first chunk, total time, the engine TTFT of the final
   chunk (ttft_ms), the per-hop timings_ms when the service sends them, the status code.
4. Shuts the service down and replays the gRPC cells' requests straight on AsyncInjectingEngine in this process
   (same model, dtype, block size, context and store options as an engine replica; the same prompts: the
   facts each service answer injected, in its order, as the same KV bytes, read from the service engine's disk
   tier, or encoded here as the encoder pool does when the service is not ours); same concurrency; at niceness
   15, the niceness Ray gives the service's replicas (on a shared machine both sides get the same share).
5. Prints and writes (bench/results/service_<tag>.json/.md/.png) the tables and issue 12's ratios with
   met/missed and margins, and each cell's CPU per answered request split by the service's parts (each
   deployment, Serve's proxy, Ray, the stores, the client; bench/cpu_ledger.py; in brackets the share of vLLM's
   engine core processes) next to the engine alone's.
   lscpu's model and flags, the load average and the registry that ran (with the keys each of its servers held
   when the service stopped) are in every output.

Usage:
  python bench/service.py --quick                      # N = 1, 2; k = 8; both modes, both doors; < 5 min
  python bench/service.py --tag full                   # N = 1, 10, 25, 50, 100; k = 5, 50 (gRPC; HTTP at N = 1, 100)
  python bench/service.py --registry cluster --retrieval-replicas 2 --tag cluster   # issue 32's registry and retrieval
  python bench/service.py --target 127.0.0.1:9000,8000 --jwt-secret-file ~/.cache/inferscale/dev-jwt-secret

A request the service sheds (RESOURCE_EXHAUSTED / HTTP 429) is a failure unless --retry-overload N lets the client
ask again 1 s later. Exit status 1 when a request failed or a ratio could not be computed (results are written
first).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.cpu_ledger import CpuLedger  # noqa: E402
from inferscale_core.vllm_env import serving_kv_cache_gib, set_vllm_cpu_env, vllm_cpu_env  # noqa: E402
from inferscale_server.messages import DEFAULT_STREAM_INTERVAL  # noqa: E402

# before vLLM is imported: the engine replicas' settings as `inferscale serve` gives them (services/cli.py), KV cache
# sized from the machine unless $VLLM_CPU_KVCACHE_SPACE says otherwise
set_vllm_cpu_env(serving_kv_cache_gib())

MODES = ("inject", "prompt")               # the wire names (AnswerRequest.mode, inferscale_mode)
FULL = {"users": (1, 10, 25, 50, 100), "ks": (5, 50), "http_users": (1, 100), "facts": 60, "requests_n1": 10,
        "requests_per_user": 2}
# Quick (the tests): N = 1 and 2, 12 facts a user, k=8, 2 requests at N=1 and 1 per user at N=2. What the test
# checks needs only that every cell, door and mode runs with more than one request, at one N and at a larger one
# with users answered at once; each user added and each request asked is seconds of a 2-core machine (N = 1, 4
# with 2 requests per user: 48 facts and 40 service requests, about 30 s more of the test's setup). k stays
# below the facts a user has, so questions pick different facts and the engine's prefix cache does not answer
# a prompt-injection cell from an earlier one.
QUICK = {"users": (1, 2), "ks": (8,), "http_users": (1, 2), "facts": 12, "requests_n1": 2, "requests_per_user": 1}
FIXTURE = REPO / "tests" / "fixtures" / "locomo_mini.json"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
# Issue 12, item 2 (ratios measured in one run).
TARGET_FIRST_CHUNK = {"low": 1.5, "high": 2.0}  # client first chunk / engine TTFT at the smallest / largest N
TARGET_THROUGHPUT = 0.9                          # service req/s / engine-level req/s at the largest N
TARGET_KV_PI_SLACK = 0.9                         # service KV/PI >= engine-level KV/PI x 0.9 ("minus 10%")
NO_SERVICE_PROMPT = "NO_SERVICE_PROMPT"          # engine replay of a request the service failed: nothing to replay
REGISTRIES = ("redis", "cluster", "embedded")
CLUSTER_MASTERS = 3  # --registry cluster: Redis Cluster's smallest (3 masters, no replicas: no failover is measured)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="N = 1, 2; one k (8); 12 facts a user; few requests; the fixture data")
    ap.add_argument("--data", type=Path, default=None,
                    help="LoCoMo-format JSON (default: ../shared/data/locomo_dev.json; --quick: the fixture)")
    ap.add_argument("--users", default=None, help="comma-separated concurrent users (default 1,10,25,50,100)")
    ap.add_argument("--ks", default=None, help="comma-separated k (default 5,50)")
    ap.add_argument("--http-users", default=None, help="the N that also run through HTTP (default 1,100)")
    ap.add_argument("--modes", default=",".join(MODES), help="inject,prompt")
    ap.add_argument("--facts-per-user", type=int, default=None, help="facts in each user's memory (default 60)")
    ap.add_argument("--requests-n1", type=int, default=None, help="requests of the single user at N=1 (default 10)")
    ap.add_argument("--requests-per-user", type=int, default=None, help="requests per user at N>1 (default 2)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--model", default=None, help="HF model folder (default: the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's own context (8,192: k=200 fits)")
    ap.add_argument("--engine-replicas", type=int, default=1, help="EngineReplica replicas (fixed)")
    ap.add_argument("--engine-cpu-cores", type=int, default=None,
                    help="cores each engine replica's vLLM binds to (ServiceConfig.engine_cpu_cores; 0: all, "
                         "shared); default: the usable cores / --engine-replicas when there are several, else 0")
    ap.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE",
                    help="a services/limits.py Limits field for the own app (repeatable; default: the shipped ones)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                    help="a vLLM engine argument for the own app's engine replicas and the engine-level phase alike "
                         "(ServiceConfig.engine_overrides; VALUE read as JSON, else a string; repeatable)")
    ap.add_argument("--serve-defaults", action="store_true",
                    help="Serve's own request path (threads for user code and routers, access log to stderr) and "
                         "control loop (0.1 s) instead of the shipped ones (services/app.py SERVE_REQUEST_PATH_ENV, "
                         "SERVE_CONTROL_LOOP_ENV): a before/after")
    ap.add_argument("--stream-interval", type=int, default=DEFAULT_STREAM_INTERVAL,
                    help="tokens an answer's piece gathers after the first (ServiceConfig.stream_interval; 1: every "
                         f"token its own piece; default {DEFAULT_STREAM_INTERVAL}, the service's)")
    ap.add_argument("--query-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the dtype retrieval embeds a query in (ServiceConfig.query_dtype; default auto, the service's)")
    ap.add_argument("--max-replicas", type=int, default=1,
                    help="Gateway/Retrieval/EncoderPool autoscale from 1 to this (replica counts are recorded)")
    ap.add_argument("--retrieval-replicas", type=int, default=None,
                    help="Retrieval replicas (fixed, as --engine-replicas; default: autoscaled 1..--max-replicas)")
    ap.add_argument("--cluster-tier", action="store_true",
                    help="a Mooncake Store on loopback as the cluster KV tier (mooncake_master + one segment of "
                         "--segment-gib), as `inferscale serve --mooncake-master` uses one")
    ap.add_argument("--segment-gib", type=float, default=2.0, help="--cluster-tier: the segment's size")
    ap.add_argument("--registry", default="redis", choices=REGISTRIES,
                    help="redis: a redis-server started here on a free loopback port; cluster: a Redis Cluster of "
                         f"{CLUSTER_MASTERS} masters started here on free loopback ports (the app given the first's "
                         "URL); embedded: the Ray-actor registry")
    ap.add_argument("--target", default=None, help="a running service instead: HOST:GRPC_PORT,HTTP_PORT (loopback)")
    ap.add_argument("--jwt-secret-file", type=Path, default=None, help="--target: HS256 secret to sign user tokens")
    ap.add_argument("--token", default=None, help="--target: one token with the memory:admin scope for all users")
    ap.add_argument("--skip-engine", action="store_true", help="no engine-level phase (no ratios)")
    ap.add_argument("--settle-s", type=float, default=10.0,
                    help="seconds between the last add and the load: an engine replica warms the facts written for "
                         "the users it serves in its background (a few seconds behind the writes); 0: none")
    ap.add_argument("--engine-niceness", type=int, default=15,
                    help="niceness of the engine-level phase (default 15: what Ray gives the service's replicas)")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--retry-overload", type=int, default=0,
                    help="times a client asks again, 1 s later, when the service sheds its request "
                         "(RESOURCE_EXHAUSTED / HTTP 429); 0: a shed request is a failure (default)")
    ap.add_argument("--deadline-min", type=float, default=None, help="whole-run deadline (default 60; quick 25)")
    ap.add_argument("--tag", default=None, help="results name: service_<tag>.* (default quick / full)")
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)
    base = QUICK if args.quick else FULL
    ints = lambda s, d: tuple(int(x) for x in s.split(",")) if s else d  # noqa: E731
    args.user_counts = tuple(sorted(set(ints(args.users, base["users"]))))
    args.k_values = tuple(sorted(set(ints(args.ks, base["ks"]))))
    args.http_counts = tuple(n for n in ints(args.http_users, base["http_users"]) if n in args.user_counts)
    args.mode_list = tuple(m.strip() for m in args.modes.split(","))
    args.facts_per_user = args.facts_per_user or base["facts"]
    args.requests_n1 = args.requests_n1 or base["requests_n1"]
    args.requests_per_user = args.requests_per_user or base["requests_per_user"]
    args.tag = args.tag or ("quick" if args.quick else "full")
    args.deadline_min = args.deadline_min or (25.0 if args.quick else 60.0)
    problems = []
    if not args.user_counts or min(args.user_counts) < 1:
        problems.append("--users must be positive integers")
    if not args.k_values or not all(1 <= k <= 200 for k in args.k_values):
        problems.append("--ks must be in 1..200 (the API's k)")
    if not set(args.mode_list) <= set(MODES) or not args.mode_list:
        problems.append(f"--modes must be a subset of {','.join(MODES)}")
    for name in ("engine_replicas", "max_replicas", "retrieval_replicas"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be at least 1")
    if args.facts_per_user < max(args.k_values, default=1):
        problems.append(f"--facts-per-user {args.facts_per_user} is below the largest k {max(args.k_values)}")
    if args.target:
        try:
            host, ports = args.target.rsplit(":", 1)
            args.grpc_port, args.http_port = (int(p) for p in ports.split(","))
        except ValueError:
            problems.append(f"--target must be HOST:GRPC_PORT,HTTP_PORT, got {args.target!r}")
        else:
            if host not in ("127.0.0.1", "localhost"):
                problems.append("--target must be on this machine's loopback (127.0.0.1): load stays local")
        if args.registry != "redis" or args.retrieval_replicas is not None:
            problems.append("--registry and --retrieval-replicas set up our own app: not with --target")
        if bool(args.jwt_secret_file) == bool(args.token):
            problems.append("--target needs exactly one of --jwt-secret-file or --token")
        if args.jwt_secret_file and not args.jwt_secret_file.is_file():
            problems.append(f"--jwt-secret-file {args.jwt_secret_file} does not exist")
    if args.data is None:
        from bench.eval.locomo import default_data_path

        args.data = FIXTURE if args.quick else default_data_path()
    if args.data is None or not Path(args.data).is_file():
        problems.append(f"LoCoMo data not found ({args.data or '../shared/data/locomo_dev.json'}): pass --data PATH "
                        "(or --quick for the repository's fixture)")
    if problems:
        ap.error("; ".join(problems))
    return args


# ------------------------------------------------------------------------------------------ machine
def cpu_description() -> dict:
    """lscpu's model name and the flags that decide CPU inference speed."""
    model, flags = "unknown CPU", set()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("model name",) and model == "unknown CPU":
            model = value.strip()
        if key.strip().lower() == "flags":
            flags = set(value.split())
    return {"model": model, "cores": os.cpu_count(), "flags": {f: f in flags for f in CPU_FLAGS}}


def cpu_line(cpu: dict) -> str:
    have = [f for f, ok in cpu["flags"].items() if ok] or ["none of " + ", ".join(CPU_FLAGS)]
    return f"{cpu['model']}, {cpu['cores']} cores; flags: {' '.join(have)}"


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


# ------------------------------------------------------------------------------------------ users
@dataclass
class BenchUser:
    user_id: str
    facts: list[str]
    questions: list[str]
    source: str                      # which conversations/sessions the facts come from (no LoCoMo text)
    fact_ids: list[str] = field(default_factory=list)
    next_question: int = 0

    def take_questions(self, n: int) -> list[tuple[int, str]]:
        """The next n questions (index, text); cycles when the pool is used up."""
        out = [(i % len(self.questions), self.questions[i % len(self.questions)])
               for i in range(self.next_question, self.next_question + n)]
        self.next_question += n
        return out


def make_users(data: Path, n_users: int, facts_per_user: int, prefix: str) -> list[BenchUser]:
    """User i's memory: `facts_per_user` consecutive facts (by conversation, then session) starting at
    i/n of the way through all facts, so users hold different sessions' facts (windows overlap only when the
    data has fewer than n x facts_per_user facts); its questions: those of the conversations it covers."""
    from bench.eval.locomo import answerable, load_locomo

    convs = load_locomo(data)
    pool = [(c, f) for c in convs for f in c.facts]
    if not pool:
        raise SystemExit(f"{data} has no observation facts")
    users = []
    for i in range(n_users):
        start = i * len(pool) // n_users
        window = [pool[(start + j) % len(pool)] for j in range(min(facts_per_user, len(pool)))]
        conv_ids = list(dict.fromkeys(c.sample_id for c, _ in window))
        by_id = {c.sample_id: c for c in convs}
        questions = list(dict.fromkeys(q.question for cid in conv_ids for q in answerable(by_id[cid].questions)))
        if not questions:
            questions = list(dict.fromkeys(q.question for c in convs for q in answerable(c.questions)))
        rot = (7 * i) % len(questions)  # users of one conversation start at different questions
        sessions = sorted({(c.sample_id, f.session) for c, f in window})
        users.append(BenchUser(f"{prefix}-{i:03d}", [f.render(with_date=False) for _, f in window],
                               questions[rot:] + questions[:rot],
                               f"{len(window)} facts of {', '.join(conv_ids)} (sessions "
                               f"{sessions[0][1]}..{sessions[-1][1]})"))
    return users


# ------------------------------------------------------------------------------------------ plan
@dataclass
class Cell:
    id: str
    door: str            # "grpc" | "http" | "engine"
    users: int
    mode: str            # wire name
    k: int
    plan: list[dict] = field(default_factory=list)  # per user: user_id, token, questions [(index, text)]


def users_needed(args) -> int:
    """Users with facts: the largest N, and one more for the N=1 cells when larger N run too. The single user of N=1
    asks 10 questions per cell back to back, prompt injection's ~1,100-token prefills included: at the service's
    per-caller work budget (services/gateway/work_budget.py) it ends them in debt for the engine, and was refused
    at N=100 while the others asked (3 requests, bench/results/service_n1_n100_k50_2replicas_bf16.md): the budget
    working as designed, on a user the benchmark had made heavy. So N=1 has a user of its own, never in a larger N."""
    n = max(args.user_counts)
    return n + 1 if n > 1 and 1 in args.user_counts else n


def single_user(args, users: list[BenchUser]) -> BenchUser:
    """The user of the N=1 cells and of the warm-up: the extra one users_needed adds, else the first."""
    return users[-1] if len(users) > max(args.user_counts) else users[0]


def make_cells(args, users: list[BenchUser], tokens: dict[str, str]) -> list[Cell]:
    """Service cells in run order: by N, then k, then mode (KV and PI side by side), gRPC then HTTP. Every
    request of a user asks a question that user has not asked yet (until its pool runs out), so no cell is
    answered from vLLM's prefix cache of an earlier cell."""
    cells = []
    # The smallest and largest N first (the targets need them), then the others, so that a run stopped by its
    # deadline still has what the ratios need.
    order = [min(args.user_counts), max(args.user_counts)]
    for n in list(dict.fromkeys(order + list(args.user_counts))):
        per_user = args.requests_n1 if n == 1 else args.requests_per_user
        for k in args.k_values:
            for mode in args.mode_list:
                for door in ("grpc", "http") if n in args.http_counts else ("grpc",):
                    cell = Cell(f"{door}-n{n}-{mode}-k{k}", door, n, mode, k)
                    for u in [single_user(args, users)] if n == 1 else users[:n]:
                        cell.plan.append({"user_id": u.user_id, "token": tokens[u.user_id],
                                          "questions": u.take_questions(per_user)})
                    cells.append(cell)
    return cells


# ------------------------------------------------------------------------------------------ the service
@dataclass
class RegistryRun:
    """The registry the app was given: what ran, the URL the app got, and the redis-servers started for it."""
    kind: str                          # one of REGISTRIES
    url: str | None                    # ServiceConfig.registry_url (None: the embedded Ray-actor registry)
    ports: tuple[int, ...] = ()        # the loopback redis-servers holding the data (a cluster: its masters)
    keys: list[int] | None = None      # keys each of them held when the service stopped: where the app wrote

    def describe(self) -> str:
        where = {"redis": "one redis-server", "cluster": f"Redis Cluster of {len(self.ports)} masters (no replicas)",
                 "embedded": "embedded (Ray actor)"}[self.kind]
        if self.ports:
            where += f" on loopback ports {', '.join(map(str, self.ports))}, started here"
        if self.kind == "cluster" and self.url:
            where += f"; the app given {self.url} (one node; the client finds the others)"
        if self.keys is not None:
            where += f"; keys when the service stopped: {' + '.join(map(str, self.keys))}"
        return where

    def count_keys(self) -> list[int]:
        """DBSIZE of each server (a cluster node counts its own slots' keys only): the app's registry wrote there."""
        import redis

        counts = []
        for port in self.ports:
            with redis.Redis(host="127.0.0.1", port=port) as client:
                counts.append(int(client.dbsize()))
        return counts


@contextlib.contextmanager
def registry_servers(kind: str):
    """The registry's servers for `--registry kind`, on free loopback ports without persistence, stopped on exit;
    yields a RegistryRun. A cluster's URL is its first master's, as `inferscale serve --redis-url` takes one node:
    the registry detects the cluster there (services/registry/redis_backend.py)."""
    from urllib.parse import urlsplit

    from bench.local_redis import RedisServerMissing, local_redis_cluster_nodes, local_redis_server

    if kind == "embedded":
        yield RegistryRun(kind, None)
        return
    try:
        if kind == "redis":
            with local_redis_server() as url:
                yield RegistryRun(kind, url, (int(urlsplit(url).port or 0),))
        elif kind == "cluster":
            with local_redis_cluster_nodes(masters=CLUSTER_MASTERS) as cluster:
                yield RegistryRun(kind, cluster.url, tuple(n.port for n in cluster.masters()))
        else:
            raise ValueError(f"registry {kind!r} is not one of {', '.join(REGISTRIES)}")
    except RedisServerMissing as e:  # raised before the servers start, never by the caller's block
        raise SystemExit(f"{e}; use --registry embedded") from None


def cluster_desc(args) -> str:
    return f"Mooncake Store on loopback ({args.segment_gib:g} GiB segment)" if args.cluster_tier else "none"


def deployments(args) -> dict:
    """`inferscale serve`'s deployments (services/app.py) with the replica counts asked for."""
    from dataclasses import replace

    from inferscale_server.app import single_node_deployments

    deps = single_node_deployments()
    deps["EngineReplica"] = replace(deps["EngineReplica"], min_replicas=args.engine_replicas,
                                    max_replicas=args.engine_replicas)
    for name in ("Gateway", "Retrieval", "EncoderPool"):
        deps[name] = replace(deps[name], min_replicas=1, max_replicas=args.max_replicas)
    if args.retrieval_replicas is not None:  # issue 32 measures the retrieval hop with a fixed count
        deps["Retrieval"] = replace(deps["Retrieval"], min_replicas=args.retrieval_replicas,
                                    max_replicas=args.retrieval_replicas)
    return deps


def replicas_desc(args) -> str:
    """The deployments' replica counts as the report states them."""
    retrieval = (f"Retrieval {args.retrieval_replicas}, " if args.retrieval_replicas is not None else "")
    scaled = "Gateway/EncoderPool" if retrieval else "Gateway/Retrieval/EncoderPool"
    return (f"{args.engine_replicas} EngineReplica (engine_cpu_cores {engine_cpu_cores(args)}, stream_interval "
            f"{args.stream_interval}), {retrieval}"
            f"{scaled} 1..{args.max_replicas}; query_dtype {args.query_dtype}")


def engine_cpu_cores(args) -> int:
    """Several engine replicas on this one node each get their own cores unless told otherwise."""
    from inferscale_core.vllm_env import usable_cpus

    if args.engine_cpu_cores is not None:
        return args.engine_cpu_cores
    return len(usable_cpus()) // args.engine_replicas if args.engine_replicas > 1 else 0


def service_config(args, workdir: Path, registry_url: str | None, cluster_store: dict, secret_file: Path):
    """The ServiceConfig `inferscale serve` would make of these options (services/cli.py)."""
    from inferscale_server.app import ServiceConfig
    from inferscale_server.local_processes import free_port

    return ServiceConfig(model_path=args.model, registry_url=registry_url, dtype=args.dtype,
                         max_model_len=args.max_model_len, http_port=free_port(), grpc_port=free_port(),
                         kv_dir=str(workdir / "kv"), deployments=deployments(args), cluster_store=cluster_store,
                         auth={"hs256_secret_file": str(secret_file)}, engine_cpu_cores=engine_cpu_cores(args),
                         stream_interval=args.stream_interval, query_dtype=args.query_dtype,
                         limits=limit_overrides(args.limit), engine_overrides=engine_arg_overrides(args.engine_arg))


def engine_arg_overrides(items: list[str]) -> dict:
    """--engine-arg NAME=VALUE (repeatable) -> ServiceConfig.engine_overrides: a field of vLLM's EngineArgs, VALUE as
    JSON (256, true, "x") or else the text itself. A name EngineArgs does not have stops the benchmark first."""
    from dataclasses import fields

    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in fields(EngineArgs)}
    out: dict = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in known:
            raise SystemExit(f"--engine-arg NAME=VALUE with NAME a field of vLLM's EngineArgs, got {item!r}")
        try:
            out[name] = json.loads(value)
        except ValueError:
            out[name] = value
    return out


def limit_overrides(items: list[str]) -> dict:
    """--limit NAME=VALUE (repeatable) -> ServiceConfig.limits: services/limits.py's field NAME, VALUE in its type."""
    from dataclasses import fields

    from inferscale_server.limits import Limits

    types = {f.name: f.type for f in fields(Limits)}
    out: dict = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep or types.get(name) not in ("int", "float"):
                raise ValueError
            out[name] = int(value) if types[name] == "int" else float(value)
        except ValueError:
            raise SystemExit(f"--limit NAME=VALUE with NAME a number field of services/limits.py Limits and VALUE "
                             f"of its type, got {item!r}") from None
    return out


def service_env(args) -> dict[str, str]:
    """The environment of the Ray that serves the app: `inferscale serve`'s (vLLM on a CPU, Serve's start-up and
    request path and control loop, the gRPC proxy on loopback); with --serve-defaults without SERVE_REQUEST_PATH_ENV
    and SERVE_CONTROL_LOOP_ENV, so Serve runs its own defaults (what those variables say when unset): the before of a
    before/after."""
    from inferscale_server.app import SERVE_CONTROL_LOOP_ENV, SERVE_REQUEST_PATH_ENV, serve_start_env

    env = {**vllm_cpu_env(), **serve_start_env("127.0.0.1")}
    if args.serve_defaults:
        env = {k: v for k, v in env.items() if k not in SERVE_REQUEST_PATH_ENV and k not in SERVE_CONTROL_LOOP_ENV}
    return env


@contextlib.contextmanager
def own_service(args, workdir: Path):
    """The app as `inferscale serve` starts it, on a local Ray bound to 127.0.0.1. Yields (cfg, secret, registry):
    the RegistryRun's keys are counted once the service has stopped, before its servers do."""
    import ray
    from ray import serve

    from inferscale_server.app import start_service

    secret = secrets.token_urlsafe(48).encode()
    secret_file = workdir / "jwt-secret"
    secret_file.write_bytes(secret)
    secret_file.chmod(0o600)
    with contextlib.ExitStack() as stack:
        registry = stack.enter_context(registry_servers(args.registry))
        cluster = {}
        if args.cluster_tier:
            from inferscale_server.local_mooncake import local_mooncake

            cluster = dict(stack.enter_context(local_mooncake(segment_bytes=int(args.segment_gib * (1 << 30)))).config)
        cfg = service_config(args, workdir, registry.url, cluster, secret_file)
        deps = cfg.deployments
        env = service_env(args)
        os.environ.update(env)
        # Ray schedules by these shares; the replicas at their maximum must fit (the cores are shared anyway). Ray
        # takes whole CPUs only (2 retrieval replicas made the sum 2.25).
        ray_cpus = max(os.cpu_count() or 1, math.ceil(sum(d.num_cpus * d.max_replicas for d in deps.values())))
        ray.init(address="local", num_cpus=ray_cpus, include_dashboard=False, logging_level="ERROR",
                 _node_ip_address="127.0.0.1", runtime_env={"env_vars": env})
        try:
            t0 = time.monotonic()
            start_service(cfg, host="127.0.0.1")
            print(f"# service up in {time.monotonic() - t0:.0f} s: gRPC 127.0.0.1:{cfg.grpc_port}, HTTP "
                  f"127.0.0.1:{cfg.http_port}, registry {registry.describe()}, cluster KV tier "
                  f"{cluster.get('master', 'none')}", flush=True)
            yield cfg, secret, registry
        finally:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
            # The servers are still up (stopped when the stack unwinds): what the app stored, per server.
            with contextlib.suppress(Exception):
                registry.keys = registry.count_keys() if registry.ports else None


class ReplicaSampler:
    """Running replicas per deployment every `period_s` while the load runs (autoscaling, issue 12 item 6).
    services/observe.py's replica_counts when it exists, else the same count from serve.status()."""

    def __init__(self, period_s: float = 2.0):
        self.period_s, self.samples, self._stop = period_s, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="replica-sampler")
        self._t0 = time.monotonic()

    @staticmethod
    def counts() -> dict[str, int]:
        try:
            from inferscale_server.observe import replica_counts
        except ImportError:
            from ray import serve
            from ray.serve._private.common import ReplicaState

            app = serve.status().applications.get("inferscale")
            return {} if app is None else {n: int(d.replica_states.get(ReplicaState.RUNNING, 0))
                                           for n, d in app.deployments.items()}
        return replica_counts("inferscale")

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a busy controller misses a sample; the next one counts
                self.samples.append({"t_s": round(time.monotonic() - self._t0, 1), **self.counts()})
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=30)


def users_by_engine_replica(replicas: int) -> dict[str, dict]:
    """Each engine replica's held users and cold-read count (its stats()), by replica id. A user is held by the
    replica its writes and answers go to; one held by two replicas had a request served away from its home (the
    router passes a busy home over), whose facts that replica read cold. {} when the stats cannot be read."""
    from inferscale_server.observe import engine_replica_stats

    try:
        stats = engine_replica_stats(replicas, calls=40)
    except Exception as e:  # noqa: BLE001 - a record of the run, never its failure
        print(f"# engine replicas' stats not read: {e}", flush=True)
        return {}
    return {rid: {"users": st["users"], "facts_from_cluster": st["facts_from_cluster"]} for rid, st in stats.items()}


def users_on_several(by_replica: dict[str, dict]) -> int:
    seen: dict[str, int] = {}
    for rec in by_replica.values():
        for u in rec["users"]:
            seen[u] = seen.get(u, 0) + 1
    return sum(n > 1 for n in seen.values())


# ------------------------------------------------------------------------------------------ the client
def compile_client(workdir: Path) -> Path:
    """memory.proto compiled by grpcio-tools into a folder of its own, with the load client beside it
    (the approach of tests/unit/test_grpc_interop.py)."""
    from grpc_tools import protoc

    src, out = workdir / "protos", workdir / "client"
    (src / "inferscale/v1").mkdir(parents=True)
    (src / "inferscale/v1/memory.proto").write_bytes((REPO / "protos/inferscale/v1/memory.proto").read_bytes())
    out.mkdir()
    rc = protoc.main(["grpc_tools.protoc", f"-I{src}", f"--python_out={out}", f"--grpc_python_out={out}",
                      str(src / "inferscale/v1/memory.proto")])
    if rc != 0:
        raise SystemExit(f"grpcio-tools could not compile memory.proto (exit {rc})")
    shutil.copy(REPO / "bench" / "service_client.py", out / "service_client.py")
    return out / "service_client.py"


def run_client(client: Path, plan: dict, expect: int, label: str, deadline: float,
               ledger: CpuLedger | None = None) -> list[dict]:
    """The client in its own interpreter (-I); its JSON lines, with a progress bar over `expect` of them.
    Killed if it outlives the run's deadline (each request is bounded by its own timeout too). With a `ledger`,
    each cell's end is marked in it (the cells run one after another)."""
    from tqdm import tqdm

    plan_file = client.parent / f"plan-{label}.json"
    plan_file.write_text(json.dumps(plan))
    proc = subprocess.Popen([sys.executable, "-I", str(client), str(plan_file)], cwd=client.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if ledger is not None:
        ledger.named[proc.pid] = "load client"
        ledger.start()
    killer = threading.Timer(max(1.0, deadline - time.time() + plan["timeout_s"] + 60), proc.kill)
    killer.start()
    lines, done_cells = [], 0
    try:
        with tqdm(total=expect, desc=label, unit="req", disable=None, file=sys.stderr) as bar:
            for line in proc.stdout:
                if not line.startswith("{"):
                    continue
                obj = json.loads(line)
                lines.append(obj)
                if obj["type"] in ("request", "added", "deleted"):
                    bar.update(1)
                elif obj["type"] == "cell":
                    done_cells += 1
                    if ledger is not None:
                        ledger.mark(obj["cell"])
                    if bar.disable:  # no terminal: one line per cell instead of a bar
                        print(f"  {obj['cell']} done in {obj['wall_s']:.1f} s", file=sys.stderr, flush=True)
        err = proc.stderr.read()
        proc.wait()
    finally:
        killer.cancel()
    if proc.returncode != 0:
        raise RuntimeError(f"the {label} client failed (exit {proc.returncode}):\n{err[-3000:]}")
    return lines


# ------------------------------------------------------------------------------------------ engine level
def merged_disk_tier(kv_dir: Path, out: Path) -> Path | None:
    """One folder with every user folder the service's engine replicas wrote (`{kv_dir}/inferscale/
    EngineReplica/slot-*/kv-<fingerprint>/<user>`, services/engine_replica/placement.py:replica_disk_dir), as
    links: the engine here reads the very KV bytes the service injected. (The kv_dir is this run's own: one
    fingerprint, the one the engine here encodes with.)"""
    tiers = sorted((kv_dir / "inferscale" / "EngineReplica").glob("slot-*/kv-*"))
    if not tiers:
        return None
    out.mkdir(parents=True, exist_ok=True)
    for tier in tiers:
        for user_dir in tier.iterdir():
            if user_dir.is_dir() and not (out / user_dir.name).exists():
                (out / user_dir.name).symlink_to(user_dir, target_is_directory=True)
    return out


async def engine_phase(args, cfg, users: list[BenchUser], cells: list[Cell], records: list[dict],
                       disk_dir: Path | None, deadline: float) -> dict:
    """The gRPC cells' requests straight on AsyncInjectingEngine, cell by cell, at the same concurrency."""
    from tqdm import tqdm
    from vllm import SamplingParams

    from inferscale_core.defaults import serving_store_options
    from inferscale_core.requests import Query
    from inferscale_core.serving_engine import AsyncInjectingEngine
    from inferscale_core.types import kv_id
    from inferscale_server.app import ServiceConfig
    from inferscale_server.encoder_pool import FactEncoder, dtype_of
    from inferscale_server.modes import WIRE_MODES

    defaults = cfg or ServiceConfig()  # what an engine replica gets: block size, vLLM's args, store options
    # Ray starts its workers, the service's replicas among them, at niceness 15 (its worker_niceness default):
    # the engine here runs at the same, so that on a shared machine both sides get the same share of the cores.
    if args.engine_niceness > os.nice(0):
        os.nice(args.engine_niceness - os.nice(0))  # before vLLM starts: its threads and processes inherit it
    t0 = time.monotonic()
    fe = FactEncoder(args.model, device="cpu", dtype=args.dtype)
    options = serving_store_options(defaults.store_options)
    if disk_dir is not None:
        options["disk_dir"] = str(disk_dir)
    engine = AsyncInjectingEngine(model_path=args.model, prefix=fe.prefix(), dtype=dtype_of(args.dtype),
                                  block_size=defaults.block_size, max_model_len=args.max_model_len,
                                  store_options=options, **defaults.engine_replica_config(None).vllm_engine_args())
    await engine.start()
    by_id = {u.user_id: u for u in users}
    injected = {(r["cell"], r["user_id"], r["i"]): r.get("fact_ids") for r in records
                if r["type"] == "request" and r["status"] == "OK"}
    # The facts the service's answers injected, per user: what the replay needs (with a cluster tier a replica
    # holds, and writes to its disk tier, only the facts its requests read).
    needed: dict[str, set[str]] = {}
    for (_, uid, _), fact_ids in injected.items():
        needed.setdefault(uid, set()).update(fact_ids or ())
    from_disk = encoded_here = 0
    for uid, wanted in sorted(needed.items()):
        u = by_id[uid]
        idx = [i for i, f in enumerate(u.fact_ids) if f in wanted]
        ids = [kv_id(u.fact_ids[i], 1) for i in idx]
        have = await engine.has_encoded(uid, ids)
        missing = [j for j, ok in enumerate(have) if not ok]
        from_disk += len(ids) - len(missing)
        if missing:  # not ours (--target) or not on disk: encoded here exactly as the encoder pool does
            encoded = await asyncio.to_thread(fe.encode, [(u.facts[idx[j]], []) for j in missing])
            await engine.put_encoded(uid, [(ids[j], e) for j, e in zip(missing, encoded)])
            encoded_here += len(missing)
        await engine.preload(uid)  # every fact in memory, as in the replica that received them
    del fe
    setup_s = time.monotonic() - t0
    print(f"# engine level: AsyncInjectingEngine ready in {setup_s:.0f} s; facts from the service's disk tier "
          f"{from_disk}, encoded here {encoded_here}", flush=True)

    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    async def one(cell: Cell, uid: str, question: str, fact_ids: list[str]) -> dict:
        u = by_id[uid]
        text_of = dict(zip(u.fact_ids, u.facts))
        q = Query(uid, question, k=max(1, len(fact_ids)), mode=WIRE_MODES[cell.mode])
        p = engine.prepare_facts(q, fact_ids, [text_of[f] for f in fact_ids], [1] * len(fact_ids),
                                 [kv_id(f, 1) for f in fact_ids])
        out, t_start = {"status": "OK"}, time.perf_counter()
        async for text, ans in engine.stream(p, sp):
            if "t_first_s" not in out and (text or ans is not None):
                out["t_first_s"] = time.perf_counter() - t_start
            if ans is not None:
                out.update(ttft_ms=(ans.ttft_s or 0.0) * 1000, prompt_tokens=ans.prompt_len,
                           prefilled_tokens=ans.prompt_len - ans.num_cached_tokens,
                           completion_tokens=len(ans.token_ids))
        out["t_total_s"] = time.perf_counter() - t_start
        return out

    # Warm-up, as the service had: the first requests of an engine pay one-off kernel setup.
    warm = next((c for c in cells if injected.get((c.id, c.plan[0]["user_id"], 0))), None)
    if warm is not None:
        for mode in args.mode_list:
            wc = Cell("warm", "engine", 1, mode, warm.k)
            await one(wc, warm.plan[0]["user_id"], warm.plan[0]["questions"][0][1],
                      injected[(warm.id, warm.plan[0]["user_id"], 0)])

    out_records, walls = [], {}
    total = sum(len(p["questions"]) for c in cells for p in c.plan)
    ledger = CpuLedger(driver="engine alone")
    ledger.start()
    with tqdm(total=total, desc="engine", unit="req", disable=None, file=sys.stderr) as bar:
        for cell in cells:
            ecell = f"engine-n{cell.users}-{cell.mode}-k{cell.k}"
            t_cell = time.perf_counter()

            async def user_loop(p: dict) -> None:
                for i, (qi, question) in enumerate(p["questions"]):
                    base = {"type": "request", "cell": ecell, "user_id": p["user_id"], "i": i, "question_index": qi,
                            "start_s": time.perf_counter() - t_cell}
                    fact_ids = injected.get((cell.id, p["user_id"], i))
                    if fact_ids is None:
                        res = {"status": NO_SERVICE_PROMPT, "t_total_s": 0.0}  # the service request failed
                    elif time.time() > deadline:
                        res = {"status": "NOT_SENT_DEADLINE", "t_total_s": 0.0}
                    else:
                        try:
                            res = await asyncio.wait_for(one(cell, p["user_id"], question, fact_ids),
                                                         args.request_timeout)
                        except asyncio.TimeoutError:
                            res = {"status": "TIMEOUT", "t_total_s": args.request_timeout}
                    out_records.append({**base, **res})
                    bar.update(1)

            await asyncio.gather(*(user_loop(p) for p in cell.plan))
            walls[ecell] = time.perf_counter() - t_cell
            ledger.mark(ecell)
            if bar.disable:
                print(f"  {ecell} done in {walls[ecell]:.1f} s", file=sys.stderr, flush=True)
    engine.shutdown()
    return {"records": out_records, "walls": walls, "cpu": dict(ledger.marks),
            "vllm_core": dict(ledger.vllm_core_marks), "setup_s": setup_s,
            "facts_from_service_disk": from_disk, "facts_encoded_here": encoded_here}


# ------------------------------------------------------------------------------------------ analysis
def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if q < 100 else values[-1]


def summarize(cell_id: str, door: str, n: int, mode: str, k: int, recs: list[dict], wall_s: float | None) -> dict:
    ok = [r for r in recs if r["status"] == "OK"]
    failures: dict[str, int] = {}
    for r in recs:
        if r["status"] != "OK":
            failures[r["status"]] = failures.get(r["status"], 0) + 1
    first = [r["t_first_s"] * 1000 for r in ok if r.get("t_first_s") is not None]
    total = [r["t_total_s"] * 1000 for r in ok]
    ttft = [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None]
    timing_keys = sorted({key for r in ok for key in (r.get("timings_ms") or {})})
    row = {"cell": cell_id, "door": door, "users": n, "mode": mode, "k": k, "requests": len(recs), "ok": len(ok),
           "failures": failures, "wall_s": wall_s, "retried": sum(1 for r in ok if r.get("attempts", 1) > 1),
           "req_per_s": (len(ok) / wall_s) if wall_s and ok else None,
           "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in ok) if ok else None,
           "prefilled_tokens_mean": statistics.mean(r["prefilled_tokens"] for r in ok
                                                    if r.get("prefilled_tokens") is not None) if ok else None,
           # KV requests whose memory vLLM computed after all (a failed load: facts in no tier, a read that failed):
           # more than half of the prompt prefilled. They are the KV path's slowest requests; the count says why.
           "recomputed": sum(1 for r in ok if mode == "inject" and r.get("prefilled_tokens") is not None
                             and r["prefilled_tokens"] > r["prompt_tokens"] / 2),
           "timings_ms_p50": {key: pct([r["timings_ms"][key] for r in ok if key in (r.get("timings_ms") or {})], 50)
                              for key in timing_keys}}
    for name, vals in (("first_chunk_ms", first), ("total_ms", total), ("engine_ttft_ms", ttft)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}"] = pct(vals, q)
    return row


def table_rows(service_lines: list[dict], engine: dict | None, cells: list[Cell]) -> list[dict]:
    walls = {o["cell"]: o["wall_s"] for o in service_lines if o["type"] == "cell"}
    recs: dict[str, list] = {}
    for r in service_lines:
        if r["type"] == "request":
            recs.setdefault(r["cell"], []).append(r)
    rows = [summarize(c.id, c.door, c.users, c.mode, c.k, recs.get(c.id, []), walls.get(c.id)) for c in cells]
    if engine is not None:
        erecs: dict[str, list] = {}
        for r in engine["records"]:
            erecs.setdefault(r["cell"], []).append(r)
        for c in cells:
            if c.door == "grpc":
                eid = f"engine-n{c.users}-{c.mode}-k{c.k}"
                rows.append(summarize(eid, "engine", c.users, c.mode, c.k, erecs.get(eid, []),
                                      engine["walls"].get(eid)))
    return rows


def ratios(rows: list[dict], args) -> list[dict]:
    """Issue 12's item-2 targets, one line per (door, mode, k) they apply to; value None = not computable."""
    at = {(r["door"], r["users"], r["mode"], r["k"]): r for r in rows}
    lo, hi, kmax = min(args.user_counts), max(args.user_counts), max(args.k_values)
    out = []

    def div(a, b):
        return a / b if a is not None and b not in (None, 0) else None

    def add(name, door, n, mode, k, value, limit, kind, basis):
        # No limit: the engine-level ratio it comes from was not measured (--skip-engine): not computable.
        met = None if value is None or limit is None else (value <= limit if kind == "max" else value >= limit)
        margin = None if value is None or limit is None else (limit - value if kind == "max" else value - limit)
        out.append({"target": name, "door": door, "users": n, "mode": mode, "k": k, "value": value, "limit": limit,
                    "kind": kind, "met": met, "margin": margin, "basis": basis})

    for door in ("grpc", "http"):
        for mode in args.mode_list:
            for k in args.k_values:
                # The low limit is one user's (issue 30: N=1 at every k), the high one the largest N's; a run of
                # one N > 1 gets the high one, a run of N=1 alone the low one.
                limits = {hi: TARGET_FIRST_CHUNK["high"]}
                if lo != hi or lo == 1:
                    limits[lo] = TARGET_FIRST_CHUNK["low"]
                for n, limit in limits.items():
                    svc, eng = at.get((door, n, mode, k)), at.get(("engine", n, mode, k))
                    if svc is None:
                        continue
                    add("first chunk / engine TTFT (final chunk)", door, n, mode, k,
                        div(svc["first_chunk_ms_p50"], svc["engine_ttft_ms_p50"]), limit, "max",
                        "p50 client first chunk / p50 ttft_ms of the same requests' final chunks")
                    add("first chunk / engine-level TTFT", door, n, mode, k,
                        div(svc["first_chunk_ms_p50"], eng and eng["engine_ttft_ms_p50"]), limit, "max",
                        "p50 client first chunk / p50 TTFT of the same prompts on AsyncInjectingEngine, same N")
                svc, eng = at.get((door, hi, mode, k)), at.get(("engine", hi, mode, k))
                if svc is not None:
                    add("service req/s / engine-level req/s", door, hi, mode, k,
                        div(svc["req_per_s"], eng and eng["req_per_s"]), TARGET_THROUGHPUT, "min",
                        "same requests, same concurrency")
        kv, pi = at.get((door, hi, "inject", kmax)), at.get((door, hi, "prompt", kmax))
        ekv, epi = at.get(("engine", hi, "inject", kmax)), at.get(("engine", hi, "prompt", kmax))
        if kv is not None and pi is not None:
            engine_ratio = div(ekv and ekv["req_per_s"], epi and epi["req_per_s"])
            add("service KV/PI req/s vs engine-level KV/PI x 0.9", door, hi, "inject/prompt", kmax,
                div(kv["req_per_s"], pi["req_per_s"]), engine_ratio * TARGET_KV_PI_SLACK if engine_ratio else None,
                "min", f"engine-level KV/PI = {engine_ratio:.2f}" if engine_ratio else "engine-level ratio missing")
    # An engine replay of a request the service failed is not sent (NO_SERVICE_PROMPT): counted once, as the
    # service's failure.
    failed = sum(v for r in rows for k, v in r["failures"].items() if k != NO_SERVICE_PROMPT)
    out.append({"target": "zero failed requests", "door": "all", "users": "all", "mode": "all", "k": "all",
                "value": failed, "limit": 0, "kind": "max", "met": failed == 0, "margin": -failed,
                "basis": "every cell, every door, and the engine replay"})
    return out


# ------------------------------------------------------------------------------------------ output
def fmt(v, digits=0) -> str:
    if v is None:
        return "–"
    return f"{v:,.{digits}f}"


HOPS = ("retrieval", "user_sync", "kv_fetch", "kv_fetch_lock", "kv_fetch_disk_check", "kv_fetch_read",
        "kv_fetch_put", "kv_fetch_encode", "admission_wait", "vllm_queue", "kv_load", "kv_load_read", "prefill",
        "engine_ttft", "gateway_total_to_first_chunk")  # AnswerChunk.timings_ms, in the order a request meets
# them; a kv_fetch_* step's p50, and kv_load's (the wait for the connector's asynchronous load, outside
# vllm_queue; kv_load_read its cluster read), are over the requests that took that step


def hop_order(name: str) -> tuple[int, str]:
    return (HOPS.index(name) if name in HOPS else len(HOPS), name)


def cpu_lines(result: dict) -> list[str]:
    """Where each cell's cores went (bench/cpu_ledger.py): CPU ms per answered request, by part, the engine first;
    "cores busy" is every part's CPU over the cell's wall time (the machine's cores bound it). A part with vLLM
    engine cores under it (the engine replicas, the engine alone) says in brackets how much of it they were."""
    by_cell = result.get("cpu_by_cell") or {}
    if not by_cell:
        return []
    cores_by_cell = result.get("vllm_core_by_cell") or {}
    lines = ["", "CPU per answered request by part (ms of CPU, user + system, from /proc; the service's parts are "
             "this run's processes, the engine alone is this process; in brackets, the part's vLLM engine core "
             "processes). On busy cores the engine gets what the other parts leave:", "",
             "| cell | answered | wall s | cores busy | CPU ms per request, by part |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        parts = by_cell.get(row["cell"])
        if not parts or not row["ok"] or not row["wall_s"]:
            continue
        cores = cores_by_cell.get(row["cell"], {})
        engine_first = sorted(parts.items(), key=lambda kv: (kv[0] not in ("EngineReplica", "engine alone"), -kv[1]))
        shown = ", ".join(f"{name} {1000 * sec / row['ok']:.0f}"
                          + (f" (vLLM core {1000 * cores[name] / row['ok']:.0f})" if cores.get(name) else "")
                          for name, sec in engine_first if sec >= 0.0005)
        lines.append(f"| {row['cell']} | {row['ok']} | {row['wall_s']:.1f} | {sum(parts.values()) / row['wall_s']:.2f} "
                     f"| total {1000 * sum(parts.values()) / row['ok']:.0f}: {shown} |")
    return lines


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Service under load (`{m['command']}`)", "",
             f"CPU: {m['cpu_line']}. **CPU times, not GPU times.** Load average (1 min): "
             + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in m["load"].items()) + ".",
             f"Service: {m['service']}. Model {m['model']}, dtype {m['dtype']}, {m['max_tokens']} answer tokens, "
             f"greedy, streamed. Users: {m['users_desc']}. Requests per user: {m['requests_n1']} at N=1, "
             f"{m['requests_per_user']} at N>1 (one after another); a request shed by the service is "
             + (f"asked again 1 s later, up to {m['retry_overload']} times." if m.get("retry_overload")
                else "a failure (no retry)."),
             f"Registry: {m['registry']['desc'] if 'registry' in m else 'not recorded'}.",
             f"Engine level: {m.get('engine_desc', 'not run')}.", "",
             "| door | users | mode | k | requests | ok | failures | req/s | first chunk p50 / p90 / p99 ms "
             "| total p50 / p99 ms | engine TTFT p50 / p90 ms (final chunk) | prompt tokens | prefilled "
             "| hops p50 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        t = r["timings_ms_p50"]
        hops = ", ".join(f"{k} {t[k]:.0f}" for k in sorted(t, key=hop_order) if t[k] is not None) or "–"
        fails = ", ".join(f"{k} {v}" for k, v in sorted(r["failures"].items())) or "0"
        retried = f" ({r['retried']} retried)" if r.get("retried") else ""
        recomputed = f" ({r['recomputed']} recomputed)" if r.get("recomputed") else ""
        lines.append(
            f"| {r['door']} | {r['users']} | {r['mode']} | {r['k']} | {r['requests']} | {r['ok']}{retried} | {fails} | "
            f"{fmt(r['req_per_s'], 2)} | {fmt(r['first_chunk_ms_p50'])} / {fmt(r['first_chunk_ms_p90'])} / "
            f"{fmt(r['first_chunk_ms_p99'])} | {fmt(r['total_ms_p50'])} / {fmt(r['total_ms_p99'])} | "
            f"{fmt(r['engine_ttft_ms_p50'])} / {fmt(r['engine_ttft_ms_p90'])} | {fmt(r['prompt_tokens_mean'])} | "
            f"{fmt(r['prefilled_tokens_mean'])}{recomputed} | {hops} |")
    cold = {}
    for r in result.get("requests", []):
        if r.get("status") == "OK" and "-inject-" in r["cell"] and not r["cell"].startswith("engine-"):
            c = cold.setdefault(r["cell"], [0, 0])
            c[0] += "kv_load_read" in r["timings_ms"]
            c[1] += 1
    if cold:
        lines += ["", f"Loads by the connector's worker (settled {m.get('settle_s', 0):.0f} s after the adds; a cold "
                  "load read the cluster tier): " + "; ".join(f"{cell} {c[0]} cold of {c[1]}"
                                                              for cell, c in sorted(cold.items())) + "."]
    spread = m.get("engine_replicas_users") or {}
    if spread:
        lines += ["", "Users held by more than one engine replica (a request served away from the user's home "
                  "replica reads its facts cold there): " + "; ".join(
                      f"{when.replace('_', ' ')} {rec['on_several']} (facts read from the cluster tier per replica: "
                      + ", ".join(str(r["facts_from_cluster"]) for r in rec["by_replica"].values()) + ")"
                      for when, rec in spread.items()) + "."]
    lines += cpu_lines(result)
    lines += ["", "Targets (issue 12, item 2; ratios of this run):", "",
              "| target | door | users | mode | k | measured | limit | verdict | margin |",
              "|---|---|---|---|---|---|---|---|---|"]
    for t in result["ratios"]:
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "**missed**")
        lim = fmt(t["limit"], 2) if isinstance(t["limit"], float) else str(t["limit"])
        val = fmt(t["value"], 2) if isinstance(t["value"], float) else str(t["value"])
        mar = fmt(t["margin"], 2) if isinstance(t["margin"], float) else str(t["margin"])
        lines.append(f"| {t['target']} | {t['door']} | {t['users']} | {t['mode']} | {t['k']} | {val} | "
                     f"{'<=' if t['kind'] == 'max' else '>='} {lim} | {verdict} | {mar} |")
    if result.get("replicas"):
        lines += ["", "Replica counts (RUNNING) when they changed:", ""]
        last = None
        for s in result["replicas"]:
            counts = {k: v for k, v in s.items() if k != "t_s"}
            if counts != last:
                lines.append(f"- t={s['t_s']:.0f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
                last = counts
    if result.get("failure_examples"):
        lines += ["", "Failures (first of each status):", ""]
        lines += [f"- {e['cell']}: {e['status']}: {e.get('error', '')}" for e in result["failure_examples"]]
    lines += ["", f"Wall time {m['wall_s']:.0f} s. Checks: {'; '.join(result['checks'])}.", ""]
    return "\n".join(lines)


def rounded(obj):
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rounded(v) for v in obj]
    return obj


def write_json(result: dict, path: Path) -> None:
    """The result, one per-request record a line (thousands of them in a full run)."""
    parts = []
    for key, value in result.items():
        if key == "requests":
            body = "[\n" + ",\n".join(json.dumps(rounded(r), separators=(",", ":")) for r in value) + "\n]"
        else:
            body = json.dumps(value, indent=1, default=str)
        parts.append(f"{json.dumps(key)}: {body}")
    path.write_text("{\n" + ",\n".join(parts) + "\n}\n")


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"]
    panels = 3 if result.get("replicas") else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    series = sorted({(r["door"], r["mode"], r["k"]) for r in rows})
    colors = {mk: f"C{i}" for i, mk in enumerate(sorted({(m, k) for _, m, k in series}))}  # one per mode and k
    for door, mode, k in series:
        pts = sorted((r["users"], r) for r in rows if (r["door"], r["mode"], r["k"]) == (door, mode, k))
        style = {"grpc": "-o", "http": "--s", "engine": ":^"}[door]
        label = f"{door} {mode} k={k}"
        key = "engine_ttft_ms_p50" if door == "engine" else "first_chunk_ms_p50"
        xs = [n for n, r in pts if r[key] is not None]
        axes[0].plot(xs, [r[key] for n, r in pts if r[key] is not None], style, label=label, color=colors[mode, k])
        xs = [n for n, r in pts if r["req_per_s"] is not None]
        axes[1].plot(xs, [r["req_per_s"] for n, r in pts if r["req_per_s"] is not None], style, label=label,
                     color=colors[mode, k])
    axes[0].set(xscale="log", yscale="log", xlabel="concurrent users",
                ylabel="ms (p50)", title="client first chunk (grpc, http) / TTFT (engine level)")
    axes[1].set(xscale="log", xlabel="concurrent users", ylabel="req/s", title="throughput")
    axes[0].legend(fontsize=6)
    if panels == 3:
        names = sorted({k for s in result["replicas"] for k in s if k != "t_s"})
        for name in names:
            axes[2].step([s["t_s"] for s in result["replicas"]], [s.get(name, 0) for s in result["replicas"]],
                         where="post", label=name)
        axes[2].set(xlabel="s since the load started", ylabel="RUNNING replicas", title="replicas")
        axes[2].legend(fontsize=7)
    fig.suptitle(f"{result['meta']['cpu_line'][:90]} (CPU)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    args = parse_args(argv)
    t_run = time.monotonic()
    deadline = time.time() + args.deadline_min * 60
    cpu = cpu_description()
    load = {"start": load_average()}
    print(f"# {cpu_line(cpu)}; load average {load['start']}", flush=True)
    run_id = secrets.token_hex(3)
    users = make_users(args.data, users_needed(args), args.facts_per_user, f"svcbench-{run_id}")
    workdir = Path(tempfile.mkdtemp(prefix="inferscale-bench-service-"))
    client = compile_client(workdir)
    service_lines: list[dict] = []
    replicas: list[dict] = []
    ledger = CpuLedger()  # the service's CPU by part, cell by cell (this process's descendants: Ray, the stores)
    checks: list[str] = []
    own = args.target is None
    try:
        with contextlib.ExitStack() as stack:
            if own:
                cfg, secret, registry = stack.enter_context(own_service(args, workdir))
                grpc_port, http_port = cfg.grpc_port, cfg.http_port
                service_desc = (f"own app (`inferscale serve` config: {replicas_desc(args)}; registry "
                                f"{args.registry}; cluster KV tier {cluster_desc(args)}; disk tier; Ray and Serve on "
                                "127.0.0.1)")
            else:
                grpc_port, http_port, cfg, registry = args.grpc_port, args.http_port, None, None
                secret = args.jwt_secret_file.read_bytes().strip() if args.jwt_secret_file else None
                service_desc = f"running service at {args.target}"
            from inferscale_server.auth import USER_SCOPES, mint

            tokens = {u.user_id: (mint(secret, u.user_id, USER_SCOPES, ttl_s=6 * 3600) if secret else args.token)
                      for u in users}
            base_plan = {"grpc": f"127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}/v1",
                         "timeout_s": args.request_timeout, "deadline": deadline, "checkout": str(REPO)}
            load["before_add"] = load_average()
            t0 = time.monotonic()
            added = run_client(client, {**base_plan, "command": "add", "users": [
                {"user_id": u.user_id, "token": tokens[u.user_id], "facts": u.facts} for u in users]},
                len(users), "add facts", deadline)
            add_s = time.monotonic() - t0
            bad = [a for a in added if a["status"] != "OK"]
            if bad:
                raise SystemExit(f"adding facts failed for {len(bad)} users: {bad[0]}")
            for a in added:
                next(u for u in users if u.user_id == a["user_id"]).fact_ids = a["fact_ids"]
            n_facts = sum(len(u.facts) for u in users)
            print(f"# {len(users)} users, {n_facts} facts added in {add_s:.0f} s; {args.settle_s:.0f} s to settle",
                  flush=True)
            time.sleep(args.settle_s)  # the engine replicas' warm-ups of the last writes (each request says
            # where its facts came from: `facts_from` in its kv_load report, "cluster" for a cold read)
            spread = {}
            record_spread = own and args.engine_replicas > 1  # whose users the replicas hold: only with several
            if record_spread:
                spread["after_adds"] = users_by_engine_replica(args.engine_replicas)

            # Warm-up (not recorded): one request per mode and door, as the engine phase gets.
            one = single_user(args, users)
            warm_cells = [Cell(f"warm-{door}-{mode}", door, 1, mode, max(args.k_values),
                               [{"user_id": one.user_id, "token": tokens[one.user_id],
                                 "questions": one.take_questions(1)}])
                          for door in ("grpc", "http") for mode in args.mode_list]
            cells = make_cells(args, users, tokens)
            plan = {**base_plan, "command": "run", "max_tokens": args.max_tokens, "retry_overload": args.retry_overload,
                    "cells": [{"id": c.id, "door": c.door, "mode": c.mode, "k": c.k, "max_tokens": args.max_tokens,
                               "users": c.plan} for c in warm_cells + cells]}
            expect = sum(len(p["questions"]) for c in warm_cells + cells for p in c.plan)
            load["before_service_load"] = load_average()
            sampler = ReplicaSampler() if own and (args.engine_replicas > 1 or args.max_replicas > 1
                                                   or (args.retrieval_replicas or 1) > 1) else None
            # The service load may use 55% of the time left; the engine replay gets the rest.
            load_deadline = time.time() + 0.55 * (deadline - time.time())
            with sampler or contextlib.nullcontext():
                service_lines = run_client(client, {**plan, "deadline": load_deadline}, expect, "service",
                                           load_deadline, ledger=ledger)
            replicas = sampler.samples if sampler else []
            if record_spread:
                spread["after_load"] = users_by_engine_replica(args.engine_replicas)
                print("# users held by more than one engine replica: "
                      + ", ".join(f"{k} {users_on_several(v)}" for k, v in spread.items() if v), flush=True)
            load["after_service_load"] = load_average()
            info = next((o for o in service_lines if o["type"] == "client"), {})
            checks.append(f"load client imported nothing of the checkout: {info.get('from_checkout') == []}")
            checks.append(f"AnswerChunk.timings_ms in the proto: {info.get('has_timings_field')}")
            service_lines = [o for o in service_lines if not str(o.get("cell", "")).startswith("warm-")]
            if not own:
                run_client(client, {**base_plan, "command": "delete", "users": [
                    {"user_id": u.user_id, "token": tokens[u.user_id]} for u in users]}, len(users), "cleanup",
                    deadline + 120)
        # The service is down here (our own): the engine runs alone on the cores.
        engine = None
        if not args.skip_engine:
            grpc_cells = [c for c in cells if c.door == "grpc"]
            disk = merged_disk_tier(workdir / "kv", workdir / "engine-kv") if own else None
            load["before_engine"] = load_average()
            engine = asyncio.run(engine_phase(args, cfg, users, grpc_cells, service_lines, disk, deadline))
            load["after_engine"] = load_average()
            by_key = {(r["cell"].replace("grpc-", "engine-", 1), r["user_id"], r["i"]): r for r in service_lines
                      if r["type"] == "request" and r["status"] == "OK" and r["cell"].startswith("grpc-")}
            pairs = [(by_key[(e["cell"], e["user_id"], e["i"])], e) for e in engine["records"]
                     if e["status"] == "OK" and (e["cell"], e["user_id"], e["i"]) in by_key]
            match = sum(s["prompt_tokens"] == e["prompt_tokens"] for s, e in pairs)
            checks.append(f"engine replay prompts of the service's length: {match}/{len(pairs)}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    rows = table_rows(service_lines, engine, cells)
    result = {"meta": {
        "command": "python bench/service.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "cpu": cpu, "cpu_line": cpu_line(cpu), "load": load, "service": service_desc,
        "registry": ({"kind": registry.kind, "url": registry.url, "ports": registry.ports, "keys": registry.keys,
                      "desc": registry.describe()} if registry else
                     {"kind": "target", "desc": "the running service's own (not known here)"}),
        "model": args.model or "SmolLM2-135M-Instruct (packaged)", "dtype": args.dtype, "max_tokens": args.max_tokens,
        "users_desc": f"{len(users)} users x {args.facts_per_user} facts from {Path(args.data).name} "
                      f"(e.g. user 0: {users[0].source})",
        "user_sources": {u.user_id: u.source for u in users},
        "requests_n1": args.requests_n1, "requests_per_user": args.requests_per_user,
        "retry_overload": args.retry_overload,
        "user_counts": args.user_counts, "ks": args.k_values, "http_users": args.http_counts,
        "add_facts_s": add_s, "settle_s": args.settle_s, "facts": n_facts, "wall_s": time.monotonic() - t_run,
        "engine_replicas_users": {k: {"on_several": users_on_several(v), "by_replica": v}
                                  for k, v in spread.items() if v}}}
    if engine is not None:
        result["meta"]["engine_desc"] = (f"AsyncInjectingEngine in this process after the service stopped, at "
                                         f"niceness {args.engine_niceness} (Ray's replicas run at 15); the gRPC "
                                         f"cells' prompts replayed at the same N; facts from the service's disk tier "
                                         f"{engine['facts_from_service_disk']}, encoded here "
                                         f"{engine['facts_encoded_here']}; ready in {engine['setup_s']:.0f} s")
        result["meta"]["engine_facts"] = {"from_service_disk": engine["facts_from_service_disk"],
                                          "encoded_here": engine["facts_encoded_here"]}
    result["rows"] = rows
    result["cpu_by_cell"] = {cell: parts for cell, parts in ledger.marks if not cell.startswith("warm-")}
    result["vllm_core_by_cell"] = {cell: cores for cell, cores in ledger.vllm_core_marks
                                   if not cell.startswith("warm-")}
    if engine is not None:
        result["cpu_by_cell"].update(engine["cpu"])
        result["vllm_core_by_cell"].update(engine["vllm_core"])
    result["ratios"] = ratios(rows, args)
    result["replicas"] = replicas
    examples, seen = [], set()
    for r in service_lines + (engine["records"] if engine else []):
        if r.get("type") == "request" and r["status"] != "OK" and r["status"] not in seen:
            seen.add(r["status"])
            examples.append({"cell": r["cell"], "status": r["status"], "error": r.get("error", "")})
    result["failure_examples"] = examples
    result["checks"] = checks
    # Per-request records without LoCoMo text (question indices only): LoCoMo is CC BY-NC, not shipped.
    # Fact ids are replaced by their count: the replay needed them, the record does not (megabytes at k=50).
    result["requests"] = [{**{k: v for k, v in r.items() if k not in ("type", "fact_ids")},
                           "facts": len(r.get("fact_ids") or [])} for r in service_lines
                          if r["type"] == "request"] + (engine["records"] if engine else [])

    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"service_{args.tag}"
    md = markdown(result)
    stem.with_suffix(".md").write_text(md)
    write_json(result, stem.with_suffix(".json"))
    plotted = plot(result, stem.with_suffix(".png"))
    print("\n" + md)
    print(f"written: {stem}.json, {stem}.md" + (f", {stem}.png" if plotted else " (matplotlib missing: no plot)"))
    missing = [t for t in result["ratios"] if t["met"] is None]
    failed = next(t for t in result["ratios"] if t["target"] == "zero failed requests")["value"]
    if failed or missing:
        print(f"exit 1: {failed} failed requests, {len(missing)} ratios not computable", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
