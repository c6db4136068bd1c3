"""`inferscale serve | token` and the client's commands: the Ray Serve application on this machine and its gRPC
client.

    inferscale serve [--redis-url redis://:PASSWORD@127.0.0.1:6379/0]     # Ctrl-C or SIGTERM stops it
    inferscale add alice "Alice adopted a grey cat named Pixel." "Alice lives in Lisbon."
    inferscale ask alice "What is my cat called?"
    inferscale list alice --json      # also: search, get, update, delete, status (inferscale_client/cli.py)
    inferscale token alice            # a bearer token for alice (last line), for other clients

`serve` starts a local Ray, the four deployments at one replica each (services/app.py:single_node_deployments)
on the embedded default model (SmolLM2-135M-Instruct) unless --model names another, and prints the
addresses. Without --redis-url the registry lives in a Ray actor and is gone when `serve` stops; KV is
written to --kv-dir either way. Mounted by inferscale_core/cli.py.

Auth (docs/security.md): `serve` verifies tokens signed with the local development secret
(<inferscale cache>/dev-jwt-secret, made on first use, mode 0600) unless --jwt-secret-file, --jwt-public-key-file
or --jwks-url names another key; --insecure-no-auth turns auth off. The client commands send --token or
$INFERSCALE_TOKEN; with neither, against a server on this machine, they sign a token for the user with the
local development secret, so the quick start needs no extra step.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time

from inferscale_client import cli as client_cli
from inferscale_core.vllm_env import machine_memory_bytes, serving_dtype, serving_kv_cache_gib, vllm_cpu_env

from .messages import DEFAULT_STREAM_INTERVAL


def add_commands(sub) -> None:
    p = sub.add_parser("serve", help="run the InferScale service (Ray Serve, gRPC + HTTP) on this machine")
    p.add_argument("--redis-url", default=None, help="registry (default: in memory, lost when serve stops)")
    p.add_argument("--model", default=None, help="local HF model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the engine's and the stored KV's dtype (default auto: bfloat16 where the CPU has "
                        "avx512_bf16 or amx_bf16, or on a CUDA GPU with bf16; else float32)")
    p.add_argument("--query-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the dtype retrieval embeds a query in; facts are always float32 (default auto: bfloat16 "
                        "where the CPU has avx512_bf16 or amx_bf16, or on a CUDA GPU with bf16; else float32)")
    p.add_argument("--grpc-port", type=int, default=9000)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1",
                   help="address the gRPC and HTTP ports bind (default: loopback only; 0.0.0.0 for every address)")
    p.add_argument("--kv-dir", default=None, help="disk tier of the engine's fact store "
                                                  "(default: <inferscale cache>/kv)")
    p.add_argument("--kv-disk-budget-gib", type=_positive_float, default=None, metavar="GIB",
                   help="byte budget of the disk tier: beyond it files are deleted, each time the least recently "
                        "used fact of the user holding the most there (default: a quarter of the disk space free "
                        "when the engine starts)")
    p.add_argument("--mooncake-master", default=None, metavar="HOST:PORT",
                   help="cluster KV tier: a running mooncake_master's RPC address (default: none: KV reaches vLLM "
                        "through the engine core's RPC channel; --local-mooncake starts one here); needs "
                        "--mooncake-pool-gib")
    p.add_argument("--mooncake-pool-gib", type=_positive_float, default=None, metavar="GIB",
                   help="with --mooncake-master: the memory segments that store always has, together, the base of "
                        "each user's share of the tier (pool / (2 copies x 16 tenants): no tenant's KV flushes the "
                        "others'); the fewest nodes' segments, never what autoscaling may add")
    p.add_argument("--mooncake-metadata", default=None, metavar="URL",
                   help="a metadata server's URL, for a master started with one (default: none, segment "
                        "descriptors are exchanged peer to peer: Mooncake's P2PHANDSHAKE)")
    p.add_argument("--local-mooncake", action="store_true",
                   help="start a Mooncake Store here (master and one segment, stopped with serve) as the cluster KV "
                        "tier: the encoder pool writes each fact's KV there and vLLM's connector loads it, the "
                        "cluster's path on one machine. Mooncake's transfer and handshake ports listen on EVERY "
                        "interface (no flag binds them): use it on a machine no untrusted network reaches")
    p.add_argument("--mooncake-segment-gib", type=_positive_float, default=None, metavar="GIB",
                   help="with --local-mooncake: its memory (default: a sixteenth of the machine's, at least 1; "
                        "taken as facts arrive); each user's KV there is bounded to 1/16 of it (the chart's share: "
                        "pool / (copies x 16 tenants), one copy here), its own least recently used facts "
                        "re-encoded past that")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest prompt + answer in tokens (default: the model's own context, 8,192 for SmolLM2: a "
                        "memory of up to ~200 facts)")
    p.add_argument("--stream-interval", type=_positive_int, default=DEFAULT_STREAM_INTERVAL, metavar="TOKENS",
                   help="tokens a streamed answer's piece gathers after the first piece (as vLLM's --stream-interval; "
                        f"1: every token its own piece; default {DEFAULT_STREAM_INTERVAL})")
    p.add_argument("--kv-cache-gib", type=_positive_int, default=None,
                   help="vLLM's KV cache on a CPU machine, GiB (default: an eighth of the machine's memory, at least 1; "
                        "else $VLLM_CPU_KVCACHE_SPACE if set)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may schedule on (default: all)")
    p.add_argument("--jwt-secret-file", default=None,
                   help="HS256 secret that tokens are verified with (default: the local development secret)")
    p.add_argument("--jwt-public-key-file", default=None, help="PEM public key (RS256/ES256) to verify tokens with")
    p.add_argument("--jwks-url", default=None, help="JWKS endpoint to verify tokens with")
    p.add_argument("--jwt-issuer", default=None, help="required `iss` of tokens (needed with public keys)")
    p.add_argument("--jwt-audience", default=None, help="required `aud` of tokens (needed with public keys)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="turn authentication off: ANY caller can read and change ANY user's memory (local demos; "
                        "refused with a --host other than loopback)")
    p.add_argument("--insecure-no-auth-on-network", action="store_true",
                   help="with --insecure-no-auth, allow a --host that is not loopback (everyone who reaches "
                        "that address is an admin)")
    p.set_defaults(fn=serve_cmd)

    p = sub.add_parser("token", help="print a bearer token for USER signed with the local development secret")
    p.add_argument("user")
    p.add_argument("--admin", action="store_true", help="add the memory:admin scope (acts for any user)")
    p.add_argument("--ttl-hours", type=float, default=24.0)
    p.add_argument("--secret-file", default=None, help="HS256 secret (default: the local development secret)")
    p.set_defaults(fn=token_cmd)

    # add / ask / list / search / get / update / delete / status: the light client's commands, with a token
    # signed by the local development secret where none is given and the server is on this machine.
    client_cli.add_commands(sub, token_fallback=client_token)


# ------------------------------------------------------------------------------------------ serve
def start(cfg, host: str = "127.0.0.1") -> None:
    """Serve's proxies and the application on the Ray this process is connected to (retried start-up)."""
    from .app import start_service

    start_service(cfg, host)


