"""Prometheus metrics of the deployments.

Metrics are made with `ray.serve.metrics`, which adds the `deployment`, `replica` and `application` tags, and are
exported by Ray's metrics agent on every node's metrics export port (`ray start --metrics-export-port`, the
chart's PodMonitor) with Ray's `ray_` prefix: `inferscale_requests_total` is scraped as
`ray_inferscale_requests_total`.

    inferscale_requests_total{rpc, code}   every deployment: calls by method / RPC and gRPC status code name
    inferscale_queue_depth                 every deployment: requests this replica is working on now
    inferscale_q2ft_seconds{mode}          gateway: query received -> first token back (retrieval included)
    inferscale_ttft_seconds{mode}          engine: request submitted to vLLM -> first token
    inferscale_injected_tokens_total       engine: prompt tokens vLLM loaded through the KV connector
    inferscale_store_hits_total{tier}      engine: fact-store hits per tier (device, host, disk)
    inferscale_resident_bytes{tier}        engine: KV bytes resident per tier
    inferscale_encoder_step_seconds        encoder pool: each forward, or step of a longer one, its fair scheduler
                                           runs (one at a time: what a fact arriving behind it waits for)

vLLM's own metrics (queue, KV-cache use, TTFT and the other latency histograms, prompt tokens by source: the
injected ones are `source="external_kv_transfer"`) are exported from every
engine replica by vLLM's Ray stat logger (vllm_stat_loggers): `vllm:num_requests_waiting` is scraped as
`ray_vllm_num_requests_waiting`, labelled with the model, the engine index and the Serve ReplicaId. The
dashboard over all of these is charts/inferscale/files/grafana-dashboard.json (docs/deploy.md, "Metrics").

No label ever holds a user id (unbounded cardinality, and personal data in the monitoring system). Serve's own
multiplexing gauge labels each loaded model id, which here is a user id (`serve_registered_multiplexed_model_id
{model_id=...}`): `hide_multiplexed_ids()` replaces that one gauge with a no-op in the replica's process.
"""
from __future__ import annotations

import asyncio
import contextlib

import grpc

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
TIERS = ("device", "host", "disk")


