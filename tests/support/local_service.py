"""The whole application on a local Ray, for the test modules that start it (tests/service/one_app/ shares one for three
modules, tests/service/two_engines/ one for two; test_kv_tier_service and test_service_hotpath start their own with
other settings): `Service` (the running app, its ports, an admin client and what tests remember between steps),
the context managers that start and stop it, and waits on Serve's replicas.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from pathlib import Path

import grpc
import ray

from inferscale_server.local_processes import free_port, port_is_free
from support.auth_fixture import token_for

APP = "inferscale"
# The tests' apps poll their drain every 0.2 s, not Serve's 2 s (services/app.py DeploymentSpec): each app's stop
# waits that once per deployment, one after the other (~10 s of each module's teardown with the default).
DRAIN_POLL_S = 0.2


class Service:
    """The running application, its ports and what the tests remember between steps."""

    def __init__(self, cfg, kv_dir: Path, secret: bytes):
        self.cfg, self.kv_dir, self.secret = cfg, kv_dir, secret
        self.ids: dict[str, list[str]] = {}
        self.answers: dict[str, str] = {}
        self.start()

    def start(self) -> None:
        from inferscale_server.cli import start

        t = time.monotonic()
        start(self.cfg)  # what `inferscale serve` runs
        self.start_s = time.monotonic() - t
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.cfg.grpc_port}")
        grpc.channel_ready_future(self.channel).result(timeout=60)
        from inferscale_client import MemoryClient

        # An admin token: these tests act for several users (tests/unit/test_auth.py checks per-user tokens).
        self.client = MemoryClient(channel=self.channel, timeout_s=300,  # re-encoding on a loaded 2-core machine
                                   token=token_for(self.secret, "e2e-admin", admin=True, ttl_s=3 * 3600))

    def stop(self) -> None:
        from ray import serve

        self.channel.close()
        serve.shutdown()

    def engine_stats(self, user_id: str, timeout_s: float = 60) -> dict:
        return engine_stats(user_id, timeout_s)

    def engine_holds(self, user_id: str, facts: list[tuple[str, int]]) -> list[bool]:
        """Whether the engine's worker store holds these (fact_id, version): the KV side of a fact."""
        handle = engine_handle().options(multiplexed_model_id=user_id)
        return handle.holds.remote(user_id, facts).result(timeout_s=60)

    def ask(self, user_id: str, query: str, **kw) -> tuple[list, object]:
        """(text pieces, final chunk) of a streamed Answer."""
        chunks = list(self.client.answer(user_id, query, **kw))
        assert chunks and chunks[-1].final and not any(c.final for c in chunks[:-1])
        return [c.text for c in chunks[:-1] if c.text] + ([chunks[-1].text] if chunks[-1].text else []), chunks[-1]


# What ray.init raises when the head's processes do not come up in its 30 s waits: the GCS server's port file
# never written (RuntimeError "Timed out waiting for file"), or the raylet never registered with the GCS
# (Exception "The current node timed out during startup"). Seen in clean-clone CI runs, each time at a module's
# first start right after the previous module's Ray stopped, on an otherwise idle machine.
RAY_START_TIMEOUTS = ("Timed out waiting for file", "timed out during startup")
RAY_LOG_LINES = 15


def start_local_ray(**kw) -> None:
    """ray.init of a fresh local Ray, started once more if its head did not come up (RAY_START_TIMEOUTS); the end of
    the failed start's GCS and raylet logs is printed first, so the report says why."""
    try:
        ray.init(address="local", **kw)
    except Exception as e:  # ray.init raises a bare Exception for the raylet's timeout
        if not any(m in str(e) for m in RAY_START_TIMEOUTS):
            raise
        # A warning: the run's summary shows it even when the second start works (printed output is captured).
        warnings.warn(f"ray.init failed ({e}); starting Ray again. The failed start's logs:\n{ray_head_log_tails()}",
                      stacklevel=2)
        ray.shutdown()  # whatever the failed start left
        ray.init(address="local", **kw)


def ray_head_log_tails() -> str:
    """The last lines of the newest local Ray session's GCS server and raylet logs (Ray's default temp folder)."""
    sessions = sorted(Path("/tmp/ray").glob("session_2*"), key=lambda p: p.stat().st_mtime)
    if not sessions:
        return "(no Ray session folder)"
    out = [str(sessions[-1])]
    for name in ("gcs_server.out", "gcs_server.err", "raylet.out", "raylet.err"):
        log = sessions[-1] / "logs" / name
        lines = log.read_text(errors="replace").splitlines()[-RAY_LOG_LINES:] if log.is_file() else ["(none)"]
        out += [f"-- {name}", *lines]
    return "\n".join(out)


