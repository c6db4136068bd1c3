"""Admission of generation requests into one engine replica's vLLM, sized from its KV cache.

vLLM batches what it has been given; requests that wait outside it (in Serve's queues) never join a batch.
So an engine replica takes every request whose tokens fit, and refuses the rest at once:

    capacity   the KV cache's tokens (vLLM's number of blocks x block size, read after the engine started)
    limit      capacity x queue_factor: a factor above 1 lets vLLM's own scheduler hold a waiting queue, so
               a batch is refilled the moment a request finishes
    a request  counts prompt tokens + max_tokens (what it may occupy at its longest) while it runs

A request that does not fit while others run gets `EngineAtCapacity` (gRPC RESOURCE_EXHAUSTED, HTTP 429 with
Retry-After). A request alone is always admitted, whatever its size (vLLM refuses what can never fit).
"""
from __future__ import annotations

import contextlib
import math

import grpc

from .errors import ApiError

DEFAULT_QUEUE_FACTOR = 2.0
RETRY_AFTER_S = 1


class EngineAtCapacity(ApiError):
    """Overload, not a request that is too big: RESOURCE_EXHAUSTED on gRPC, 429 with Retry-After on HTTP."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S):
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_s=retry_after_s,
                         reason="ENGINE_AT_CAPACITY")

    def __reduce__(self):  # crosses Ray processes as itself, so the HTTP front door can tell it from 413
        return (EngineAtCapacity, (self.message, self.retry_after_s))


def check_queue_factor(queue_factor) -> float:
    if isinstance(queue_factor, bool) or not (isinstance(queue_factor, (int, float)) and math.isfinite(queue_factor)
                                               and queue_factor >= 1):
        raise ValueError(f"admission queue_factor must be a number >= 1, got {queue_factor!r}")
    return float(queue_factor)


class Admission:
    """Tokens in flight against the limit. Single event loop (the replica's): no lock needed."""

    def __init__(self, capacity_tokens: int, queue_factor: float = DEFAULT_QUEUE_FACTOR):
        if capacity_tokens < 1:
            raise ValueError(f"the KV cache capacity must be >= 1 token, got {capacity_tokens}")
        check_queue_factor(queue_factor)
        self.capacity_tokens = int(capacity_tokens)
        self.limit_tokens = int(capacity_tokens * queue_factor)
        self.in_flight_tokens = 0
        self.in_flight = 0
        self.admitted = 0
        self.refused = 0

    @contextlib.contextmanager
    def admit(self, tokens: int):
        """Holds `tokens` for the body's duration (also when the client goes away), or raises EngineAtCapacity."""
        if self.in_flight and self.in_flight_tokens + tokens > self.limit_tokens:
            self.refused += 1
            raise EngineAtCapacity(f"the engine is at capacity ({self.in_flight_tokens} tokens in flight of "
                                   f"{self.limit_tokens}); retry later")
        self.in_flight_tokens += tokens
        self.in_flight += 1
        self.admitted += 1
        try:
            yield
        finally:
            self.in_flight_tokens -= tokens
            self.in_flight -= 1

    def stats(self) -> dict:
        return {"capacity_tokens": self.capacity_tokens, "limit_tokens": self.limit_tokens,
                "in_flight_tokens": self.in_flight_tokens, "in_flight": self.in_flight,
                "admitted": self.admitted, "refused": self.refused}
