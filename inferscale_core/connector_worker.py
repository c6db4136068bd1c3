"""Worker half of InferScaleConnector: owns the fact store in the engine's worker process, on the engine's
device, and writes composed memory KV into the paged cache before the forward pass.

Per injected request: gather its chunks from the store (ids only arrived with the request), check that their
token ids are the memory the scheduler matched, re-rotate the keys to positions start..end-1 (chunked RoPE),
and scatter K/V into the request's blocks through the attention backend's own cache-write op.

The requests of a step are written in groups of up to `inject_group_tokens` tokens; per group: one copy of the
chunks' K and V into buffers allocated once (a fresh 2 x 22 MB allocation per request at k=50 is page-faulted
in again every time), ONE in-place rotation of every layer's keys with vLLM's own fused rotary op (the
op the model's forward pass uses, with the same table dtype, so the keys are bit for bit what vLLM's prefill
writes), and ONE cache write for all layers through a view over vLLM's whole KV buffer (`AllLayersCache`, on
the CPU backend with an unquantized cache; one write per layer elsewhere). Facts are already in the model's
dtype in the store, so nothing is cast per request.

Facts are stored and rotated in the MODEL's dtype, whatever the cache holds: with a quantized cache
(`kv_cache_dtype="fp8"`) the backend's own cache write quantizes them, exactly as it quantizes the keys of a
prefill.

Memory on an accelerator: the fact store's device tier has a byte budget (`device_budget_bytes`, by default
derived from the memory vLLM leaves free, see `device_budget`); facts beyond it spill to pinned host memory.
An allocation failure while injecting never reaches vLLM: that request's blocks are reported as failed loads
and vLLM recomputes them (plain prefill for those tokens).

Asynchronous loads (`LoadSpec.fetch`, a request with `InjectionParams.fetch`): the worker has a Mooncake Store
client of its own (`cluster_store` + `kv_fingerprint` in kv_connector_extra_config, the engine replica's cluster
tier under the encoder pool's fingerprint). `start_load_kv` hands each such request to a loader thread, which
reads the facts the store lacks from the cluster tier into the store (the read, its unpacking and the dtype
conversion run there, outside vLLM's step): Mooncake lands the objects in the client's registered read buffer
(`batch_get_into`) and each fact goes from there into the store's memory, one copy, no Python bytes in between; its
disk-tier file is written behind the load by one thread (FactStore.write_back): written per fact with an fsync
under the store's lock, the files made each cluster read ~3.4x slower here and held every step's gather behind them.
`get_finished` writes the blocks of every load that has arrived, on the step's thread as a synchronous load is
written, and reports the request to vLLM, which schedules it in the next step. A fact found in no tier fails the request's blocks (vLLM recomputes them with the query: slower, never
wrong) and is listed for `take_missing`, so the serving process queues one re-encode. The KV of a request never
passes through the engine core's RPC channel (`rpc_put_bytes` counts what still does: the prefix chunk, and
facts of a service without a cluster tier).
"""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from vllm.logger import init_logger

from . import inject_kernel
from .connector_types import WORKER_COUNTERS, InjectionMetadata, LoadSpec, memory_hash, unpack_fact
from .errors import InferScaleError, check_id
from .inject_kernel import CacheViews
from .model_spec import ModelSpec
from .rope import ChunkedRope
from .store import FactStore, is_out_of_memory
from .types import SHARED_USER_ID, EncodedFact

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

    from .cluster_store import ClusterStore

logger = init_logger(__name__)

# kv_connector_extra_config keys the worker reads (all optional).
WORKER_OPTIONS = ("disk_dir", "device_budget_bytes", "host_budget_bytes", "disk_budget_bytes", "max_fact_tokens",
                  "inject_group_tokens", "cluster_store", "kv_fingerprint", "fetch_threads", "fused_injection")
# Loader threads reading the cluster tier for asynchronous loads (Mooncake's get releases the GIL while it waits).
FETCH_THREADS = 2
# Warm-ups (`prefetch`: a replica warmed at a write, or by load_user) read on a thread of their own, behind the
# requests' loads: a few facts per read, so a request's load that arrives meanwhile waits for at most one such read
# (reads share the cluster client's buffer, one at a time), and before each read up to WARM_YIELD_S while requests'
# loads are in flight (then one read anyway, so a busy replica still warms, slowly).
WARM_CHUNK_FACTS = 8
WARM_YIELD_S = 1.0
# Read by the scheduler side (connector_scheduler.py); accepted here so one extra_config serves both sides.
SCHEDULER_OPTIONS = ("recompute_tokens", "recompute_facts", "recompute_facts_max_k")

# Default tokens written per group: bounds the temporary K/V buffers (23 KB per token for SmolLM2 bf16 ->
# ~190 MB; 128 KiB per token for Llama-3.1-8B bf16 -> 1 GiB) when a batch of many large memories arrives in
# one step.
INJECT_GROUP_TOKENS = 8192
# Share of the device memory vLLM leaves free (outside gpu_memory_utilization, after the group buffers) that
# the fact store's device tier may fill when `device_budget_bytes` is not given. Half: the rest stays free
# for the allocator's fragmentation, temporary copies and other processes on the same device.
AUTO_DEVICE_FRACTION = 0.5


def device_budget(option, device: torch.device, reserve_bytes: int, free_bytes: int | None) -> int | None:
    """The fact store's device-tier budget in bytes (None: no budget).

    `option` is kv_connector_extra_config["device_budget_bytes"]: an integer >= 0 is used as given; "auto"
    (the default on an accelerator) is AUTO_DEVICE_FRACTION of `free_bytes`, the device memory vLLM leaves
    free (`memory_outside_vllm`), minus `reserve_bytes` for the injection buffers. On the CPU the default is
    no budget: the store is plain memory next to vLLM's fixed VLLM_CPU_KVCACHE_SPACE."""
    if option is None:
        option = "auto" if device.type != "cpu" else None
    if option is None:
        return None
    if option == "auto":
        if device.type == "cpu":
            raise ValueError("device_budget_bytes='auto' derives the budget from accelerator memory; on the CPU "
                             "give a number of bytes or leave it unset")
        if free_bytes is None:
            raise ValueError(f"the free memory of {device} cannot be read: set device_budget_bytes (bytes of "
                             "fact KV the store may keep on the device)")
        return max(0, int((free_bytes - reserve_bytes) * AUTO_DEVICE_FRACTION))
    if isinstance(option, bool) or not isinstance(option, int) or option < 0:
        raise ValueError(f"device_budget_bytes must be an integer >= 0 or 'auto', got {option!r}")
    return option