INSECURE_BANNER = """
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
!!  AUTHENTICATION IS OFF (--insecure-no-auth): anyone who can reach these ports can read, change and    !!
!!  delete ANY user's memory. Use it for a local demo only, never on a shared network.                    !!
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
"""


def auth_settings(args) -> dict:
    """`serve`'s auth flags -> ServiceConfig.auth (key files by path: the secret never enters a config)."""
    from .auth import ensure_dev_secret

    if args.insecure_no_auth:
        return {"insecure_no_auth": True}
    if args.jwt_public_key_file or args.jwks_url:
        # With public keys the server holds no HS256 secret; the issuer and audience are required (auth.py).
        out = {"public_key_file": args.jwt_public_key_file, "jwks_url": args.jwks_url,
               "issuer": getattr(args, "jwt_issuer", None), "audience": getattr(args, "jwt_audience", None)}
        return {k: v for k, v in out.items() if v}
    return {"hs256_secret_file": str(args.jwt_secret_file or ensure_dev_secret())}


def binding_refusal(args) -> str | None:
    """Why `serve` must not start with these flags: auth off on an address other than loopback, unless the
    second, explicit flag says so."""
    if args.insecure_no_auth and not _is_loopback(args.host) and not args.insecure_no_auth_on_network:
        return (f"--insecure-no-auth with --host {args.host} would make everyone who reaches that address an "
                "admin of every user's memory; use --host 127.0.0.1, or add --insecure-no-auth-on-network "
                "if that is really meant")
    return None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def store_settings(args) -> dict:
    """ServiceConfig.store_options from --kv-disk-budget-gib ({}: the engine derives the budget from the disk)."""
    if args.kv_disk_budget_gib is None:
        return {}
    return {"disk_budget_bytes": int(args.kv_disk_budget_gib * (1 << 30))}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def local_cluster_tier(args, stack: contextlib.ExitStack) -> dict:
    """With --local-mooncake: a Mooncake Store here (a master on loopback and one segment, stopped with serve), so
    that one machine runs the cluster's KV path: the encoder pool writes a fact's KV there once and vLLM's
    connector worker loads what a request needs itself, asynchronously, instead of the KV crossing the engine
    core's RPC channel. Not the default: Mooncake's transfer and handshake ports listen on every interface
    (MC_TCP_BIND_ADDRESS does not bind them in 0.3.13), and serve's default binds nothing beyond loopback.
    {} otherwise (the RPC path)."""
    from .local_mooncake import MooncakeMissing, local_mooncake, mooncake_binary

    if not args.local_mooncake:
        return {}
    try:
        mooncake_binary("mooncake_master")
        import mooncake.store  # noqa: F401 - also needs libibverbs1, even over TCP
    except (MooncakeMissing, ImportError, OSError) as e:
        raise SystemExit(f"inferscale serve --local-mooncake: Mooncake cannot start ({str(e)[:200]}); "
                         "pip install 'inferscale[mooncake]' and apt-get install libibverbs1") from None
    gib = args.mooncake_segment_gib or max(1.0, machine_memory_bytes() / 16 / 2**30)
    store = stack.enter_context(local_mooncake(segment_bytes=int(gib * (1 << 30))))
    args.local_mooncake_gib = gib
    return dict(store.config)


