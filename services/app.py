"""The Serve application and its config: the ONE place that says which deployments exist, how they are wired,
and with which resources and autoscaling.

    build_app(cfg)          the Application (serve.run(build_app(cfg)) in Python)
    app_builder(args)       what a Serve config's import_path names (`inferscale_server.app:app_builder`); args -> cfg
    serve_config(cfg)       the Serve config file (serveConfigV2 of a KubeRay RayService) for cfg
    python -m inferscale_server.app --emit-serve-config charts/inferscale/files/serve-config.yaml
                            writes serve_config for the chart's default values (tests/packaging/test_chart.py checks
                            that the committed file, the chart's rendering and this module agree)

Per-deployment numbers come from the chart's values (`ServiceConfig.from_chart_values`), so the chart and
this module share one vocabulary: minReplicas, maxReplicas, targetOngoingRequests, numCpus, numGpus.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from .api import SERVICER_FUNCTION
from .gateway.core import WATCH_STREAMS_MAX
from .kv_tier_share import smallest_pool_bytes
from .limits import Limits
from .messages import DEFAULT_STREAM_INTERVAL

# TRANSPORT_MAX_MESSAGE_BYTES: a gRPC message or an HTTP body; one request: Limits (1 MiB)
from .proxy_setup import GRPC_HOST_ENV, TRANSPORT_MAX_MESSAGE_BYTES
from .registry import ACTOR_SCHEME

APP_NAME = "inferscale"
IMPORT_PATH = "inferscale_server.app:app_builder"
DEPLOYMENTS = ("Gateway", "EncoderPool", "Retrieval", "EngineReplica")
# The chart's values.yaml; a link in the repository, a copy in the wheel (package data), so --emit-serve-config works
# from an installed wheel with no charts/ beside it.
CHART_VALUES = Path(__file__).parent / "chart_values.yaml"
# The Limits typed float, which the chart casts (limits_for; templates/_helpers.tpl names the same three).
FLOAT_LIMITS = tuple(f.name for f in fields(Limits) if f.type == "float")


# Serve's defaults assume an idle machine: a proxy must pass its readiness check within 5 s, and misses three
# in a row kill it (serve.start then raises ActorDiedError on a 2-core machine that another process keeps
# busy, issue 10). The controller reads these at import, so they belong in the environment of the Ray that
# Serve starts on: `ray.init(runtime_env={"env_vars": SERVE_START_ENV})` or `export` before `ray start`.
#
# The same environment carries the proxies' transport limits (read when a proxy process imports Ray Serve):
# Serve's gRPC proxy accepts messages up to 2 GiB unless RAY_SERVE_GRPC_MAX_MESSAGE_SIZE says less, and it
# buffers a whole message before anything of ours runs; services/proxy_setup.py (Serve's proxy callback) limits
# HTTP bodies in the HTTP proxy and binds the gRPC proxy where INFERSCALE_GRPC_HOST says.
#
# And Serve's request path as Ray's own throughput mode (RAY_SERVE_THROUGHPUT_OPTIMIZED, Ray 2.55+) sets it, without
# that mode's direct ingress (no proxies: our proxy callback holds the body limits) or its gRPC data plane between
# replicas (no gain beyond the spread in its one run; not checked that a response handed from the encoder pool to
# an engine replica stays out of the gateway): a replica runs our code on its own event loop and its
# handles' routers there too, instead of a thread each that every request crosses twice; the per-request access
# log is buffered (1,000 lines, flushed at once on an ERROR line) and written to Serve's log files only, not to
# stderr, which Ray's log monitor would ship to the driver line by line. Measured through the service (BENCHMARKS.md,
# "Serve's request path"): the CPU per KV answer outside vLLM at N=100 fell by about a fifth. The cost: a Serve
# handle may then be used only from inside an event loop (services/observe.py asks from one), and a replica's logs
# are in Ray's session folder (logs/serve/), not on the console of `inferscale serve`.
SERVE_REQUEST_PATH_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                          "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
                          "RAY_SERVE_LOG_TO_STDERR": "0", "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000"}
# Serve's controller runs its control loop every 0.5 s instead of 0.1 s. Each turn asks Ray's GCS which nodes are
# alive and what resources they have, and runs every deployment's autoscaling policy, whatever the load: about 45 ms
# of CPU a second at 0.1 s on the reference node, 4 ms of every KV answer at N=100 (BENCHMARKS.md, "Serve's control
# loop"). What waits on a turn: a replica's start, stop or death noticed up to 0.4 s later, and autoscaling decisions,
# whose delays are in seconds (upscale_delay_s), not turns. The controller runs on the head node only, so the cluster
# file sets it there; the chart sets it in every Ray pod with the rest of SERVE_START_ENV.
SERVE_CONTROL_LOOP_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
SERVE_START_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
                   "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(TRANSPORT_MAX_MESSAGE_BYTES),
                   "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "inferscale_server.proxy_setup:proxy_setup",
                   **SERVE_REQUEST_PATH_ENV, **SERVE_CONTROL_LOOP_ENV}


def serve_start_env(host: str) -> dict[str, str]:
    """SERVE_START_ENV with the gRPC proxy bound to `host` (Serve's own binds every interface; an HTTP proxy's
    host is Serve's http_options): what a Ray that serves this app on one address needs."""
    return {**SERVE_START_ENV, GRPC_HOST_ENV: host}


# How long a replica being stopped (scale-down, upgrade) keeps serving the requests it has: an answer streams for
# up to max_max_tokens tokens, minutes on a CPU. Serve's default is 20 s. Set in code, so a Serve config that
# does not name it keeps it.
GRACEFUL_SHUTDOWN_S = {"Gateway": 300.0, "EngineReplica": 300.0}
GATEWAY_MAX_QUEUED = 1024  # requests waiting for a gateway replica before Serve sheds load (429)
# The encoder pool's process environment. glibc gives each allocating thread a malloc arena (up to 8 per core)
# that keeps freed memory; the pool encodes on a thread pool, so each arena keeps a forward's worth (~230 MB
# more RSS, BENCHMARKS.md). glibc reads MALLOC_ARENA_MAX when the process starts: a mallopt from the replica's
# constructor came after Ray's own threads had made theirs (16 arenas measured in a running pool).
# MALLOC_MMAP_THRESHOLD_ fixed at 1 MiB: glibc's dynamic threshold climbs to 32 MiB after the first large free,
# after which a forward's variable-sized activations come from the heap and fragment it (a slow RSS rise);
# fixed, they are mapped and unmapped (BENCHMARKS.md, "The oneDNN-cache guess, tested", run D).
# GOMP_SPINCOUNT: how long a thread of torch's OpenMP runtime (libgomp in torch's wheels) spins at a barrier before
# it sleeps; 300,000 iterations by default. The pool's forwards run a thread per core, each a series of parallel
# regions ending in a barrier; on a CPU node the engine and the light work hold cores too, and the thread that
# arrived first spun through its core's time slice while the other waited for a core: beside a generating engine
# the pool encoded at half the speed with 2.6x the CPU per fact, and the engine lost a third of its tokens/s
# (bench/omp_wait.py, BENCHMARKS.md "The encoder's OpenMP threads at a barrier"). A short spin keeps a free
# core's barriers fast (alone, the pool encodes as fast as with the default) and sleeps when a core is taken.
# libgomp reads it when the process starts.
ENCODER_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "1048576", "GOMP_SPINCOUNT": "1000"}