def memory_outside_vllm(free: int, total: int, reserved: int, utilization: float) -> int:
    """Device bytes vLLM will leave free: what is free now, less what vLLM may still take of its share
    (`utilization` x `total`; it has `reserved` so far: CUDA graphs are captured and warm-up runs after the
    connector sees the KV cache)."""
    return max(0, free - max(0, int(utilization * total) - reserved))


def free_device_memory(device: torch.device, utilization: float) -> int | None:
    """`memory_outside_vllm` on this accelerator, None when torch cannot read its memory."""
    try:
        free, total = torch.accelerator.get_memory_info(device)
        reserved = torch.accelerator.memory_reserved(device)
    except Exception:  # noqa: BLE001 - no accelerator API for this device type
        return None
    return memory_outside_vllm(int(free), int(total), int(reserved), utilization)


class LoadError(InferScaleError):
    pass


@dataclass
class FetchResult:
    """What one loader-thread read found: the user's kv_ids not in the store (of which `unreadable`: listed in the
    cluster tier on a segment that cannot be read; `deleted`: deleted while being read; the rest are in no tier),
    and the counters to add on the step's thread."""
    user_id: str
    missing: list[str]
    unreadable: list[str]
    counts: dict[str, float]
    fetched: list[str] = field(default_factory=list)  # the kv_ids read from the cluster tier into the store
    deleted: list[str] = field(default_factory=list)  # of `missing`: read, but deleted since the load began


class DeletesDuringLoads:
    """The deletes the worker applied while a load of the same user was reading the cluster tier, so that the load
    puts back no fact a delete named after it began: a delete (or an eviction) wins over a read in flight, which
    would otherwise store the deleted KV again and write its file behind it. Kept only while a load of that user
    runs. `lock` is held around a delete and around each put of a load, so the check and the put are one step."""

    def __init__(self):
        self.lock = threading.Lock()
        self._loads: dict[str, int] = {}  # user -> loads reading now
        self._deletes: dict[str, list[frozenset[str] | None]] = {}  # user -> deletes since its oldest load began

    def begin(self, user_id: str) -> int:
        """A load of the user begins; returns its mark (the deletes before it do not concern it)."""
        with self.lock:
            self._loads[user_id] = self._loads.get(user_id, 0) + 1
            return len(self._deletes.get(user_id, ()))

    def end(self, user_id: str) -> None:
        with self.lock:
            left = self._loads[user_id] - 1
            if left:
                self._loads[user_id] = left
            else:
                del self._loads[user_id]
                self._deletes.pop(user_id, None)

    def record(self, user_id: str, kv_ids: list[str] | None) -> None:
        """A delete of these kv_ids (None: the whole user). Under `lock`."""
        if user_id in self._loads:
            self._deletes.setdefault(user_id, []).append(None if kv_ids is None else frozenset(kv_ids))

    def deleted_since(self, user_id: str, mark: int, kv: str) -> bool:
        """Whether a delete after `mark` named this fact. Under `lock`."""
        return any(d is None or kv in d for d in self._deletes.get(user_id, ())[mark:])