def _cluster_line(args, cluster: dict) -> str:
    if not cluster:
        return "none: KV through the engine's RPC channel (--local-mooncake or --mooncake-master for the cluster path)"
    from inferscale_core.cluster_store import ClusterConfig  # imports torch (~2 s): only when serve uses a store

    config = ClusterConfig.from_dict(cluster)
    cap = config.user_cap() if config else None
    share = f"each user's KV at most {cap / 2**20:.0f} MiB" if cap else ""
    if getattr(args, "local_mooncake_gib", None):
        return (f"Mooncake Store started by serve ({args.local_mooncake_gib:.1f} GiB; {share}{'; ' if share else ''}"
                f"its transfer ports listen on every interface), master {cluster['master']}")
    pool = f"pool {cluster.get('pool_bytes', 0) / 2**30:g} GiB"
    return f"Mooncake Store, master {cluster['master']} ({pool}{'; ' if share else ''}{share})"


def cluster_store_settings(args) -> dict:
    """ServiceConfig.cluster_store from --mooncake-master / --mooncake-pool-gib / --mooncake-metadata ({} without a
    master). Called before anything starts, so a refusal leaves nothing running."""
    if args.local_mooncake and (args.mooncake_master or args.mooncake_pool_gib is not None):
        # serve's own store has its pool from --mooncake-segment-gib; one cluster tier, not two
        raise SystemExit("inferscale serve: --local-mooncake starts its own store (sized by --mooncake-segment-gib); "
                         "it does not go with --mooncake-master or --mooncake-pool-gib")
    if (args.mooncake_master is None) != (args.mooncake_pool_gib is None):
        # Without the pool an external store would have no per-user share (ClusterConfig.user_cap None): one
        # tenant's KV could flush every other's out of the master's LRU (services/kv_tier_share.py).
        raise SystemExit("inferscale serve: --mooncake-master and --mooncake-pool-gib go together: each user's "
                         "share of the cluster KV tier is taken from the memory segments of the store that master "
                         "serves (--mooncake-pool-gib GIB, all its segments together)")
    if not args.mooncake_master:
        if args.mooncake_metadata:
            raise SystemExit("--mooncake-metadata needs --mooncake-master")
        return {}
    host, _, port = args.mooncake_master.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"--mooncake-master must be HOST:PORT, got {args.mooncake_master!r}")
    return {"master": args.mooncake_master, "pool_bytes": int(args.mooncake_pool_gib * (1 << 30)),
            **({"metadata": args.mooncake_metadata} if args.mooncake_metadata else {})}