@contextlib.contextmanager
def service_on_local_ray(cfg, kv_dir: Path, jwt_secret, num_cpus: int = 2, env_vars: dict | None = None,
                         **ray_init):
    """The application `cfg` on a fresh local Ray (`num_cpus` logical CPUs, vLLM's CPU settings in every worker,
    Serve's proxies set up as `inferscale serve` sets them: serve_start_env), shut down with it; used by every test
    module that runs the whole app. `env_vars` go on top. `ray_init`: more ray.init arguments."""
    from inferscale_core.vllm_env import vllm_cpu_env
    from inferscale_server.app import serve_start_env

    for spec in cfg.deployments.values():  # stopped with nothing in flight: no 2 s drain window per replica
        spec.graceful_shutdown_wait_loop_s = DRAIN_POLL_S
    start_local_ray(num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR",
                    runtime_env={"env_vars": {**vllm_cpu_env(), **serve_start_env("127.0.0.1"), **(env_vars or {})}},
                    **ray_init)
    # Ray's head processes (its dashboard and autoscaler monitor) bind ports of their own at ray.init, after the
    # test picked cfg's: seen twice in full runs, Serve's gRPC proxy then failed all its attempts to bind a port
    # Ray's dashboard held (test_metrics). Ports taken meanwhile are picked again.
    if not all(port_is_free(p) for p in (cfg.http_port, cfg.grpc_port)):
        cfg = dataclasses.replace(cfg, http_port=free_port(), grpc_port=free_port())
    svc = None
    try:
        svc = Service(cfg, kv_dir, jwt_secret[1])
        yield svc
    finally:
        if svc is not None:
            svc.stop()
        ray.shutdown()


@contextlib.contextmanager
def running_service(redis_url: str, kv_dir: Path, jwt_secret, env_vars: dict | None = None,
                    http: dict | None = None, engine_health_check_period_s: float | None = None, **ray_init):
    """The application on a fresh local Ray (2 CPUs, one replica of each deployment), as tests/service/one_app/
    shares it. `http`: the HTTP front door's settings (ServiceConfig.http); `engine_health_check_period_s`: the engine
    replica's (None: the shipped default); `ray_init`: more ray.init arguments."""
    from inferscale_server.app import ServiceConfig, single_node_deployments

    deployments = single_node_deployments()
    if engine_health_check_period_s is not None:
        deployments["EngineReplica"].health_check_period_s = engine_health_check_period_s
    cfg = ServiceConfig(registry_url=redis_url, kv_dir=str(kv_dir), max_model_len=2048,
                        http_port=free_port(), grpc_port=free_port(), deployments=deployments,
                        auth={"hs256_secret_file": str(jwt_secret[0])}, http=dict(http or {}))
    with service_on_local_ray(cfg, kv_dir, jwt_secret, env_vars=env_vars, **ray_init) as svc:
        yield svc


def engine_actor():
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"]]
    assert len(named) == 1, named
    return ray.get_actor(named[0]["name"], namespace=named[0]["namespace"])


def wait_running(deployment: str, timeout_s: float = 240) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(APP)
        if app is not None and app.status == "RUNNING" and app.deployments[deployment].status == "HEALTHY":
            return
        time.sleep(1)
    raise AssertionError(f"{deployment} did not come back within {timeout_s} s: {serve.status()}")


def wait_gone(pid: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:  # gone, or a zombie its parent has not reaped yet (it runs no code)
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs {timeout_s} s after it was killed")


# Users of the multi-replica tests (two_engines/, test_node_failure): a name, three facts each.
NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Milo", "Nia",
         "Oto", "Pia"]
PETS = ["Pixel", "Biscuit", "Mango", "Pepper", "Noodle", "Ziggy", "Olive", "Waffle"]


def facts_of(name: str) -> list[str]:
    i = NAMES.index(name)
    return [f"{name} adopted a cat named {PETS[i % len(PETS)]} last spring.",
            f"{name} works as a baker in the old town.",
            f"{name} is learning to play the cello."]


def deployment_handle(name: str):
    """Serve's handle on one of the app's deployments (EngineReplica, EncoderPool, ...)."""
    from ray import serve

    return serve.get_deployment_handle(name, app_name=APP)


def engine_handle():
    return deployment_handle("EngineReplica")


def engine_stats(user_id: str, timeout_s: float = 60) -> dict:
    """stats() of the engine replica the router sends this user to."""
    return engine_handle().options(multiplexed_model_id=user_id).stats.remote().result(timeout_s=timeout_s)


def stats_by_replica(replicas: int, attempts: int = 60) -> dict[str, dict]:
    """stats() of every engine replica (services/observe.py engine_replica_stats: asked until each of `replicas`
    has answered, bounded)."""
    from inferscale_server.observe import engine_replica_stats

    return engine_replica_stats(replicas, APP, calls=attempts)


def fingerprint() -> str:
    return deployment_handle("EncoderPool").fingerprint.remote().result(timeout_s=60)


def object_keys(user_id: str, facts: list[tuple[str, int]], fp: str | None = None) -> list[str]:
    """The cluster-tier keys of these (fact_id, version) under the running app's fingerprint (or `fp`)."""
    from inferscale_core.cluster_store import ClusterConfig, ClusterStore
    from inferscale_core.types import kv_id

    tier = ClusterStore(ClusterConfig(master="unused:1", metadata="unused"), fp or fingerprint())
    return [tier.key(user_id, kv_id(f, v)) for f, v in facts]
