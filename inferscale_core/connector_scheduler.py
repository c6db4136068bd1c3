"""Scheduler half of InferScaleConnector: decide how many of a request's prompt tokens are injected, and tell
the worker which positions to write into which blocks. Holds no KV; runs in the scheduler's process.

Two ways a grant is loaded:
  - synchronously (the default): the worker writes the blocks before the forward pass of the step that schedules
    the request; its facts must be in the worker store by then;
  - asynchronously (`InjectionParams.fetch`): `get_num_new_matched_tokens` answers `(n, True)`, vLLM allocates the
    blocks and parks the request in WAITING_FOR_REMOTE_KVS; the LoadSpec goes to the worker in the metadata of the
    same step, the worker reads what its store lacks from the cluster tier on a loader thread and reports the
    request in `get_finished` once the blocks are written (or failed: vLLM recomputes them). Other requests keep
    stepping meanwhile: the scheduler never waits for KV.

The time an asynchronous load makes the request wait is timed here, where vLLM's own per-request timestamps are
taken (the engine core's `time.monotonic()`): from the grant (update_state_after_alloc) to the moment the
worker's report of its end reaches `loads_ended`; `request_finished` returns it as a `LoadReport`, which vLLM
puts on the request's last RequestOutput (`kv_transfer_params`).
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from .connector_types import (
    InjectionMetadata,
    InjectionParams,
    LoadReport,
    LoadSpec,
    injectable_tokens,
    memory_hash,
    recompute_facts_max_k_option,
    recompute_facts_option,
    recompute_tokens_option,
    recomputed_suffix,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class _LoadClock:
    """One request's asynchronous loads so far: closed (granted, loaded) spans, the open grant, what the worker
    reported about where the facts came from."""

    spans: list[tuple[float, float]] = field(default_factory=list)
    granted: float | None = None
    failed: int = 0
    facts_from: dict[str, int] = field(default_factory=dict)
    cluster_bytes: int = 0
    read_s: float = 0.0

    def ended(self, now: float, failed: bool, details: dict[str, Any] | None) -> None:
        if self.granted is None:  # no load open: a report for a grant this side never made
            return
        self.spans.append((self.granted, now))
        self.granted = None
        self.failed += int(failed)
        if details:
            for tier, n in details.get("facts_from", {}).items():
                self.facts_from[tier] = self.facts_from.get(tier, 0) + n
            self.cluster_bytes += details.get("cluster_bytes", 0)
            self.read_s += details.get("read_s", 0.0)

    def report(self) -> LoadReport | None:
        if not self.spans:  # finished (aborted) while its only load was in flight: nothing to say
            return None
        return LoadReport(tuple(self.spans), self.failed, self.facts_from, self.cluster_bytes, self.read_s)


class SchedulerSide:
    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", extra_config: dict | None = None):
        # What of the memory vLLM computes with the query: its last N tokens, its last r facts (whole); the
        # longer suffix wins when both are set.
        self.recompute_tokens = recompute_tokens_option(extra_config or {})
        self.recompute_facts = recompute_facts_option(extra_config or {})
        self.recompute_facts_max_k = recompute_facts_max_k_option(extra_config or {})
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(
                f"InferScaleConnector supports models with one KV cache group (full attention in every layer); "
                f"this model has {len(kv_cache_config.kv_cache_groups)}")
        # Requests granted a synchronous injection by update_state_after_alloc, until build_connector_meta hands
        # them to the worker: req_id -> (params, number of tokens to load).
        self._pending: dict[str, tuple[InjectionParams, int]] = {}
        # Asynchronous loads allocated this step (their blocks are known at allocation, and the request is not
        # among the step's scheduled ones): handed to the worker by the next build_connector_meta.
        self._async: list[LoadSpec] = []
        # Requests whose asynchronous load failed (the worker's failed_recving). vLLM then computes the request
        # from position 0 and asks the connector again: it gets nothing (a new grant would fetch, fail and be
        # asked again, forever). After a preemption a request is granted again as usual.
        self._load_failed: set[str] = set()
        # req_id -> its asynchronous loads' times, from the first grant until request_finished returns them.
        self._clocks: dict[str, _LoadClock] = {}
        self._stats: dict[str, int] = {}

    def _count(self, key: str, n: int = 1) -> None:
        self._stats[key] = self._stats.get(key, 0) + n

    def take_stats(self) -> dict[str, int]:
        stats, self._stats = self._stats, {}
        return stats

    def _params(self, request: "Request") -> InjectionParams | None:
        try:
            return InjectionParams.from_kv_transfer_params(request.kv_transfer_params)
        except (ValueError, TypeError) as e:
            # Raising here would take the whole engine down; the request just runs without injection.
            logger.warning("request %s: ignoring malformed InferScale parameters: %s", request.request_id, e)
            self._count("requests_invalid")
            return None

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Memory tokens to inject beyond the local prefix-cache hit `num_computed_tokens` (block aligned), and
        whether they are loaded asynchronously (the request asked the worker to fetch its facts). Called again
        for a request that could not be scheduled yet, and after a preemption; side-effect free apart from
        counters."""
        params = self._params(request)
        if params is None:
            return 0, False
        self._count("requests_checked")
        if request.request_id in self._load_failed:
            return 0, False
        n = max(self._injectable(request, params) - num_computed_tokens, 0)
        return n, bool(n and params.fetch)

    def _injectable(self, request: "Request", params: InjectionParams) -> int:
        """Prompt tokens the connector provides (from position 0), 0 when the request's memory does not match."""
        prompt = request.prompt_token_ids or []
        m = params.memory_len
        # Inject only a memory this prompt really starts with: the KV written must be the KV of these tokens.
        if len(prompt) <= m or memory_hash(prompt[:m]) != params.memory_hash:
            self._count("requests_mismatched")
            return 0
        if self.recompute_facts and params.chunk_lens is None:
            # Without the fact boundaries the facts to recompute are unknown: vLLM computes the whole memory.
            logger.warning("request %s: recompute_facts is set but its InferScale parameters carry no chunk_lens; "
                           "not injecting", request.request_id)
            self._count("requests_invalid")
            return 0
        recompute = recomputed_suffix(params.chunk_lens or (), self.recompute_tokens, self.recompute_facts,
                                      self.recompute_facts_max_k)
        return injectable_tokens(len(prompt), m, recompute)

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        """`block_ids`: the request's blocks (group 0) after this allocation, local prefix-cache hits first."""
        if num_external_tokens <= 0:
            self._pending.pop(request.request_id, None)
            return
        params = self._params(request)
        assert params is not None  # we only granted tokens to requests with valid parameters
        if not params.fetch:
            self._pending[request.request_id] = (params, num_external_tokens)
            return
        # Asynchronous: the grant ends where the injectable memory ends; it starts after the local hit. Its clock
        # starts now: vLLM has allocated the blocks and parks the request in WAITING_FOR_REMOTE_KVS.
        self._clocks.setdefault(request.request_id, _LoadClock()).granted = time.monotonic()
        end = self._injectable(request, params)
        self._async.append(LoadSpec(req_id=request.request_id, user_id=params.user_id, kv_ids=params.kv_ids,
                                    memory_len=params.memory_len, memory_hash=params.memory_hash,
                                    block_ids=list(block_ids), start=end - num_external_tokens, end=end,
                                    fetch=True))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> InjectionMetadata:
        """Positions [num_computed - n, num_computed) of each granted request, where num_computed counts the
        local hit plus the n injected tokens. Requests resumed after a preemption arrive among the cached
        requests with their whole block list."""
        meta = InjectionMetadata()
        meta.loads.extend(self._async)
        self._async = []
        for req in scheduler_output.scheduled_new_reqs:
            if req.req_id in self._pending:
                meta.loads.append(self._load(req.req_id, req.block_ids[0], req.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._pending and req_id in cached.resumed_req_ids:
                block_ids = cached.new_block_ids[i]
                assert block_ids is not None, "a resumed request comes with all its block ids"
                meta.loads.append(self._load(req_id, block_ids[0], cached.num_computed_tokens[i]))
        if self._pending:  # granted at admission but not in this step's output: cannot happen for sync loads
            logger.warning("InferScale: dropping %d injections that were not scheduled", len(self._pending))
            self._pending.clear()
        return meta

    def _load(self, req_id: str, block_ids: list[int], num_computed_tokens: int) -> LoadSpec:
        params, n = self._pending.pop(req_id)
        return LoadSpec(req_id=req_id, user_id=params.user_id, kv_ids=params.kv_ids,
                        memory_len=params.memory_len, memory_hash=params.memory_hash, block_ids=list(block_ids),
                        start=num_computed_tokens - n, end=num_computed_tokens)

    def request_finished(self, request: "Request") -> dict[str, Any] | None:
        """Forgets the request; returns its asynchronous loads (`LoadReport.to_kv_transfer_params`) for vLLM to put
        on its last RequestOutput, None when it had none."""
        self._pending.pop(request.request_id, None)
        self._load_failed.discard(request.request_id)
        clock = self._clocks.pop(request.request_id, None)
        report = clock.report() if clock is not None else None
        return report.to_kv_transfer_params() if report is not None else None

    def loads_ended(self, finished: Iterable[str], failed: Iterable[str],
                    details: dict[str, dict[str, Any]] | None = None) -> None:
        """The worker's asynchronous loads that ended in the last step (vLLM's update_connector_output):
        `finished` all of them, `failed` those among them that failed, `details` where the worker found the
        facts of each (InjectionWorkerMetadata.loads)."""
        failed = set(failed)
        self._load_failed.update(failed)
        now = time.monotonic()
        for req_id in finished:
            clock = self._clocks.get(req_id)
            if clock is not None:
                clock.ended(now, req_id in failed, (details or {}).get(req_id))