# SIGTERM (docker stop, systemctl stop, kill) and SIGINT (Ctrl-C) stop `serve` at any point, start-up included; the
# stop is as below, and every step is bounded (docs/deploy.md, "Stopping `inferscale serve`"):
#   Serve's graceful shutdown: idle replicas stop after Serve's 2 s wait loop; a replica still streaming an answer
#     keeps it until serve.shutdown()'s own 30 s (not the replicas' graceful_shutdown_timeout_s, 300 s, which is for
#     scale-down inside a running cluster: an operator stopping the machine's service waits for no more than 30 s);
#   ray.shutdown(): Ray's processes, SIGTERM and SIGKILL after 1 s each;
#   the Mooncake Store serve started (terminate, SIGKILL after 10 s);
#   what is left of serve's descendants (a vLLM engine-core process whose Ray worker was killed): SIGTERM, then
#     SIGKILL after LEFTOVER_GRACE_S. serve is their subreaper (_become_subreaper), so orphans are still found.
# A second signal during the stop is ignored: cutting it short would leave processes behind.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
LEFTOVER_GRACE_S = 3.0
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


class StopRequested(BaseException):
    """SIGTERM or SIGINT arrived. Raised in the main thread wherever `serve` is (starting Ray, waiting for the engine,
    serving), like KeyboardInterrupt, so a stop during the minute-long start-up does not wait for it to finish."""


def _raise_stop(signum, _frame) -> None:
    _on_stop_signals(signal.SIG_IGN)  # from here on the stop runs to its end: a second signal is ignored
    raise StopRequested(signal.Signals(signum).name)


def _on_stop_signals(handler) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def serve_cmd(args) -> int:
    _become_subreaper()
    _on_stop_signals(_raise_stop)
    stack = contextlib.ExitStack()  # a local Mooncake Store, if serve starts one: stopped after Serve and Ray
    try:
        return _serve(args, stack)
    except StopRequested as e:
        print(f"{e} received", flush=True)
        return 0
    finally:
        _on_stop_signals(signal.SIG_IGN)  # also when _serve returned or raised
        _stop_everything(stack)
        _on_stop_signals(signal.SIG_DFL)


def _stop_everything(stack: contextlib.ExitStack) -> None:
    """Serve and Ray, then the Mooncake Store, then any descendant still running; says how long it took."""
    import ray

    if not (ray.is_initialized() or _descendants(os.getpid())):
        stack.close()
        return  # refused before anything started
    t = time.monotonic()
    print("stopping ...", flush=True)
    with contextlib.ExitStack() as steps:  # each step runs even if one before it raised, last registered first
        steps.callback(lambda: print(f"stopped in {time.monotonic() - t:.1f} s", flush=True))
        steps.callback(_stop_leftovers)
        steps.push(stack)
        _stop_ray()