@dataclass
class DeploymentSpec:
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 8
    # Requests Serve sends one replica at once. Large: the engine replica's own admission (sized from its KV
    # cache) decides what runs, so Serve must not queue in front of it.
    max_ongoing_requests: int = 256
    # Requests a deployment's callers may queue when every replica is at max_ongoing_requests; beyond that Serve
    # refuses at once (HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED). -1: unbounded (Serve's default).
    max_queued_requests: int = -1
    num_cpus: float = 1
    num_gpus: float = 0
    # A replica busy with a long CPU prefill or a model load answers its health check late; Serve's 30 s
    # default would restart it in the middle of start-up on a loaded machine.
    health_check_period_s: float = 10
    health_check_timeout_s: float = 120
    # Seconds the load must stay above / below target before autoscaling adds / removes a replica.
    upscale_delay_s: float = 10
    downscale_delay_s: float = 300
    # A replica being stopped waits at least this long, then until its requests in flight are done, checking again
    # every this many seconds (Serve's graceful_shutdown_wait_loop_s): the window in which routers that have not yet
    # heard of the stop may still send it requests. None: Serve's default (2 s); the tests' apps, stopped with
    # nothing in flight, use 0.2 s (tests/support/local_service.py).
    graceful_shutdown_wait_loop_s: float | None = None

    def options(self) -> dict:
        """Serve deployment options. Autoscaling follows ongoing requests per replica."""
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"replicas must satisfy 0 <= min <= max, max >= 1; got {self.min_replicas}, "
                             f"{self.max_replicas}")
        drain = {} if self.graceful_shutdown_wait_loop_s is None else {
            "graceful_shutdown_wait_loop_s": self.graceful_shutdown_wait_loop_s}
        return {
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "backpressure_config": {"status_code": 429, "retry_after_s": 1.0},
            "autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                   "initial_replicas": max(self.min_replicas, 1),
                                   "target_ongoing_requests": self.target_ongoing_requests,
                                   "upscale_delay_s": self.upscale_delay_s,
                                   "downscale_delay_s": self.downscale_delay_s},
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            **drain,
        }


