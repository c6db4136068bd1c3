"""InferScaleConnector: a vLLM KV connector that writes composed memory KV into the paged cache.

Loaded into stock vLLM 0.32.x through
    KVTransferConfig(kv_connector="InferScaleConnector", kv_connector_module_path="inferscale_core.connector",
                     kv_role="kv_both", kv_connector_extra_config={...})
vLLM makes two instances: one with the scheduler role (decides how many prompt tokens are injected) and one
with the worker role (owns the fact store and writes the KV). The two halves live in
`connector_scheduler.py` and `connector_worker.py`; what they and the engine wrapper share (request
parameters, scheduler -> worker metadata, counter names) lives in `connector_types.py` and is re-exported
here. This module holds the vLLM-facing class, the stats plumbing and the worker extension that lets the
serving process load facts into the worker's store while the engine runs.

A request carries only ids (`InjectionParams` in `SamplingParams.extra_args["kv_transfer_params"]`); the KV
never crosses a process boundary per request. A request with `fetch` set is loaded asynchronously: the worker
reads the facts its store lacks from the cluster tier (Mooncake Store) itself, on a loader thread, while vLLM
keeps the request outside the batch (connector_scheduler.py's docstring). The time it waited comes back on the
request's last RequestOutput (`kv_transfer_params[LOAD_REPORT_KEY]`, a `LoadReport`): the `kv_load` hop.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

# connector_types first: it checks the vLLM version before anything of vLLM's connector API is imported.
from .connector_types import (  # re-exported: the connector's public names
    COUNTERS,
    GAUGES,
    LOAD_REPORT_KEY,
    PARAMS_KEY,
    SCHEDULER_COUNTERS,
    SUPPORTED_VLLM,
    WORKER_COUNTERS,
    InjectionMetadata,
    InjectionParams,
    InjectionWorkerMetadata,
    LoadReport,
    LoadSpec,
    UnsupportedVLLMError,
    cache_salt,
    check_vllm_version,
    injectable_tokens,
    memory_hash,
    pack_fact,
    recompute_tokens_option,
    unpack_fact,
)

# isort: split
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from .types import SHARED_USER_ID  # re-exported: the owner of the shared prefix chunk

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from .connector_scheduler import SchedulerSide
    from .connector_worker import WorkerSide

CONNECTOR_NAME = "InferScaleConnector"
CONNECTOR_MODULE = __name__
WORKER_EXTENSION = f"{__name__}.InjectionWorkerExtension"

__all__ = [  # this module's own names and the shared ones it re-exports from connector_types
    "CONNECTOR_MODULE", "CONNECTOR_NAME", "COUNTERS", "GAUGES", "METRIC_PREFIX", "PARAMS_KEY", "SCHEDULER_COUNTERS",
    "SHARED_USER_ID", "SUPPORTED_VLLM", "WORKER_COUNTERS", "WORKER_EXTENSION", "InferScaleConnector",
    "InjectionMetadata", "InjectionParams", "InjectionPromMetrics", "InjectionStats", "InjectionWorkerExtension",
    "InjectionWorkerMetadata", "LOAD_REPORT_KEY", "LoadReport", "LoadSpec", "UnsupportedVLLMError", "cache_salt", "check_vllm_version", "injectable_tokens", "memory_hash",
    "pack_fact", "recompute_tokens_option", "unpack_fact", "worker_connector",
]


# ---------------------------------------------------------------------------------------------------------
# Stats: per-step deltas that vLLM carries from the worker (and the scheduler) to its stat loggers.


class InjectionStats(KVConnectorStats):
    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "InjectionStats":
        for k, v in other.data.items():
            if k in GAUGES:
                self.data[k] = v  # latest value wins
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS) and not any(k in self.data for k in GAUGES)


METRIC_PREFIX = "vllm:inferscale_"  # vLLM's namespace: llm.get_metrics() and /metrics list only "vllm:*"


class InjectionPromMetrics(KVConnectorPromMetrics):
    """`vllm:inferscale_*` counters and gauges in vLLM's own Prometheus registry (the service's /metrics)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(name=f"{METRIC_PREFIX}{name}", documentation=doc, labelnames=labelnames)
            self._metrics[name] = {i: metric.labels(*lv) for i, lv in per_engine_labelvalues.items()}
        for name, doc in GAUGES.items():
            metric = self._gauge_cls(name=f"{METRIC_PREFIX}{name}", documentation=doc, labelnames=labelnames,
                                     multiprocess_mode="mostrecent")
            self._metrics[name] = {i: metric.labels(*lv) for i, lv in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for k, v in transfer_stats_data.items():
            per_engine = self._metrics.get(k)
            if per_engine is None:
                continue
            if k in GAUGES:
                per_engine[engine_idx].set(v)
            elif v:
                per_engine[engine_idx].inc(v)


# ---------------------------------------------------------------------------------------------------------
# The connector: one class, two roles.


class InferScaleConnector(KVConnectorBase_V1):
    """Scheduler role -> `SchedulerSide`, worker role -> `WorkerSide`; every method delegates."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from .connector_scheduler import SchedulerSide

            self.scheduler_side = SchedulerSide(vllm_config, kv_cache_config, extra)
        else:
            from .connector_worker import WorkerSide

            self.worker_side = WorkerSide(vllm_config, extra)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a consumer only: nothing is handed off when a request finishes

    @property
    def _worker(self) -> "WorkerSide":
        if self.worker_side is None:
            raise RuntimeError("a worker-role method was called on the scheduler's InferScaleConnector")
        return self.worker_side

    @property
    def _scheduler(self) -> "SchedulerSide":
        if self.scheduler_side is None:
            raise RuntimeError("a scheduler-role method was called on a worker's InferScaleConnector")
        return self.scheduler_side

    # ---- worker role
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, InjectionMetadata)
        self._worker.load(forward_context, meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads complete in start_load_kv; asynchronous ones are written before get_finished

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Asynchronous loads that arrived (written) or failed (vLLM computes the request instead); a failed one
        is in both sets, as vLLM asks."""
        done, failed = self._worker.finished_loads(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # nothing is saved: facts enter the store through the worker extension, never from requests

    def wait_for_save(self):
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks()

    def shutdown(self):
        if self.worker_side is not None:
            self.worker_side.shutdown()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Where the facts of this step's finished asynchronous loads came from; vLLM hands it to the scheduler
        side's update_connector_output with the same step's finished_recving."""
        loads = self._worker.take_load_details()
        return InjectionWorkerMetadata(loads) if loads else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self.worker_side or self._scheduler
        data = side.take_stats()
        return InjectionStats(data=data) if data else None

    # ---- scheduler role
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        meta = connector_output.kv_connector_worker_meta
        details = meta.loads if isinstance(meta, InjectionWorkerMetadata) else None
        self._scheduler.loads_ended(connector_output.finished_recving or (), connector_output.failed_recving,
                                    details)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._scheduler.update_state_after_alloc(request, list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are never held back (nothing is sent); the dict, the request's asynchronous loads
        (`LoadReport`), reaches its last RequestOutput as `kv_transfer_params` (vLLM 0.32: Scheduler._free_request
        -> EngineCoreOutput.kv_transfer_params -> OutputProcessor -> RequestOutput.kv_transfer_params)."""
        return False, self._scheduler.request_finished(request)

    # ---- stats plumbing (class level: vLLM calls these on the class in the logging process)
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return InjectionStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return InjectionPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def worker_connector():
    """The worker-role connector of this process (only inside an engine worker)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        raise RuntimeError("no KV connector in this process: the engine was not started with InferScaleConnector")
    conn = get_kv_transfer_group()
    if not isinstance(conn, InferScaleConnector) or conn.worker_side is None:
        raise RuntimeError(f"the engine's KV connector is {type(conn).__name__}, not the InferScale worker")
    return conn.worker_side


class InjectionWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`), so `llm.collective_rpc("inferscale_put", ...)`
    reaches the worker's fact store by name, in-process and multiprocess alike, without pickled callables.
    Arguments are ids, ints and bytes only."""

    def inferscale_put(self, user_id: str, facts: list) -> int:
        """facts: [(kv_id, pack_fact(fact)), ...]; returns the KV bytes stored."""
        return worker_connector().put(user_id, facts)

    def inferscale_delete(self, user_id: str, kv_ids: list[str] | None = None) -> int:
        """Delete these kv_ids (all of the user's when None); returns how many were removed."""
        return worker_connector().delete(user_id, kv_ids)

    def inferscale_preload(self, user_id: str) -> int:
        """Bring the user's facts to the device tier ahead of their requests; returns facts moved."""
        return worker_connector().preload(user_id)

    def inferscale_has(self, user_id: str, kv_ids: list[str]) -> list[bool]:
        return worker_connector().has(user_id, kv_ids)

    def inferscale_list(self) -> dict[str, list[str]]:
        """Every user's kv_ids in the worker store: what a replica finds on its disk tier at start."""
        return worker_connector().listed()

    def inferscale_prefetch(self, user_id: str, kv_ids: list[str]) -> int:
        """Load these facts of the user from the cluster tier in the worker's background (ids only cross)."""
        return worker_connector().prefetch(user_id, kv_ids)

    def inferscale_take_missing(self) -> dict[str, dict[str, list[str]]]:
        """Since the last call (drained): {"missing": user -> kv_ids found in no tier (the serving process queues
        one re-encode of each), "absent": user -> kv_ids not in the worker store that may be elsewhere}."""
        return worker_connector().take_missing()

    def inferscale_stats(self) -> dict[str, Any]:
        """Cumulative counters and resident bytes of this worker."""
        return worker_connector().stats()
