"""What the engine replica asks of its serving engine: the `ServingEngine` protocol, which AsyncInjectingEngine
(inferscale_core/serving_engine.py: vLLM with the injection connector) implements and the test double of
tests/unit/test_replica_core.py is checked against; how the real one is started; how its deaths and timings read.

The replica never reaches past this protocol into vLLM (its AsyncLLM, its model config, the request core's
tokenizer): everything it needs is a method here, so a test engine that is not vLLM is a complete one."""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import grpc

from ..encoder_pool import dtype_of
from ..errors import RETRY_AFTER_S, ApiError
from ..metrics import vllm_stat_loggers

log = logging.getLogger("inferscale.engine_replica")

if TYPE_CHECKING:  # typing only: vLLM and torch load when the replica starts its engine, not at import
    import asyncio

    from inferscale_core.requests import Answer, Prepared, Query
    from inferscale_core.types import EncodedFact

    from .config import EngineReplicaConfig


@runtime_checkable
class ServingEngine(Protocol):
    """A started serving engine: vLLM's paged KV cache behind the injection connector, whose worker keeps a store of
    encoded facts per user (memory and disk tiers) and loads from the cluster tier itself."""

    # ---- sizes, known once started
    def max_model_len(self) -> int: ...
    def kv_cache_tokens(self) -> int: ...
    def kv_bytes_per_token(self) -> int: ...

    # ---- the worker store (facts under their kv_ids)
    async def send_put(self, user_id: str, items: Sequence[tuple[str, EncodedFact]]) -> asyncio.Future: ...
    async def delete_encoded(self, user_id: str, kv_ids: Sequence[str] | None = None) -> int: ...
    async def has_encoded(self, user_id: str, kv_ids: Sequence[str]) -> list[bool]: ...
    async def list_encoded(self) -> dict[str, list[str]]: ...
    async def prefetch(self, user_id: str, kv_ids: Sequence[str]) -> int: ...
    async def take_missing(self) -> dict[str, dict[str, list[str]]]: ...

    # ---- generation
    def prepare_facts(self, q: Query, fact_ids: Sequence[str], texts: Sequence[str], versions: Sequence[int],
                      kv_ids: Sequence[str] | None = None) -> Prepared: ...
    def stream(self, p: Prepared, sampling_params=None) -> AsyncIterator[tuple[str, Answer | None]]: ...
    def generate(self, p: Prepared, sampling_params) -> AsyncIterator[Any]: ...
    def chat_prompt(self, messages: Sequence[dict], user_id: str) -> dict: ...
    async def chat(self, prompt: dict, sampling_params=None, background: bool = False) -> tuple[str, int, int]: ...
    def sampling_defaults(self) -> dict: ...
    def tokenizer(self) -> Any: ...

    # ---- life
    async def metrics(self) -> dict[str, Any]: ...
    async def check_health(self) -> None: ...
    def shutdown(self) -> None: ...


async def start_engine(config: EngineReplicaConfig, prefix, store_options: dict) -> ServingEngine:
    """The serving engine: vLLM with the injection connector (AsyncInjectingEngine) over the encoder pool's prefix
    chunk, started and warmed up (AsyncInjectingEngine.warm_up: vLLM's first-use costs paid before traffic)."""
    from inferscale_core.serving_engine import AsyncInjectingEngine

    engine = AsyncInjectingEngine(model_path=config.model_path, prefix=prefix, dtype=dtype_of(config.dtype),
                                  block_size=config.block_size, max_model_len=config.max_model_len,
                                  store_options=store_options, stat_loggers=vllm_stat_loggers(),
                                  **config.vllm_engine_args())
    await engine.start()
    t0 = time.monotonic()
    await engine.warm_up()
    log.info("engine warmed up in %.1f s (vLLM's first request with logprobs)", time.monotonic() - t0)
    return engine


@contextlib.contextmanager
def engine_death_is_unavailable():
    """A call that meets a dead vLLM engine is UNAVAILABLE (retryable: check_health has Serve replace this
    replica), not an internal error."""
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        yield
    except EngineDeadError:
        raise ApiError(grpc.StatusCode.UNAVAILABLE, "this engine replica's vLLM engine died; it is being replaced, "
                                                    "retry shortly", retry_after_s=RETRY_AFTER_S) from None


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def engine_timings(ans) -> dict[str, float]:
    """vLLM's own per-request hops (its RequestStateStats, engine-core clock) and the connector's: "vllm_queue"
    queued -> scheduled, "prefill" scheduled -> first token (a synchronous injection included), "kv_load" the
    time the request waited for its KV to be loaded asynchronously (grant -> the load's end seen by the scheduler;
    absent when nothing was loaded asynchronously), with "kv_load_read" the worker's read of the cluster tier
    inside it (present when it read); "engine_ttft" this replica's submit -> first token (the final chunk's
    ttft_ms).

    vLLM counts a request as scheduled only AFTER its asynchronous load: in vLLM 0.32's Scheduler.schedule
    (vllm/v1/core/sched/scheduler.py) a grant with load_kv_async parks the request (`request.status =
    RequestStatus.WAITING_FOR_REMOTE_KVS ... skip_request(request_queue); continue`) before
    `request.record_event(EngineCoreEventType.SCHEDULED, scheduled_timestamp)` is reached; it is reached in a
    later step, once the load has ended. So vLLM's queued -> scheduled contains the load; the load's spans (same
    clock: both are the engine core's time.monotonic()) are taken out of it, and out of prefill for a load after
    a preemption (scheduled_ts is the first scheduling only, vllm/v1/metrics/stats.py), so that the hops do not
    overlap: vllm_queue is the wait for the scheduler alone."""
    out = {"engine_ttft": ms(ans.ttft_s or 0.0)}
    load = getattr(ans, "kv_load", None)
    if load is not None:
        out["kv_load"] = ms(load.seconds)
        if load.read_s:
            out["kv_load_read"] = ms(load.read_s)
    st = ans.engine_stats
    if st is not None and st.queued_ts and st.scheduled_ts:
        waited = load.within(st.queued_ts, st.scheduled_ts) if load is not None else 0.0
        out["vllm_queue"] = ms(st.scheduled_ts - st.queued_ts - waited)
        if st.first_token_ts:
            waited = load.within(st.scheduled_ts, st.first_token_ts) if load is not None else 0.0
            out["prefill"] = ms(st.first_token_ts - st.scheduled_ts - waited)
    return out