def _default_deployments() -> dict[str, DeploymentSpec]:
    # CPU-only defaults (a laptop, CI); the chart's values give the GPU layout.
    return {
        "Gateway": DeploymentSpec(1, 2, target_ongoing_requests=64, max_ongoing_requests=512,
                                  max_queued_requests=GATEWAY_MAX_QUEUED),
        "EncoderPool": DeploymentSpec(1, 2, target_ongoing_requests=4, max_ongoing_requests=16),
        "Retrieval": DeploymentSpec(1, 2, target_ongoing_requests=32, max_ongoing_requests=256),
        "EngineReplica": DeploymentSpec(1, 1, target_ongoing_requests=16, max_ongoing_requests=512),
    }


def single_node_deployments() -> dict[str, DeploymentSpec]:
    """One replica of each deployment in 1.5 CPUs: fits a 2-core machine (`inferscale serve`, the e2e test).
    The CPU numbers are Ray's scheduling shares; vLLM and torch use the cores they are given by the env."""
    cpus = {"Gateway": 0.25, "EncoderPool": 0.5, "Retrieval": 0.25, "EngineReplica": 0.5}
    specs = {name: DeploymentSpec(1, 1, num_cpus=n) for name, n in cpus.items()}
    # Serve must not queue in front of the engine's admission; the gateway's queue is bounded (load shedding).
    specs["Gateway"].max_ongoing_requests, specs["Gateway"].max_queued_requests = 512, GATEWAY_MAX_QUEUED
    specs["EngineReplica"].max_ongoing_requests = 512
    specs["EncoderPool"].max_ongoing_requests = 32
    return specs