def _stop_ray() -> None:
    """Serve's app and proxies (their graceful shutdown, at most serve.shutdown()'s 30 s), then the local Ray."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def _become_subreaper() -> None:
    """Makes this process the subreaper of its descendants (Linux): a process whose parent dies (a vLLM engine-core
    process when Ray kills its worker) is re-parented here instead of to init, so _stop_leftovers still finds it.
    Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _descendants(root: int) -> list[int]:
    """Every live descendant of `root`, from /proc (Linux; [] elsewhere)."""
    from pathlib import Path

    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _stop_leftovers() -> None:
    """Ends what is left of this process's descendants after Ray and the Mooncake Store stopped: SIGTERM, SIGKILL
    after LEFTOVER_GRACE_S, each reaped; says how many there were."""
    left = _descendants(os.getpid())
    if left:
        print(f"ending {len(left)} leftover processes: {', '.join(_command(pid) for pid in left)}", flush=True)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while time.monotonic() < deadline and _descendants(os.getpid()):
        _reap()
        time.sleep(0.1)
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.1)
    _reap()


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f"{f.read().strip()} ({pid})"
    except OSError:
        return str(pid)


def _reap() -> None:
    """Collects the exit status of every finished child (as a subreaper, orphans' too): no zombie is left."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _serve(args, stack: contextlib.ExitStack) -> int:
    import ray

    from inferscale_core.cache import cache_dir

    from .app import ServiceConfig, serve_start_env, single_node_deployments
    from .registry import redacted

    refusal = binding_refusal(args)
    if refusal:
        print(f"inferscale serve: {refusal}", file=sys.stderr)
        return 2
    external_store = cluster_store_settings(args)  # its flags refused now, before Redis, Ray or a store starts
    if args.redis_url:  # a registry that cannot be reached: say so now, never report the service ready
        try:
            from .registry import RedisRegistry

            RedisRegistry(args.redis_url).ping()
        except Exception as e:  # noqa: BLE001 - any failure to reach it
            print(f"inferscale serve: the registry at {redacted(args.redis_url)} cannot be reached "
                  f"({type(e).__name__}: {str(e)[:200]}); start Redis or fix --redis-url", file=sys.stderr)
            return 1
    dtype, why = (args.dtype, "--dtype") if args.dtype != "auto" else serving_dtype()
    print(f"dtype {dtype} ({why})", flush=True)
    cfg = ServiceConfig(model_path=args.model, registry_url=args.redis_url, dtype=dtype,
                        max_model_len=args.max_model_len, stream_interval=args.stream_interval,
                        query_dtype=args.query_dtype,
                        http_port=args.http_port, grpc_port=args.grpc_port,
                        kv_dir=args.kv_dir or str(cache_dir() / "kv"), store_options=store_settings(args),
                        deployments=single_node_deployments(),
                        cluster_store=external_store or local_cluster_tier(args, stack),
                        auth=auth_settings(args))
    if args.insecure_no_auth:
        print(INSECURE_BANNER, file=sys.stderr, flush=True)
    # The local Ray, Serve's controller and its proxies inherit it; the gRPC proxy binds --host (proxy_setup.py).
    proxy_env = serve_start_env(args.host)
    engine_env = vllm_cpu_env(serving_kv_cache_gib())  # a value already in the environment wins, but not over the flag
    if args.kv_cache_gib is not None:
        engine_env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    os.environ.update({**engine_env, **proxy_env})
    print(f"starting Ray and the InferScale app ({args.model or 'SmolLM2-135M-Instruct, embedded'}); "
          "the engine takes about a minute on a small CPU ...", flush=True)
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, logging_level=logging.ERROR,
             runtime_env={"env_vars": {**engine_env, **proxy_env}})  # for every Ray worker
    _on_stop_signals(_raise_stop)  # ray.init put its own SIGTERM handlers in (sys.exit; a node drain) in place of ours
    t = time.monotonic()
    start(cfg, args.host)
    print(f"ready in {time.monotonic() - t:.0f} s\n"
          f"  gRPC  inferscale.v1.Memory   {args.host}:{cfg.grpc_port}\n"
          f"  HTTP  POST /v1/chat/completions   http://{args.host}:{cfg.http_port}\n"
          f"  registry  {redacted(cfg.registry_url) if cfg.registry_url else 'in memory (Ray actor; pass --redis-url to keep facts)'}\n"
          f"  KV disk tier  {cfg.kv_dir}, budget "
          f"{f'{args.kv_disk_budget_gib:g} GiB' if args.kv_disk_budget_gib else 'a quarter of the free disk'}\n"
          f"  KV cluster tier  {_cluster_line(args, cfg.cluster_store)}\n"
          f"  auth  {_auth_line(cfg.auth)}\n"
          f"  logs  {_serve_logs_dir()} (each replica's; not echoed here: services/app.py SERVE_REQUEST_PATH_ENV)\n"
          f"try: inferscale add alice \"Alice has a cat named Pixel.\" --target 127.0.0.1:{cfg.grpc_port}",
          flush=True)
    if args.insecure_no_auth:
        print(INSECURE_BANNER, file=sys.stderr, flush=True)
    while True:  # until SIGTERM or SIGINT raises StopRequested here (serve_cmd stops everything)
        time.sleep(3600)


def _serve_logs_dir() -> str:
    """Where this machine's Ray writes Serve's logs: the session folder of the Ray started here."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)  # Ray keeps no public accessor for it
    session = node.get_session_dir_path() if node is not None else "/tmp/ray/session_latest"
    return f"{session}/logs/serve/"


