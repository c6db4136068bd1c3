"""Each caller's share of a gateway replica: requests in flight and a request rate per principal (the token's
subject), so one tenant's slow clients or floods cannot hold the slots every tenant's requests need. Over either
bound: RESOURCE_EXHAUSTED (HTTP 429) at once, with a retry hint, before the request is read further.

A request holds its slot until the task that runs it ends: gRPC (grpc.aio and Ray Serve's proxy) and HTTP
(uvicorn and Serve's HTTP path) run each request, its streamed response included, in one asyncio task, so the
slot is given back however the request ends (answer, error, cancelled stream) without every front door having to
release it. Admin tokens (memory:admin, the operator acting for users) are not limited. The bounds are per
gateway replica: with R replicas a tenant has R shares, as it has R times the slots.

A refusal that the caller's own use caused (its rate, its work budget, its extraction slots: PAUSED_REASONS) is
answered after its retry hint, Limits.refusal_pause_max_s at most and within the caller's deadline, while the request
holds one of the caller's slots (`pause_before_refusal`): a client that retries at once, as most misbehaving
clients do, then sends one request per slot per pause instead of one per round trip, and its refusals stop costing
the others (each costs ~12 ms of the gateway's and Serve's proxy's CPU on the reference node: 4 clients retrying an
extraction refusal at once took 43 s of CPU in 45 s, bench/noisy_neighbour.py `extraction`). A short hint does not
shorten the pause below the caller's requests in flight / REFUSALS_PER_S_PER_CALLER, so that a caller's refusals
come at about that rate however many clients retry at once. A caller's paused refusals are bounded by its slots;
over those, CALLER_CONCURRENCY is answered at once. Paused: the refusals at authentication
(GatewayCore.authenticate), of the extraction queue, and of a work charge deeper in a request (its caller's other
requests put it in debt meanwhile; GatewayCore._refusal_paused)."""
from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from ..auth import Principal
from ..deadlines import time_left
from ..errors import ApiError

TRACKED_PRINCIPALS = 65_536  # rate buckets kept (LRU): a bucket left out refills to full, the generous answer
PAUSED_REASONS = frozenset({"CALLER_RATE", "CALLER_WORK", "EXTRACTION_QUEUE_FULL"})
# A caller's paused refusals are spread so that about this many a second are answered, whatever its slots: a pause
# is at least (the caller's requests in flight) / this. With the retry hint alone, a hint shorter than a second (a
# small work debt) let a client retrying from 16 threads at once get 1,201 refusals in 45 s, ~27 a second at
# ~11 ms of the gateway's and the proxy's CPU each (bench/noisy_neighbour.py `search_flood`, 2026-12-02): the
# refusals, not its admitted work, became what the caller cost the others.
REFUSALS_PER_S_PER_CALLER = 4.0
# The caller (token subject) of the request this task serves, set when its slot is counted (PrincipalLimits.admit).
_SUBJECT: contextvars.ContextVar[str | None] = contextvars.ContextVar("inferscale_caller_subject", default=None)


async def pause_before_refusal(err: ApiError, max_s: float, spread_s: float = 0.0) -> None:
    """Waits before `err` is answered, when the caller's own use caused it (PAUSED_REASONS): the longer of its retry
    hint and `spread_s` (PrincipalLimits.refusal_spread_s), `max_s` at most, ending before the caller's deadline (the
    refusal, not DEADLINE_EXCEEDED, is what the caller gets). Call it only in the request's task, after the caller's
    slot is held."""
    if err.reason not in PAUSED_REASONS or not err.retry_after_s or max_s <= 0:
        return
    try:
        pause, _ = time_left(min(max(err.retry_after_s, spread_s), max_s))
    except ApiError:  # the caller's deadline has passed: answer now
        return
    if pause:
        await asyncio.sleep(pause)


@dataclass(frozen=True)
class PrincipalLimit:
    max_in_flight: int = 64     # requests at once (of a gateway replica's 512 slots: one tenant takes an eighth)
    rate_per_s: float = 100.0   # sustained requests per second
    burst: int = 200            # requests at once after a quiet spell

    def __post_init__(self):
        if self.max_in_flight < 1 or not self.rate_per_s > 0 or self.burst < 1:
            raise ValueError(f"per-principal limits must be positive, got {self}")


class PrincipalLimits:
    def __init__(self, limit: PrincipalLimit = PrincipalLimit()):
        self.limit = limit
        self._in_flight: dict[str, set[asyncio.Task]] = {}
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # subject -> (tokens, at)
        self.refused = {"in_flight": 0, "rate": 0}

    def admit(self, caller: Principal | None) -> None:
        """Counts this request (the current task) against its caller's share, or raises RESOURCE_EXHAUSTED: over
        its slots (CALLER_CONCURRENCY, no slot taken) or its rate (CALLER_RATE, the slot taken: it is held until
        the request's task ends, so that the refusal can be paused within the caller's slots)."""
        if caller is None or caller.admin:
            return
        _SUBJECT.set(caller.subject)
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no event loop (a direct call): rate only, nothing to hold
            task = None
        held = self._in_flight.get(caller.subject)
        if held is not None and task in held:
            return  # one request authenticating twice (a front door and the core) is one request
        if held is not None and len(held) >= self.limit.max_in_flight:
            self.refused["in_flight"] += 1
            raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"this caller has {len(held)} requests in flight, the limit per caller is "
                           f"{self.limit.max_in_flight}; retry when one has finished",
                           retry_after_s=1.0, reason="CALLER_CONCURRENCY")
        if task is not None:  # not in a task (a direct test call): rate only, nothing to release against
            self._in_flight.setdefault(caller.subject, set()).add(task)
            task.add_done_callback(functools.partial(self._release, caller.subject))
        self._take_token(caller.subject)

    def in_flight(self, user_id: str) -> int:
        return len(self._in_flight.get(user_id, ()))

    def refusal_spread_s(self) -> float:
        """The least pause of a refusal of this task's caller: its requests in flight (each paused refusal holds
        one) / REFUSALS_PER_S_PER_CALLER; 0 for a request not counted (no token, an admin)."""
        subject = _SUBJECT.get()
        return self.in_flight(subject) / REFUSALS_PER_S_PER_CALLER if subject is not None else 0.0

    def _take_token(self, who: str) -> None:
        now = time.monotonic()
        tokens, at = self._buckets.pop(who, (float(self.limit.burst), now))
        tokens = min(float(self.limit.burst), tokens + (now - at) * self.limit.rate_per_s)
        if tokens < 1.0:
            self._buckets[who] = (tokens, now)
            self.refused["rate"] += 1
            raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"this caller is over its request rate ({self.limit.rate_per_s:g} per second, bursts of "
                           f"{self.limit.burst}); retry shortly", retry_after_s=(1.0 - tokens) / self.limit.rate_per_s,
                           reason="CALLER_RATE")
        self._buckets[who] = (tokens - 1.0, now)
        while len(self._buckets) > TRACKED_PRINCIPALS:
            self._buckets.popitem(last=False)

    def _release(self, who: str, task: asyncio.Task) -> None:
        held = self._in_flight.get(who)
        if held is not None:
            held.discard(task)
            if not held:
                del self._in_flight[who]