@dataclass
class ServiceConfig:
    model_path: str | None = None       # None: the packaged SmolLM2-135M-Instruct
    embedder_path: str | None = None    # None: the packaged MiniLM
    registry_url: str | None = None     # None: an in-memory registry in a named Ray actor (lives as long as Ray)
    dtype: str = "float32"
    block_size: int = 32
    max_model_len: int | None = None     # None: the model's own context (8,192 for SmolLM2)
    http_port: int = 8000
    grpc_port: int = 9000
    limits: dict = field(default_factory=dict)  # overrides of limits.Limits
    engine_overrides: dict = field(default_factory=dict)  # extra vLLM engine args, e.g. gpu_memory_utilization
    # Engine replica admission: tokens in flight (prompt + max_tokens) may reach the KV cache's size times
    # this before requests are refused with RESOURCE_EXHAUSTED / 429 (services/admission.py).
    admission_queue_factor: float = 2.0
    # Disk tier of each engine replica's fact store (node-local; a restarted replica reloads from it instead
    # of re-encoding). None: no disk tier. store_options: the worker store's byte budgets.
    kv_dir: str | None = None
    store_options: dict = field(default_factory=dict)
    # The cluster KV tier (Mooncake Store; inferscale_core.cluster_store.ClusterConfig fields: master, metadata,
    # ...). Empty: none, each engine replica's own tiers only (a moved user's facts are encoded again).
    cluster_store: dict = field(default_factory=dict)
    # On a CPU node with several engine replicas: cores each replica's vLLM binds to, disjoint by the replica's
    # node-local rank (services/engine_replica/placement.py bind_engine_cpus). 0: one engine per node, on every
    # core but one, which the light work keeps (gateway, retrieval, proxies; vllm_env.LIGHT_WORK_CORES).
    engine_cpu_cores: int = 0
    # Tokens a streamed answer's piece gathers after each choice's first (vLLM's --stream-interval; 1: every token
    # its own piece; services/engine_replica/answering.py PieceCoalescer).
    stream_interval: int = DEFAULT_STREAM_INTERVAL
    # The dtype the retrieval replicas embed a query in (facts: float32 always). auto: bfloat16 where the replica's
    # device computes it natively (a CPU with avx512_bf16 or amx_bf16, a CUDA GPU with bf16), else float32
    # (services/retrieval.py RetrievalConfig.query_dtype; bench/query_dtype.py).
    query_dtype: str = "auto"
    # services/auth.py AuthConfig fields; secrets only by file path or environment variable. Empty: JWT auth
    # with the key from $INFERSCALE_JWT_SECRET / _SECRET_FILE / _PUBLIC_KEY_FILE / _JWKS_URL.
    auth: dict = field(default_factory=dict)
    # The HTTP front door (services/gateway/http_front.py HttpConfig): served_model_names (the OpenAI `model`
    # names accepted; default ["inferscale"]), cors_allow_origins (browser origins allowed; default none).
    http: dict = field(default_factory=dict)
    deployments: dict[str, DeploymentSpec] = field(default_factory=_default_deployments)

    def __post_init__(self):
        from .retrieval import check_query_dtype

        check_query_dtype(self.query_dtype)  # before anything deploys: the retrieval replicas would fail to start

    def app_args(self) -> dict:
        """What app_builder receives (the Serve config's `args`)."""
        return {"model_path": self.model_path, "embedder_path": self.embedder_path,
                "registry_url": self.registry_url, "dtype": self.dtype, "block_size": self.block_size,
                "max_model_len": self.max_model_len, "limits": dict(self.limits),
                "engine_overrides": dict(self.engine_overrides),
                "admission_queue_factor": float(self.admission_queue_factor), "kv_dir": self.kv_dir,
                "store_options": dict(self.store_options), "cluster_store": dict(self.cluster_store),
                "stream_interval": self.stream_interval, "query_dtype": self.query_dtype,
                **({"engine_cpu_cores": self.engine_cpu_cores} if self.engine_cpu_cores else {}),
                **({"auth": dict(self.auth)} if self.auth else {}),
                **({"http": dict(self.http)} if self.http else {})}

    def encoder_pool_config(self, registry_url: str | None = None):
        """The EncoderPool's config (services/encoder_pool.py: checked when made); `registry_url`: where it books
        each user's share of the cluster tier."""
        from .encoder_pool import EncoderPoolConfig

        return EncoderPoolConfig(model_path=self.model_path, dtype=self.dtype, cluster_store=dict(self.cluster_store),
                                 registry_url=registry_url)

    def retrieval_config(self, registry_url: str):
        """The Retrieval deployment's config (services/retrieval.py: checked when made)."""
        from .retrieval import RetrievalConfig

        return RetrievalConfig(registry_url=registry_url, embedder_path=self.embedder_path,
                               query_dtype=self.query_dtype)

    def engine_replica_config(self, registry_url: str):
        """The EngineReplica's config (services/engine_replica/config.py: checked when made)."""
        from .engine_replica import EngineReplicaConfig

        return EngineReplicaConfig(registry_url=registry_url, model_path=self.model_path, dtype=self.dtype,
                                   block_size=self.block_size, max_model_len=self.max_model_len, kv_dir=self.kv_dir,
                                   store_options=dict(self.store_options),
                                   engine_overrides=dict(self.engine_overrides),
                                   admission_queue_factor=float(self.admission_queue_factor),
                                   cluster_store=dict(self.cluster_store),
                                   engine_cpu_cores=self.engine_cpu_cores, stream_interval=self.stream_interval)

    @classmethod
    def from_args(cls, args: dict | None) -> "ServiceConfig":
        args = dict(args or {})
        known = {f.name for f in fields(cls)} - {"deployments", "http_port", "grpc_port"}
        unknown = set(args) - known
        if unknown:
            raise ValueError(f"unknown application args: {sorted(unknown)}; known: {sorted(known)}")
        Limits(**args.get("limits", {}) or {})  # fail early on a misspelled limit
        from .gateway.http_front import HttpConfig

        HttpConfig.from_dict(args.get("http"))  # and on a misspelled HTTP setting
        return cls(**args)

    @classmethod
    def from_chart_values(cls, values: dict, release: str = "inferscale") -> "ServiceConfig":
        """The config a chart release with these values runs (the template applies the same mapping)."""
        deps = {}
        for name in DEPLOYMENTS:
            v = values["deployments"][name]
            # Casts as in the chart's template (`--set x=0.5` gives a string there).
            deps[name] = DeploymentSpec(min_replicas=int(v["minReplicas"]), max_replicas=int(v["maxReplicas"]),
                                        target_ongoing_requests=float(v["targetOngoingRequests"]),
                                        max_ongoing_requests=int(v["maxOngoingRequests"]),
                                        max_queued_requests=int(v.get("maxQueuedRequests", -1)),
                                        num_cpus=float(v["numCpus"]), num_gpus=float(v["numGpus"]))
        return cls(model_path=values["model"]["path"], embedder_path=values["model"].get("embedderPath"),
                   registry_url=registry_url_for(values, release), dtype=values["model"]["dtype"],
                   block_size=int(values["model"]["blockSize"]), max_model_len=int(values["model"]["maxModelLen"]) if values["model"].get("maxModelLen") else None,
                   http_port=int(values["ports"]["http"]), grpc_port=int(values["ports"]["grpc"]),
                   limits=limits_for(values),
                   engine_overrides=dict(values["model"].get("engineOverrides") or {}),
                   admission_queue_factor=float(values["model"].get("admissionQueueFactor", 2.0)),
                   stream_interval=int(values["model"].get("streamInterval", DEFAULT_STREAM_INTERVAL)),
                   query_dtype=values["model"].get("queryDtype", "auto"),
                   kv_dir=values["kvStore"]["dir"], store_options=store_options_for(values),
                   cluster_store=cluster_store_for(values, release), auth=auth_args_for(values), deployments=deps)