class WorkerSide:
    def __init__(self, vllm_config: "VllmConfig", extra_config: dict[str, Any]):
        if vllm_config.parallel_config.tensor_parallel_size != 1 or vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("InferScaleConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 "
                             "(the fact store holds every KV head of every layer)")
        known = WORKER_OPTIONS + SCHEDULER_OPTIONS
        unknown = set(extra_config) - set(known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; known: {known}")
        self.inject_group_tokens = int(extra_config.get("inject_group_tokens", INJECT_GROUP_TOKENS))
        if self.inject_group_tokens < 1:
            raise ValueError(f"inject_group_tokens must be >= 1, got {self.inject_group_tokens}")
        self.fetch_threads = extra_config.get("fetch_threads", FETCH_THREADS)
        if isinstance(self.fetch_threads, bool) or not isinstance(self.fetch_threads, int) or self.fetch_threads < 1:
            raise ValueError(f"fetch_threads must be an integer >= 1, got {self.fetch_threads!r}")
        self.cluster_config = cluster_config_option(extra_config)  # checked here: a mistake stops the start
        # On a CUDA device with Triton, the fused kernel (inject_kernel.py) where the cache's layout allows it;
        # False keeps the unfused path everywhere (the fallback, and what the CPU backend always uses).
        self.fused_injection = extra_config.get("fused_injection", True)
        if not isinstance(self.fused_injection, bool):
            raise ValueError(f"fused_injection must be true or false, got {self.fused_injection!r}")
        self.block_size = vllm_config.cache_config.block_size
        # K and V are kept and rotated in the model's dtype; the cache may hold another (fp8: uint8 storage).
        # (a torch.dtype: vLLM's ModelConfig resolves "auto" and dtype names when it is built)
        self.kv_dtype = cast(torch.dtype, vllm_config.model_config.dtype)
        self.hf_config = vllm_config.model_config.hf_text_config
        self.spec = ModelSpec.from_config(self.hf_config)  # rejects families chunked RoPE does not support
        self.extra_config = extra_config
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layer_index: dict[str, int] = {}
        self.store: FactStore | None = None
        self.device_budget_bytes: int | None = None  # set with the store in register_kv_caches
        self.max_model_len = vllm_config.model_config.max_model_len
        self.gpu_memory_utilization = vllm_config.cache_config.gpu_memory_utilization
        self.cos_sin_cache: torch.Tensor | None = None
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # K and V group buffers, see _group_buffers
        # Every layer's cache as one tensor (AllLayersCache) when the attention backend allows a single write;
        # decided at the first injection, where the attention layers are visible.
        self.all_layers: AllLayersCache | None = None
        self.cache_views: CacheViews | None = None  # the fused kernel's views of every layer's cache (CUDA)
        self._all_layers_checked = False
        self._failed_blocks: set[int] = set()
        self._failed_loads: set[str] = set()  # asynchronous loads that failed, by request id
        # Asynchronous loads: the cluster tier's client and the loader threads (made in register_kv_caches, in the
        # worker's process), the loads in flight, those whose request finished meanwhile (aborted: reported,
        # never written), the facts found nowhere (take_missing), and the last step's forward context (the
        # writes of get_finished go through the attention layers it holds).
        self.cluster: ClusterStore | None = None
        self._loader: ThreadPoolExecutor | None = None
        # Writes the disk-tier files of the facts the loaders read (FactStore.write_back): one thread, behind the
        # loads, so a load never waits for a file and its fsync (made with the store when it has a disk tier).
        self._disk_writer: ThreadPoolExecutor | None = None
        self._fetching: dict[str, tuple[LoadSpec, Future]] = {}
        self._aborted: set[str] = set()
        self._missing: dict[str, set[str]] = {}
        self._absent: dict[str, set[str]] = {}
        self._forward_context: "ForwardContext | None" = None
        self._prefetching: list[Future] = []  # prefetch() warm-ups not settled yet
        self._warmer: ThreadPoolExecutor | None = None  # the warm-ups' thread (made with the loaders)
        # Requests' loads submitted and not yet read: a warm-up waits for them (WARM_YIELD_S). Counted up on the
        # step's thread, down on the loader's, under the lock.
        self._request_loads = 0
        self._request_loads_lock = threading.Lock()
        self._closing = False
        self._deletes = DeletesDuringLoads()
        # req_id -> where the facts of its asynchronous load came from, for the scheduler side
        # (take_load_details: vLLM's worker metadata of the step that reports the load finished).
        self._load_details: dict[str, dict[str, Any]] = {}
        self._step: dict[str, float] = {}  # counters since the last take_stats
        self._totals: dict[str, float] = {k: 0 for k in WORKER_COUNTERS}
        self._last_resident: dict[str, int] = {}

    # ------------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self.kv_caches = dict(kv_caches)
        self.layer_index = {name: extract_layer_index(name) for name in kv_caches}
        if sorted(self.layer_index.values()) != list(range(self.spec.num_layers)):
            raise ValueError(f"InferScaleConnector expects one KV cache per layer 0..{self.spec.num_layers - 1}, "
                             f"got layers {sorted(self.layer_index.values())}")
        first = next(iter(kv_caches.values()))
        self.device, self.cache_dtype = first.device, first.dtype
        self.cos_sin_cache = rotary_table(self.hf_config, self.spec, self.max_model_len, self.device,
                                          self.kv_dtype)
        opts = self.extra_config
        # Measured now: vLLM has allocated its weights and KV cache; what it still takes comes off.
        free = free_device_memory(self.device, self.gpu_memory_utilization) if self.device.type != "cpu" else None
        self.device_budget_bytes = device_budget(opts.get("device_budget_bytes"), self.device,
                                                 self.spec.kv_bytes(self.inject_group_tokens, self.kv_dtype), free)
        self.store = FactStore.for_spec(
            self.spec, device=self.device, dtype=self.kv_dtype, disk_dir=opts.get("disk_dir"),
            max_fact_tokens=int(opts.get("max_fact_tokens", 1024)),
            device_budget_bytes=self.device_budget_bytes, host_budget_bytes=opts.get("host_budget_bytes"),
            disk_budget_bytes=opts.get("disk_budget_bytes"))
        if self.cluster_config is not None:
            from .cluster_store import ClusterStore

            self.cluster = ClusterStore(self.cluster_config, self.extra_config["kv_fingerprint"], reads_to=self.device)
            self.cluster.available  # noqa: B018 - connects in the background; a load before that is a miss
        self._loader = ThreadPoolExecutor(self.fetch_threads, thread_name_prefix="inferscale-fetch")
        self._warmer = ThreadPoolExecutor(1, thread_name_prefix="inferscale-warm")
        if self.store.disk_dir is not None:
            self._disk_writer = ThreadPoolExecutor(1, thread_name_prefix="inferscale-disk")
        logger.info("InferScale worker: %d layers on %s (facts in %s, cache %s), block size %d, device budget %s, "
                    "cluster tier %s", len(kv_caches), self.device, self.kv_dtype, self.cache_dtype, self.block_size,
                    "none" if self.device_budget_bytes is None else f"{self.device_budget_bytes} B",
                    self.cluster_config.master if self.cluster_config is not None else "none")

    def _require_store(self) -> FactStore:
        if self.store is None:
            raise RuntimeError("the InferScale fact store is not ready: the engine has not allocated its KV cache")
        return self.store

    # ------------------------------------------------------------------ fact management (worker extension)

    def put(self, user_id: str, facts: list) -> int:
        """Insert or replace the user's (or SHARED_USER_ID's) `(kv_id, pack_fact(fact))` pairs, converted to the
        model's dtype; all facts are checked before any is stored."""
        store = self._require_store()
        check_id("user_id", user_id)
        converted = []
        for item in facts:
            if len(item) != 2:
                raise ValueError("each fact must be (kv_id, pack_fact(fact))")
            kv_id, blob = item
            check_id("kv_id", kv_id)
            converted.append((kv_id, self._fitting(unpack_fact(blob), store)))
        nbytes = 0
        for kv_id, fact in converted:
            store.put(user_id, kv_id, fact)
            nbytes += fact.nbytes
        self._count("rpc_put_bytes", nbytes)
        return nbytes

    def _fitting(self, fact: EncodedFact, store: FactStore) -> EncodedFact:
        """The fact in the model's dtype, checked against the model's shape (ValueError naming the mismatch)."""
        fact = EncodedFact(fact.token_ids, fact.k_pre.to(self.kv_dtype), fact.v.to(self.kv_dtype))
        fact.validate(self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim,
                      max_tokens=store.max_fact_tokens)
        return fact

    def delete(self, user_id: str, kv_ids: list[str] | None) -> int:
        store = self._require_store()
        check_id("user_id", user_id)
        with self._deletes.lock:  # a load reading these now does not put them back
            self._deletes.record(user_id, kv_ids)
            if kv_ids is None:
                if user_id not in store.users():
                    return 0
                n = len(store.fact_ids(user_id))
                store.delete_user(user_id)
                return n
            removed = 0
            for kv in kv_ids:
                if store.contains(user_id, kv):
                    store.delete(user_id, kv)
                    removed += 1
            return removed

    def preload(self, user_id: str) -> int:
        store = self._require_store()
        ids = store.fact_ids(user_id)
        store.get_many(user_id, ids)  # promotes every fact to the device tier
        return len(ids)

    def has(self, user_id: str, kv_ids: list[str]) -> list[bool]:
        store = self._require_store()
        return [store.contains(user_id, f) for f in kv_ids]

    def listed(self) -> dict[str, list[str]]:
        """Every user's kv_ids in the store (its disk tier's files included), the shared prefix left out."""
        store = self._require_store()
        return {u: store.fact_ids(u) for u in store.users() if u != SHARED_USER_ID}

    # ------------------------------------------------------------------ injection

    def load(self, forward_context: "ForwardContext", meta: InjectionMetadata) -> None:
        """Writes this step's synchronous loads; hands its asynchronous ones to the loader threads."""
        self._forward_context = forward_context
        if not meta.loads:
            return
        t0 = time.perf_counter()
        store = self._require_store()
        self._check_all_layers(forward_context)
        for spec in meta.loads:
            if spec.fetch:
                self._count("async_loads")
                assert self._loader is not None  # made with the store, in register_kv_caches
                with self._request_loads_lock:
                    self._request_loads += 1
                fut = self._loader.submit(self._fetch, spec.user_id, list(spec.kv_ids[1:]))
                fut.add_done_callback(self._request_load_done)
                self._fetching[spec.req_id] = (spec, fut)
        self._inject(forward_context, store, [spec for spec in meta.loads if not spec.fetch])
        self._count("injection_seconds", time.perf_counter() - t0)

    def _check_all_layers(self, forward_context: "ForwardContext") -> None:
        if not self._all_layers_checked:
            self.all_layers = AllLayersCache.of(self.kv_caches, self.layer_index, forward_context, self.kv_dtype)
            if self.fused_injection and self.device.type == "cuda" and inject_kernel.available():
                self.cache_views = self._probe_cache_views(forward_context)
            self._all_layers_checked = True
            logger.info("InferScale worker: %s", "one fused kernel for gather, rotation and all layers' writes"
                        if self.cache_views is not None else "one cache write for all layers"
                        if self.all_layers is not None else "one cache write per layer")

    def _probe_cache_views(self, forward_context: "ForwardContext") -> CacheViews | None:
        """The cache's K/V views found by writing two slots of the null block through each layer's own backend
        (inject_kernel.CacheViews.probe), or None: the unfused path."""
        names = sorted(self.kv_caches, key=self.layer_index.__getitem__)

        def backend_write(i: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
            write_kv(forward_context.no_compile_layers[names[i]], self.kv_caches[names[i]], key, value, slots)
        return CacheViews.probe([self.kv_caches[n] for n in names], backend_write, self.spec.num_kv_heads,
                                self.spec.head_dim, self.block_size, self.kv_dtype)

    def _inject(self, forward_context: "ForwardContext", store: FactStore,
                specs: list[LoadSpec]) -> dict[str, list[str]]:
        """Gathers each request's chunks from the store and writes them into its blocks, in groups; a request
        whose chunks cannot be gathered is a failed load (recomputed). Returns the store tier of each gathered
        request's chunks (the prefix chunk first), by request id."""
        tiers_of: dict[str, list[str]] = {}
        group: list[tuple[LoadSpec, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        group_tokens = 0
        for spec in specs:
            try:
                pieces, tiers = self._gather(store, spec)
            except KeyError as e:  # a fact the caller took for resident is not: listed, so its books learn it
                absent = [kv for kv in spec.kv_ids[1:] if not store.contains(spec.user_id, kv)]
                if absent:
                    self._absent.setdefault(spec.user_id, set()).update(absent)
                self._fail([spec], e)
                continue
            except (ValueError, LoadError, FileNotFoundError) as e:
                self._fail([spec], e)
                continue
            except RuntimeError as e:  # torch.OutOfMemoryError included: promoting a fact to the device
                if not is_out_of_memory(e):
                    raise
                self._fail([spec], e, oom=True)
                continue
            for tier in tiers:
                self._count(f"store_hits_{tier}")
            tiers_of[spec.req_id] = tiers
            if group and group_tokens + spec.end - spec.start > self.inject_group_tokens:
                self._write(forward_context, group)
                group, group_tokens = [], 0
            group.append((spec, pieces))
            group_tokens += spec.end - spec.start
        if group:
            self._write(forward_context, group)
        return tiers_of

    # ------------------------------------------------------------------ asynchronous loads

    def _fetch(self, user_id: str, kv_ids: list[str]) -> "FetchResult":
        """On a loader thread: puts into the store the facts it lacks that the cluster tier holds. The prefix
        chunk is always in the store; counters go back with the result (they are kept on the step's thread)."""
        store = self._require_store()
        need = [kv for kv in kv_ids if not store.contains(user_id, kv)]
        if not need or self.cluster is None:
            return FetchResult(user_id, need, [], {})
        t0 = time.perf_counter()
        mark = self._deletes.begin(user_id)
        deleted: list[str] = []

        def keep(kv: str, fact: EncodedFact) -> int | None:
            """Inside the read round: the fact, a view of the cluster client's read buffer, into the store (its
            one copy); the bytes kept, None when the store refuses it or a delete named it since the load began
            (a miss, computed by vLLM)."""
            try:
                fact = self._fitting(fact, store)
                with self._deletes.lock:
                    if self._deletes.deleted_since(user_id, mark, kv):
                        deleted.append(kv)
                        return None
                    store.put(user_id, kv, fact, write_file=False)  # its file: write-behind, below
            except ValueError as e:  # a shape or budget the store refuses
                logger.warning("InferScale: the cluster object of %s cannot be stored: %s", kv, e)
                return None
            return fact.nbytes

        try:
            got = self.cluster.read(user_id, need, keep)
        finally:
            self._deletes.end(user_id)
        if self._disk_writer is not None:
            kept = [kv for kv, n in zip(need, got.facts) if n is not None]
            if kept:
                self._disk_writer.submit(self._write_back, store, user_id, kept)
        missing = [kv for kv, kept in zip(need, got.facts) if kept is None]
        # Listed on a dead node's segment: read again later, not re-encoded.
        unreadable = [kv for kv, unread in zip(need, got.unreadable) if unread]
        counts = {"fetched_facts": len(need) - len(missing), "fetched_bytes": sum(n for n in got.facts if n),
                  "fetch_unreadable": len(unreadable), "fetch_seconds": time.perf_counter() - t0}
        fetched = [kv for kv, kept in zip(need, got.facts) if kept is not None]
        return FetchResult(user_id, missing, unreadable, counts, fetched, deleted)

    @staticmethod
    def _write_back(store: FactStore, user_id: str, kv_ids: list[str]) -> None:
        """On the disk writer's thread: the files of facts a load read from the cluster tier (a fact deleted,
        replaced or evicted meanwhile is skipped by write_back). A failure costs the node-local copy only."""
        for kv in kv_ids:
            try:
                store.write_back(user_id, kv)
            except OSError as e:  # a full or failing disk: the fact stays in memory and in the cluster tier
                logger.warning("InferScale: writing the disk-tier file of a loaded fact failed: %s", e)
                return

    def _settle(self, result: "FetchResult") -> None:
        """A load's counters and its facts found nowhere (for take_missing), on the step's thread."""
        for key, n in result.counts.items():
            self._count(key, n)
        found_nowhere = [kv for kv in result.missing if kv not in result.unreadable and kv not in result.deleted]
        self._count("fetch_misses", len(found_nowhere))
        if found_nowhere:
            self._missing.setdefault(result.user_id, set()).update(found_nowhere)
        if result.unreadable:
            self._absent.setdefault(result.user_id, set()).update(result.unreadable)

    def prefetch(self, user_id: str, kv_ids: list[str]) -> int:
        """Loads these facts of the user from the cluster tier in the background, behind the requests' loads
        (warming a replica: WARM_CHUNK_FACTS); returns how many were asked for. Their counters and misses are
        settled with the next step or take_missing."""
        check_id("user_id", user_id)
        ids = [check_id("kv_id", kv) for kv in kv_ids]
        self._require_store()
        if ids:
            assert self._warmer is not None  # made with the store, in register_kv_caches
            self._prefetching.append(self._warmer.submit(self._warm, user_id, ids))
        return len(ids)

    def _request_load_done(self, _fut: Future) -> None:
        with self._request_loads_lock:
            self._request_loads -= 1

    def _warm(self, user_id: str, kv_ids: list[str]) -> list["FetchResult"]:
        """On the warm-up thread: reads `kv_ids` a few at a time, each read after the requests' loads in flight
        (or WARM_YIELD_S of waiting for them)."""
        results = []
        for at in range(0, len(kv_ids), WARM_CHUNK_FACTS):
            until = time.monotonic() + WARM_YIELD_S
            while self._request_loads > 0 and not self._closing and time.monotonic() < until:
                time.sleep(0.002)
            if self._closing:
                break
            results.append(self._fetch(user_id, kv_ids[at:at + WARM_CHUNK_FACTS]))
        return results

    def _settle_prefetches(self) -> None:
        still = []
        for fut in self._prefetching:
            if not fut.done():
                still.append(fut)
                continue
            try:
                for result in fut.result():
                    self._settle(result)
            except Exception:  # a warm-up that failed: requests load what they need
                logger.exception("InferScale: a prefetch failed")
        self._prefetching = still

    def finished_loads(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """vLLM's transfer results, receiving side: writes the blocks of every asynchronous load that has arrived;
        returns the requests whose load ended (vLLM schedules them next step) and, among them, those whose load
        failed (vLLM computes them from position 0). A request that finished meanwhile (aborted) is returned
        without a write: vLLM keeps its blocks until then. Runs every step, on the step's thread."""
        if self._prefetching:
            self._settle_prefetches()
        self._aborted.update(r for r in finished_req_ids if r in self._fetching)
        done = [r for r, (_, fut) in self._fetching.items() if fut.done()]
        if not done:
            return set(), set()
        t0 = time.perf_counter()
        store = self._require_store()
        ready: list[LoadSpec] = []
        results: dict[str, FetchResult] = {}
        for r in done:
            spec, fut = self._fetching.pop(r)
            try:
                result = fut.result()
            except Exception as e:  # the loader's failure is this request's failed load
                logger.exception("InferScale: loading request %s failed", r)
                if r not in self._aborted:
                    self._fail([spec], e)
                self._aborted.discard(r)
                continue
            self._settle(result)
            if r in self._aborted:  # finished meanwhile: its blocks are vLLM's again once it is reported
                self._aborted.discard(r)
                continue
            if result.missing:
                # A partial load would need the memory's hash up to the first missing fact: the whole grant is
                # recomputed instead (correct, slower; rare).
                self._fail([spec], LoadError(f"{len(result.missing)} of the request's {len(spec.kv_ids) - 1} "
                                             "facts are in no tier"))
                continue
            ready.append(spec)
            results[r] = result
        if ready:
            assert self._forward_context is not None  # noted by the step that started these loads
            self._check_all_layers(self._forward_context)
            tiers_of = self._inject(self._forward_context, store, ready)
            self._count("injection_seconds", time.perf_counter() - t0)
            for spec in ready:  # the gathered and written ones (a failed write is recomputed, not reported here)
                if spec.req_id in tiers_of and spec.req_id not in self._failed_loads:
                    self._load_details[spec.req_id] = self._load_detail(spec, tiers_of[spec.req_id],
                                                                        results[spec.req_id])
        failed, self._failed_loads = self._failed_loads, set()
        return set(done), failed

    @staticmethod
    def _load_detail(spec: LoadSpec, tiers: list[str], result: FetchResult) -> dict[str, Any]:
        """Where one asynchronous load found its facts: those the loader read count as "cluster" (the store holds
        them by the time they are gathered), the others by the store tier they were gathered from."""
        fetched = set(result.fetched)
        facts_from: dict[str, int] = {}
        for kv, tier in zip(spec.kv_ids[1:], tiers[1:]):  # tiers[0]: the prefix chunk, always resident
            source = "cluster" if kv in fetched else tier
            facts_from[source] = facts_from.get(source, 0) + 1
        return {"facts_from": facts_from, "cluster_bytes": int(result.counts.get("fetched_bytes", 0)),
                "read_s": float(result.counts.get("fetch_seconds", 0.0))}

    def take_load_details(self) -> dict[str, dict[str, Any]]:
        """Drained: where the facts of each asynchronous load finished since the last call came from (req_id ->
        {"facts_from": {tier: facts}, "cluster_bytes", "read_s"})."""
        details, self._load_details = self._load_details, {}
        return details

    def take_missing(self) -> dict[str, dict[str, list[str]]]:
        """Drained since the last call, per user: "missing", the kv_ids found in no tier (to re-encode once), and
        "absent", those not in the store that may be elsewhere (listed in the cluster tier on a segment that
        could not be read; taken for resident by the caller but gone): its books must not count them."""
        self._settle_prefetches()
        missing, self._missing = self._missing, {}
        absent, self._absent = self._absent, {}
        return {"missing": {u: sorted(kvs) for u, kvs in missing.items()},
                "absent": {u: sorted(kvs) for u, kvs in absent.items()}}

    def shutdown(self) -> None:
        self._closing = True  # a warm-up stops before its next read
        if self._warmer is not None:
            self._warmer.shutdown(wait=True, cancel_futures=True)
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)
        if self._disk_writer is not None:  # files not written yet stay unwritten: the cluster tier has the facts
            self._disk_writer.shutdown(wait=True, cancel_futures=True)
        if self.cluster is not None:
            self.cluster.close()

    def _fail(self, specs: list[LoadSpec], err: BaseException, oom: bool = False) -> None:
        """Report the requests' loads as failed: vLLM recomputes them (kv_load_failure_policy="recompute"):
        slower, never wrong, and the engine keeps running. A synchronous load is reported by its blocks, an
        asynchronous one as a whole (failed_recving: vLLM computes it from position 0 and the scheduler side
        grants it nothing more)."""
        for spec in specs:
            logger.warning("InferScale: request %s not injected%s: %s", spec.req_id,
                           " (out of memory)" if oom else "", err)
            if spec.fetch:
                self._failed_loads.add(spec.req_id)
            else:
                self._failed_blocks.update(self._blocks_of(spec))
            self._count("load_failures")
            if oom:
                self._count("load_failures_oom")

    def _write(self, forward_context: "ForwardContext",
               group: list[tuple[LoadSpec, list[tuple[torch.Tensor, torch.Tensor]]]]) -> None:
        try:
            self._write_group(forward_context, group)
        except RuntimeError as e:  # the group's buffers did not fit: recompute these requests instead
            if not is_out_of_memory(e):
                raise
            self._fail([spec for spec, _ in group], e, oom=True)
            return
        for spec, _ in group:
            self._count("injected_requests")
            self._count("injected_tokens", spec.end - spec.start)

    def _write_group(self, forward_context: "ForwardContext",
                     group: list[tuple[LoadSpec, list[tuple[torch.Tensor, torch.Tensor]]]]) -> None:
        if self.cache_views is not None:
            self._write_fused(group)
            return
        from vllm import _custom_ops as ops

        positions, blocks = [], []
        for spec, _ in group:
            pos = torch.arange(spec.start, spec.end, device=self.device)
            block_ids = torch.tensor(spec.block_ids, dtype=torch.int64, device=self.device)
            positions.append(pos)
            blocks.append(block_ids[pos // self.block_size])
        pos, block = torch.cat(positions), torch.cat(blocks)
        # [L, N, H, D] views of the persistent buffers: our own copy, so the keys can be rotated in place (the
        # store keeps pre-RoPE keys), in memory that is already mapped (no page faults per request).
        k, v = self._group_buffers(pos.numel())
        torch.cat([piece_k for _, pieces in group for piece_k, _ in pieces], dim=1, out=k)
        torch.cat([piece_v for _, pieces in group for _, piece_v in pieces], dim=1, out=v)
        num_layers, n = k.shape[0], k.shape[1]
        # One fused rotation of all layers: layer l's token t sits at row l * N + t of the flattened view.
        assert self.cos_sin_cache is not None  # made with the store, in register_kv_caches
        ops.rotary_embedding(serial_tile(pos, num_layers), k.view(num_layers * n, -1), None,
                             self.spec.head_dim, self.cos_sin_cache, True)
        offset = pos % self.block_size
        if self.all_layers is not None:  # one cache write for every layer
            slots = self.all_layers.slots(block, offset, self.block_size)
            layer = forward_context.no_compile_layers[self.all_layers.layer_name]
            write_kv(layer, self.all_layers.cache, k.view(num_layers * n, *k.shape[2:]),
                     v.view(num_layers * n, *v.shape[2:]), slots)
            return
        slot_mapping = block * self.block_size + offset
        for name, kv_cache in self.kv_caches.items():
            i = self.layer_index[name]
            write_kv(forward_context.no_compile_layers[name], kv_cache, k[i], v[i], slot_mapping)

    def _write_fused(self, group: list[tuple[LoadSpec, list[tuple[torch.Tensor, torch.Tensor]]]]) -> None:
        """The group in one kernel launch: each piece read where the store keeps it (a host-tier piece is copied
        to the device first), rotated and written into every layer's blocks."""
        pieces = [(k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True))
                  for _, request_pieces in group for k, v in request_pieces]
        positions = [np.arange(spec.start, spec.end, dtype=np.int64) for spec, _ in group]
        slots = [np.asarray(spec.block_ids, dtype=np.int64)[pos // self.block_size] * self.block_size
                 + pos % self.block_size for (spec, _), pos in zip(group, positions)]
        assert self.cos_sin_cache is not None and self.cache_views is not None
        inject_kernel.inject(self.cache_views, pieces, np.concatenate(positions), np.concatenate(slots),
                             self.cos_sin_cache)
        self._count("fused_injections", len(group))

    def _group_buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`[L, n, H, D]` views of the K and V buffers, allocated once (grown for a request larger than
        `inject_group_tokens`, the only case where a group exceeds it)."""
        per_token = self.spec.num_layers * self.spec.num_kv_heads * self.spec.head_dim
        if self._buffers is None or self._buffers[0].numel() < n * per_token:
            self._buffers = None  # drop the old pair first: both may not fit at once
            size = max(n, self.inject_group_tokens) * per_token
            with torch.inference_mode(False):  # plain tensors: writable inside vLLM's inference mode and outside
                self._buffers = (torch.empty(size, dtype=self.kv_dtype, device=self.device),
                                 torch.empty(size, dtype=self.kv_dtype, device=self.device))
        shape = (self.spec.num_layers, n, self.spec.num_kv_heads, self.spec.head_dim)
        k, v = self._buffers
        return k[:n * per_token].view(shape), v[:n * per_token].view(shape)

    def _gather(self, store: FactStore, spec: LoadSpec) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[str]]:
        """Views `[L, t, H, D]` of the pre-RoPE keys and values that cover memory positions [start, end) in
        order, and the store tier each chunk came from. The prefix chunk comes from SHARED_USER_ID,
        every other chunk from the request's own user: ids never reach another user's facts."""
        keys = [(SHARED_USER_ID, spec.kv_ids[0])] + [(spec.user_id, kv) for kv in spec.kv_ids[1:]]
        tiers = [store.tier_of(ns, f) for ns, f in keys]  # raises for a missing fact before anything moves
        chunks = [store.get(ns, f) for ns, f in keys]
        token_ids = torch.cat([c.token_ids for c in chunks])
        # The scheduler matched the prompt against memory_hash; the chunks must be exactly those tokens, or
        # the KV written would belong to other text (a fact replaced meanwhile, a wrong id).
        if token_ids.numel() != spec.memory_len or memory_hash(token_ids.cpu()) != spec.memory_hash:
            raise LoadError(f"the facts {list(spec.kv_ids)} of user {spec.user_id!r} are not the memory the "
                            f"request was composed from ({token_ids.numel()} tokens, expected {spec.memory_len})")
        assert self.cos_sin_cache is not None  # made with the store, in register_kv_caches
        if spec.end > self.cos_sin_cache.shape[0]:
            raise LoadError(f"memory position {spec.end - 1} is beyond the rotary table "
                            f"({self.cos_sin_cache.shape[0]} positions)")
        pieces, offset = [], 0
        for c in chunks:
            lo, hi = max(spec.start, offset), min(spec.end, offset + c.num_tokens)
            if lo < hi:
                pieces.append((c.k_pre[:, lo - offset:hi - offset], c.v[:, lo - offset:hi - offset]))
            offset += c.num_tokens
        return pieces, tiers

    def _blocks_of(self, spec: LoadSpec) -> list[int]:
        first, last = spec.start // self.block_size, (spec.end - 1) // self.block_size
        return spec.block_ids[first:last + 1]

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ------------------------------------------------------------------ stats

    def _count(self, key: str, n: float = 1) -> None:
        if n:
            self._step[key] = self._step.get(key, 0) + n
            self._totals[key] += n

    def _resident(self) -> dict[str, int]:
        if self.store is None:
            return {}
        used = self.store.bytes_used()
        return {"resident_bytes_device": used["device"], "resident_bytes_host": used["host"]}

    def take_stats(self) -> dict[str, float]:
        """This step's counter deltas, plus resident bytes when they changed (vLLM's stats path)."""
        data, self._step = self._step, {}
        resident = self._resident()
        if resident != self._last_resident:
            data.update(resident)
            self._last_resident = resident
        return data

    def stats(self) -> dict[str, Any]:
        """Cumulative counters since the engine started, and the store's current state."""
        out: dict[str, Any] = dict(self._totals)
        out.update(self._resident())
        out["device_budget_bytes"] = self.device_budget_bytes
        if self.store is not None:
            s = self.store.stats()
            out["resident_bytes_disk"] = s["bytes"]["disk"]
            out["num_facts"] = s["num_facts"]
            out["num_users"] = len([u for u in self.store.users() if u != SHARED_USER_ID])
        return out


def cluster_config_option(extra_config: dict):
    """kv_connector_extra_config["cluster_store"] (ClusterConfig fields; absent or empty: no cluster tier) with
    "kv_fingerprint" (the encoder pool's, which names the objects), checked; the worker's client contributes
    no segment (it only reads)."""
    from .cluster_store import ClusterConfig

    d = extra_config.get("cluster_store")
    if not d:
        return None
    if not isinstance(d, dict):
        raise ValueError(f"cluster_store must be a dict of ClusterConfig fields, got {type(d).__name__}")
    fp = extra_config.get("kv_fingerprint")
    if not isinstance(fp, str) or not fp:
        raise ValueError("cluster_store needs kv_fingerprint (the encoder pool's fingerprint: it names the objects)")
    return ClusterConfig.from_dict({**d, "segment_bytes": 0})


def rotary_table(hf_config, spec: ModelSpec, max_model_len: int, device: torch.device,
                 dtype: torch.dtype) -> torch.Tensor:
    """vLLM's `cos_sin_cache` layout `[positions, rotary_dim]` (cos halves then sin halves, neox style) built
    from the family's own rotary module (scaling and attention factors included), in the cache dtype as
    vLLM's forward pass uses it. Dynamic RoPE is static only below max_position_embeddings."""
    num_positions = max_model_len
    if spec.rope_type == "dynamic":
        num_positions = min(num_positions, spec.max_position_embeddings)
    cos, sin = ChunkedRope(hf_config, device="cpu", dtype=torch.float32).cos_sin(torch.arange(num_positions))
    half = spec.rotary_dim // 2
    return torch.cat((cos[:, :half], sin[:, :half]), dim=-1).to(device=device, dtype=dtype).contiguous()


def serial_tile(x: torch.Tensor, n: int) -> torch.Tensor:
    """`x.repeat(n)` for a 1-D index tensor, on the CPU without torch's thread pool: a torch op over more than
    32K elements is a parallel region, and on a loaded machine each region waits for its slowest thread
    (measured at load 13 on 2 cores: 0.1 ms median, 77 ms at the 90th percentile, for the index arithmetic
    of one k=50 request; numpy 0.15 ms at the 90th percentile)."""
    if x.device.type != "cpu":
        return x.repeat(n)
    return torch.from_numpy(np.tile(x.numpy(), n))


class AllLayersCache:
    """Every layer's paged cache seen as ONE cache tensor, so one cache-write call covers all layers (one call
    instead of 30 for SmolLM2, and each call spreads its tokens over all threads).

    vLLM 0.32 allocates the layers' caches in one buffer: block b of layer l starts at `offset_l + b *
    block_stride` (layers outermost or blocks outermost, per layout). With a block stride `s` dividing
    `block_stride` and every `offset_l`, block b of layer l is block `(offset_l + b * block_stride) / s` of a
    view over the whole buffer. Used only where that view is checked against every layer's own cache, for
    vLLM's CPU attention backend (whose caches are `[blocks, ...]`) and an unquantized cache (a quantized one
    is written with per-layer scales)."""

    def __init__(self, cache: torch.Tensor, layer_name: str, layer_base: torch.Tensor, ratio: int):
        self.cache = cache  # the combined view
        self.layer_name = layer_name  # the layer whose backend does the write
        self.layer_base = layer_base  # [L] int64: combined block index of block 0 of layer l (by layer index)
        self.ratio = ratio  # block_stride / s

    def slots(self, block: torch.Tensor, offset: torch.Tensor, block_size: int) -> torch.Tensor:
        """Combined-view slots `[L * N]`, layer-major, of tokens in blocks `block` `[N]` at `offset` `[N]` (CPU
        tensors; computed with numpy, see `serial_tile`)."""
        combined = self.layer_base.numpy()[:, None] + block.numpy()[None, :] * self.ratio
        return torch.from_numpy((combined * block_size + offset.numpy()[None, :]).reshape(-1))

    @classmethod
    def of(cls, kv_caches: dict[str, torch.Tensor], layer_index: dict[str, int], forward_context,
           kv_dtype: torch.dtype) -> "AllLayersCache | None":
        """The combined view, or None where one write per layer is needed."""
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        names = sorted(kv_caches, key=layer_index.__getitem__)
        caches = [kv_caches[n] for n in names]
        first = caches[0]
        layers = [forward_context.no_compile_layers.get(n) for n in names]
        if (first.dtype != kv_dtype or any(not isinstance(getattr(x, "impl", None), CPUAttentionBackendImpl)
                                            for x in layers)):
            return None
        if any(c.dtype != first.dtype or c.shape != first.shape or c.stride() != first.stride()
               or c.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for c in caches):
            return None
        base = min(caches, key=lambda c: c.data_ptr())
        size = first.element_size()
        offsets = [(c.data_ptr() - base.data_ptr()) // size for c in caches]
        if any((c.data_ptr() - base.data_ptr()) % size for c in caches):
            return None
        block_stride, num_blocks = first.stride(0), first.shape[0]
        s = math.gcd(block_stride, *offsets)
        if s <= 0:
            return None
        last = max(o + (num_blocks - 1) * block_stride for o in offsets) // s
        cache = torch.as_strided(base, (last + 1, *first.shape[1:]), (s, *first.stride()[1:]),
                                 base.storage_offset())
        layer_base = torch.tensor([o // s for o in offsets], dtype=torch.int64, device=first.device)
        ratio = block_stride // s
        for c, b0 in zip(caches, layer_base.tolist()):  # the view's blocks are the layers' own blocks
            for b in (0, num_blocks - 1):
                if cache[b0 + b * ratio].data_ptr() != c[b].data_ptr():
                    return None
        return cls(cache, names[0], layer_base, ratio)


def write_kv(layer, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `key`/`value` `[N, H, D]` (model dtype) into the slots `slot_mapping` `[N]` of one layer's paged
    cache through the attention backend's own cache-write op, the one its forward pass uses: the cache layout
    (ISA-specific on CPU, per backend on CUDA) and its dtype (fp8 quantization with the layer's k/v scales)
    never matter here."""
    layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