def _auth_line(auth: dict) -> str:
    if auth.get("insecure_no_auth"):
        return "OFF (--insecure-no-auth)"
    if "hs256_secret_file" in auth and len(auth) == 1:
        return (f"bearer tokens (HS256, secret {auth['hs256_secret_file']}); "
                "`inferscale token USER` prints one")
    return f"bearer tokens ({', '.join(f'{k}={v}' for k, v in auth.items())})"


# ------------------------------------------------------------------------------------------ client
LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def _is_local(target: str) -> bool:
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or target.startswith("[") else target
    return host in LOCAL_HOSTS


def client_token(args, user: str) -> str | None:
    """--token, else $INFERSCALE_TOKEN, else (a server on this machine) one signed with the dev secret."""
    from .auth import mint, read_dev_secret

    token = args.token or os.environ.get("INFERSCALE_TOKEN")
    if token:
        return token
    if _is_local(args.target):
        secret = read_dev_secret()
        if secret is not None:
            return mint(secret, user, ttl_s=600)
    return None


def token_cmd(args) -> int:
    from pathlib import Path

    from .auth import SCOPE_ADMIN, USER_SCOPES, ensure_dev_secret, mint

    path = Path(args.secret_file) if args.secret_file else ensure_dev_secret()
    scopes = (*USER_SCOPES, SCOPE_ADMIN) if args.admin else USER_SCOPES
    print(f"# token for {args.user!r}, scopes {' '.join(scopes)}, valid {args.ttl_hours:g} h, signed with {path}\n"
          "# send it as the gRPC metadata / HTTP header  authorization: Bearer <token>", file=sys.stderr)
    print(mint(path.read_bytes().strip(), args.user, scopes, ttl_s=args.ttl_hours * 3600))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m inferscale_server.cli ...` (the same commands as `inferscale ...`)."""
    parser = argparse.ArgumentParser(prog="python -m inferscale_server.cli", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