def limits_for(values: dict) -> dict:
    """The chart's `limits` (overrides of Limits), those typed float cast as the template casts them: `--set
    limits.work_units_per_s_per_caller=0.5` hands Helm a string, which Limits would keep until a gateway computed
    with it."""
    limits = dict(values.get("limits") or {})
    for key in FLOAT_LIMITS:
        if key in limits:
            limits[key] = float(limits[key])
    return limits


def store_options_for(values: dict) -> dict:
    """The chart's kvStore.options, with diskBudgetGiB as the disk tier's budget in bytes (when there is a disk)."""
    kv = values["kvStore"]
    options = dict(kv.get("options") or {})
    if kv.get("dir") and kv.get("diskBudgetGiB"):
        options["disk_budget_bytes"] = int(float(kv["diskBudgetGiB"]) * (1 << 30))
    return options


def cluster_store_for(values: dict, release: str) -> dict:
    """The chart's Mooncake master (its Service) as the engine replicas' and encoders' cluster KV tier; the pod IP
    comes from $POD_IP at run time (ClusterConfig.local_host), the segment size from the values."""
    m = values.get("mooncake") or {}
    if not m.get("enabled"):
        return {}
    host = f"{release}-mooncake"
    ray = values["ray"]
    groups = [(int(ray["cpuWorkers"]["minReplicas"]), int(m["cpuSegmentGiB"]) << 30)]
    if int(ray["gpuWorkers"]["maxReplicas"]) > 0:
        groups.append((int(ray["gpuWorkers"]["minReplicas"]), int(m["segmentGiB"]) << 30))
    # Each user's share is derived from the pool the cluster always has: its worker groups' minReplicas pods.
    return {"master": f"{host}:{m['rpcPort']}", "lease_s": float(m["leaseSeconds"]), "replicas": int(m["replicas"]),
            "pool_bytes": smallest_pool_bytes(groups), "tenants": int(m["tenants"])}


def auth_args_for(values: dict) -> dict:
    """The chart's auth values -> ServiceConfig.auth: only what is not a secret (the HS256 key reaches the pods
    as $INFERSCALE_JWT_SECRET from a Kubernetes Secret)."""
    a = values.get("auth") or {}
    if a.get("insecureNoAuth"):
        return {"insecure_no_auth": True}
    return {arg: a[key] for arg, key in (("jwks_url", "jwksUrl"), ("issuer", "issuer"), ("audience", "audience"))
            if a.get(key)}


REDIS_TLS_DIR = "/var/run/secrets/inferscale/redis-tls"  # the chart's mount of redis.tls.caSecret