def vllm_stat_loggers() -> list:
    """AsyncLLM stat loggers for an engine replica: vLLM's Prometheus logger (this process's registry, which
    `AsyncInjectingEngine.metrics()` reads) and its Ray logger (the same metrics through Ray's metrics agent,
    the port Prometheus scrapes). vLLM adds neither when given a Prometheus-kind logger, so both are named; the
    Ray one first: every PrometheusStatLogger (the Ray one too) clears vLLM's metrics from the process registry
    when it is made, so the plain one must come last."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return [RayPrometheusStatLogger, PrometheusStatLogger]


class _Discard:
    """Stands in for a metric that must not be exported."""

    def set(self, *a, **kw) -> None: ...
    def inc(self, *a, **kw) -> None: ...
    def observe(self, *a, **kw) -> None: ...
    def set_default_tags(self, *a, **kw) -> None: ...


def hide_multiplexed_ids() -> None:
    """Serve (2.60) sets `serve_registered_multiplexed_model_id{model_id=<id>}` for every loaded model; our model
    ids are user ids. Every multiplex wrapper made in this process gets a no-op for that gauge instead (the
    model count, load latency and routing are untouched). Idempotent."""
    from ray.serve import multiplex

    cls = multiplex._ModelMultiplexWrapper
    if getattr(cls.__init__, "_inferscale_hides_ids", False):
        return
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.registered_model_gauge = _Discard()

    setattr(__init__, "_inferscale_hides_ids", True)
    cls.__init__ = __init__  # type: ignore[method-assign]  # the patch this function exists for


def code_of(e: BaseException | None) -> str:
    """The gRPC status code name an exception is answered with (what the client sees)."""
    if e is None:
        return grpc.StatusCode.OK.name
    from .errors import to_api_error

    return to_api_error(e).code.name


class DeploymentMetrics:
    """Request counts by method and status, and the queue depth, of one replica. Use `with m.request("Search"):`
    around a call (also inside an async generator: the stream counts until it ends)."""

    def __init__(self):
        from ray.serve import metrics

        self.requests = metrics.Counter("inferscale_requests_total", description="Calls by method/RPC and status code.",
                                        tag_keys=("rpc", "code"))
        self.queue = metrics.Gauge("inferscale_queue_depth",
                                   description="Requests this replica is working on (queued or running).")
        self._inflight = 0
        self.queue.set(0)

    def count(self, rpc: str, code: str) -> None:
        self.requests.inc(tags={"rpc": rpc, "code": code})

    def started(self) -> None:
        self._inflight += 1
        self.queue.set(self._inflight)

    def finished(self, rpc: str, code: str) -> None:
        self._inflight -= 1
        self.queue.set(self._inflight)
        self.count(rpc, code)

    @contextlib.contextmanager
    def request(self, rpc: str):
        self.started()
        code = grpc.StatusCode.OK.name
        try:
            yield
        except (GeneratorExit, asyncio.CancelledError):  # the caller went away (a dropped stream)
            code = grpc.StatusCode.CANCELLED.name
            raise
        except BaseException as e:
            code = code_of(e)
            raise
        finally:
            self.finished(rpc, code)


class GatewayMetrics(DeploymentMetrics):
    def __init__(self):
        super().__init__()
        from ray.serve import metrics

        self.q2ft = metrics.Histogram("inferscale_q2ft_seconds", boundaries=LATENCY_BUCKETS_S, tag_keys=("mode",),
                                      description="Query received by the gateway -> first token (retrieval included).")


class EngineMetrics(DeploymentMetrics):
    """Besides requests: TTFT per answer, and the engine's counters (vLLM's tokens loaded through the connector,
    the worker store's hits and resident bytes per tier) copied from `AsyncInjectingEngine.metrics()`."""

    def __init__(self):
        super().__init__()
        from ray.serve import metrics

        self.ttft = metrics.Histogram("inferscale_ttft_seconds", boundaries=LATENCY_BUCKETS_S, tag_keys=("mode",),
                                      description="Request submitted to vLLM -> first token.")
        self.injected = metrics.Counter("inferscale_injected_tokens_total",
                                        description="Prompt tokens vLLM loaded through the KV connector (injected).")
        self.hits = metrics.Counter("inferscale_store_hits_total", tag_keys=("tier",),
                                    description="Fact-store hits per tier (facts found there when a request loaded).")
        self.resident = metrics.Gauge("inferscale_resident_bytes", tag_keys=("tier",),
                                      description="KV bytes of facts resident per tier of the fact store.")
        self._seen: dict[str, float] = {}

    def _delta(self, key: str, total: float) -> float:
        """Counters arrive as totals since the engine started; Ray's Counter wants increments."""
        d = total - self._seen.get(key, 0.0)
        self._seen[key] = total
        return d if d > 0 else 0.0

    def engine_snapshot(self, m: dict) -> None:
        """`m`: AsyncInjectingEngine.metrics() ({"prompt_tokens_external_kv_transfer", ..., "worker": {...}})."""
        d = self._delta("injected", float(m.get("prompt_tokens_external_kv_transfer", 0)))
        if d:
            self.injected.inc(d)
        worker = m.get("worker") or {}
        for tier in TIERS:
            d = self._delta(f"hits_{tier}", float(worker.get(f"store_hits_{tier}", 0)))
            if d:
                self.hits.inc(d, tags={"tier": tier})
            self.resident.set(float(worker.get(f"resident_bytes_{tier}", 0)), tags={"tier": tier})


class EncoderMetrics(DeploymentMetrics):
    """Besides requests: how long each turn of the fair scheduler takes. A turn is one forward, or one step of a
    longer one (services/encoder_pool.py BATCH_COST), and one runs at a time, so its duration is what a fact that
    arrives behind other users' work waits for before its own forward starts (a batch size would always be 1)."""

    def __init__(self):
        super().__init__()
        from ray.serve import metrics

        self.step = metrics.Histogram("inferscale_encoder_step_seconds", boundaries=LATENCY_BUCKETS_S,
                                      description="Each forward (or step of a longer one) the encoder pool runs.")