def registry_url_for(values: dict, release: str) -> str:
    """Redis inside the release (the chart's StatefulSet), or the external URL the values name with their seeds
    and TLS CA (the chart's inferscale.registryUrl, which also refuses bad values)."""
    redis = values["redis"]
    if redis["enabled"]:
        return f"redis://{release}-redis:{redis['port']}/0"
    tls = redis.get("tls") or {}
    opts = ([f"seeds={','.join(redis['seeds'])}"] if redis.get("seeds") else []) + (
        [f"ssl_ca_certs={REDIS_TLS_DIR}/{tls.get('caKey', 'ca.crt')}"] if tls.get("caSecret") else [])
    url = redis["externalUrl"]
    return f"{url}{'&' if '?' in url else '?'}{'&'.join(opts)}" if opts else url


def deployment_options(cfg: ServiceConfig) -> dict[str, dict]:
    missing = set(DEPLOYMENTS) - set(cfg.deployments)
    if missing:
        raise ValueError(f"deployment specs missing for {sorted(missing)}")
    opts = {name: cfg.deployments[name].options() for name in DEPLOYMENTS}
    opts["EncoderPool"]["ray_actor_options"]["runtime_env"] = {"env_vars": dict(ENCODER_ENV)}
    # Open health Watch streams take slots of their own, never the users' (the chart adds the same).
    opts["Gateway"]["max_ongoing_requests"] += WATCH_STREAMS_MAX
    return opts


def build_app(cfg: ServiceConfig):
    """Gateway(encoder, retrieval, engine) over the three backend deployments."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .encoder_pool import EncoderPool
    from .engine_replica import EngineReplica
    from .gateway import Gateway, http_app
    from .retrieval import Retrieval
    from .routing import ROUTER_PATH, ROUTING_STATS_PERIOD_S, move_threshold

    opts = deployment_options(cfg)
    # Without Redis every replica must still see one registry: a named Ray actor holds it.
    registry_url = cfg.registry_url or f"{ACTOR_SCHEME}{APP_NAME}-registry"
    for name, seconds in GRACEFUL_SHUTDOWN_S.items():
        opts[name] = {"graceful_shutdown_timeout_s": seconds, **opts[name]}
    # A user goes to its home engine replica (a hash of its stable slot), and to the next one while the home is
    # at twice its autoscaling target (services/routing.py); Serve's default router would pick any holder.
    engine_spec = cfg.deployments["EngineReplica"]
    # Ray annotates RequestRouterConfig(**kwargs) as dict[str, Any] each (every value a dict): hence the ignores.
    opts["EngineReplica"] = {"request_router_config": RequestRouterConfig(
        request_router_class=ROUTER_PATH,  # type: ignore[arg-type]
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,  # type: ignore[arg-type]
        request_router_kwargs={"move_at": move_threshold(engine_spec.target_ongoing_requests,
                                                         engine_spec.max_ongoing_requests)}), **opts["EngineReplica"]}
    # One checked config per deployment: a mistake raises here, before Serve starts anything. (The decorator
    # form, serve.deployment(**options)(cls): the one Ray's annotations describe.)
    encoder = serve.deployment(name="EncoderPool", **opts["EncoderPool"])(EncoderPool).bind(
        cfg.encoder_pool_config(registry_url))
    retrieval = serve.deployment(name="Retrieval", **opts["Retrieval"])(Retrieval).bind(
        cfg.retrieval_config(registry_url))
    engine = serve.deployment(name="EngineReplica", **opts["EngineReplica"])(EngineReplica).bind(
        encoder, cfg.engine_replica_config(registry_url))
    gateway = serve.deployment(name="Gateway", **opts["Gateway"])(serve.ingress(http_app)(Gateway))
    return gateway.bind(encoder, retrieval, engine, registry_url=registry_url, limits=cfg.limits, auth=cfg.auth,
                        http=cfg.http)


def app_builder(args: dict):
    """Serve's application builder: `import_path: inferscale_server.app:app_builder` with `args:` in the config."""
    return build_app(ServiceConfig.from_args(args))


def start_service(cfg: ServiceConfig, host: str = "127.0.0.1", attempts: int = 3, retry_wait_s: float = 5.0,
                  proxy_location: str = "EveryNode") -> int:
    """Serve's proxies and the application on the Ray this process is connected to (`inferscale serve`, the
    tests). A start-up that fails on a busy machine (a proxy or replica actor dies before it is ready, the
    app reports DEPLOY_FAILED) is shut down and tried again, up to `attempts` times; a bad config is not
    retried. proxy_location "HeadOnly" when several Ray nodes share one address (a test on one machine).
    Returns the attempt that succeeded."""
    from ray import serve
    from ray.exceptions import RayError
    from ray.serve.config import gRPCOptions

    app = build_app(cfg)  # config mistakes raise here, before anything starts
    for attempt in range(1, attempts + 1):
        try:
            serve.start(proxy_location=proxy_location, http_options={"host": host, "port": cfg.http_port},
                        grpc_options=gRPCOptions(**grpc_options(cfg)))
            serve.run(app, name=APP_NAME, route_prefix="/")
            return attempt
        except (RayError, RuntimeError, TimeoutError) as e:
            if attempt == attempts:
                raise
            print(f"Serve start-up attempt {attempt}/{attempts} failed ({type(e).__name__}: {str(e)[:300]}); "
                  f"shutting Serve down and trying again in {retry_wait_s:g} s", file=sys.stderr, flush=True)
            serve.shutdown()
            time.sleep(retry_wait_s)
    raise AssertionError("unreachable")


def grpc_options(cfg: ServiceConfig) -> dict:
    return {"port": cfg.grpc_port, "grpc_servicer_functions": [SERVICER_FUNCTION]}


def serve_config(cfg: ServiceConfig) -> dict:
    """The Serve config file for cfg. Options set here override the code's @serve.deployment options."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": cfg.http_port},
        "grpc_options": grpc_options(cfg),
        "applications": [{
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": IMPORT_PATH,
            "args": cfg.app_args(),
            "deployments": [{"name": name, **opts} for name, opts in deployment_options(cfg).items()],
        }],
    }


def chart_serve_config(values_path: Path = CHART_VALUES, release: str = "inferscale") -> dict:
    values = yaml.safe_load(values_path.read_text())
    return serve_config(ServiceConfig.from_chart_values(values, release))


def dump(cfg: dict) -> str:
    return ("# Generated by `python -m inferscale_server.app --emit-serve-config`; do not edit (tests/packaging/test_chart.py).\n"
            + yaml.safe_dump(cfg, sort_keys=False))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m inferscale_server.app")
    p.add_argument("--emit-serve-config", metavar="PATH",
                   help="write the Serve config for the chart's default values ('-' for stdout)")
    p.add_argument("--values", default=str(CHART_VALUES), help="chart values file (default: the chart's)")
    p.add_argument("--registry-url", default=None,
                   help="registry URL instead of the chart's (a Ray cluster: redis://HEAD_IP:6390/0); keep the "
                        "password out of it, replicas read it from $INFERSCALE_REDIS_PASSWORD")
    p.add_argument("--mooncake-master", default=None, metavar="HOST",
                   help="the cluster KV tier's mooncake_master host instead of the chart's Service (a Ray cluster: "
                        "the head's address; RPC port 50051); needs --mooncake-pool-gib")
    p.add_argument("--mooncake-pool-gib", type=float, default=None, metavar="GIB",
                   help="with --mooncake-master: the memory segments that cluster always runs, the base of each "
                        "user's share of the tier (ray_cluster.yaml: gpu_worker min_workers x 16)")
    a = p.parse_args(argv)
    if not a.emit_serve_config:
        p.print_help()
        return 2
    if (a.mooncake_master is None) != (a.mooncake_pool_gib is None):
        # The chart's pool (its own pods' segments) is not that cluster's: a share taken from it would be wrong.
        p.error("--mooncake-master and --mooncake-pool-gib go together: the pool each user's share of the cluster "
                "KV tier is taken from is the segments of the cluster that master serves")
    if a.mooncake_pool_gib is not None and not 0 < a.mooncake_pool_gib < float("inf"):
        p.error(f"--mooncake-pool-gib must be a number above 0 (GiB of memory segments), got {a.mooncake_pool_gib}")
    cfg = chart_serve_config(Path(a.values))
    if a.registry_url:
        if urlsplit(a.registry_url).password:
            p.error("--registry-url must not carry a password: the Serve config is not a secret; set "
                    "INFERSCALE_REDIS_PASSWORD where Ray starts instead")
        cfg["applications"][0]["args"]["registry_url"] = a.registry_url
    if a.mooncake_master:
        cfg["applications"][0]["args"]["cluster_store"].update(master=f"{a.mooncake_master}:50051",
                                                               pool_bytes=int(a.mooncake_pool_gib * (1 << 30)))
    text = dump(cfg)
    if a.emit_serve_config == "-":
        sys.stdout.write(text)
    else:
        Path(a.emit_serve_config).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
