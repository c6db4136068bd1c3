"""Admission of generation requests into one engine replica's vLLM, sized from its KV cache.

vLLM batches what it has been given; requests that wait outside it (in Serve's queues) never join a batch.
So an engine replica takes every request whose tokens fit, and refuses the rest at once:

    capacity   the KV cache's tokens (vLLM's number of blocks x block size, read after the engine started)
    limit      capacity x queue_factor: a factor above 1 lets vLLM's own scheduler hold a waiting queue, so
               a batch is refilled the moment a request finishes
    a request  counts prompt tokens + max_tokens (what it may occupy at its longest) while it runs

A request that does not fit while others run gets `EngineAtCapacity` (gRPC RESOURCE_EXHAUSTED, HTTP 429 with
Retry-After). A request alone is always admitted, whatever its size (vLLM refuses what can never fit).

Each user's share (issue 31): what fits in the KV cache runs at once; beyond it vLLM queues first come first
served, so a tenant that keeps the limit full makes every other user's request wait behind its tokens (or be
refused). When a request would take the tokens in flight past the KV cache (the engine is contended: it would
queue), a user's share is limit / (users with requests in flight, itself included), and a request that would
take its user past that share is refused, with the same EngineAtCapacity, though the limit has room. What is left
stays free for the other users' next requests instead of queueing behind the heavy one. A user with nothing in
flight is never refused by its share (its first request is always its share, whatever its size: never below one
request), a user alone has the whole limit, and below the KV cache's size no share applies.
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
    """Tokens in flight against the limit, in all and per user. Single event loop (the replica's): no lock."""

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
        self.refused_over_share = 0  # of `refused`: the limit had room, the user was past its share
        self._by_user: dict[str, int] = {}  # user id -> tokens in flight (users with nothing in flight absent)

    def share_tokens(self, user_id: str) -> int:
        """What `user_id` may hold now: the limit divided among the users with requests in flight and it."""
        users = len(self._by_user) + (user_id not in self._by_user)
        return self.limit_tokens // users

    @contextlib.contextmanager
    def admit(self, user_id: str, tokens: int):
        """Holds `tokens` for `user_id` for the body's duration (also when the client goes away), or raises
        EngineAtCapacity: the limit is full, or this request would queue in vLLM and take its user, who already
        holds requests, past its share."""
        if tokens < 1:
            raise ValueError(f"a request holds at least 1 token, got {tokens}")
        if self.in_flight and self.in_flight_tokens + tokens > self.limit_tokens:
            self.refused += 1
            raise EngineAtCapacity(f"the engine is at capacity ({self.in_flight_tokens} tokens in flight of "
                                   f"{self.limit_tokens}); retry later")
        held = self._by_user.get(user_id, 0)
        contended = self.in_flight_tokens + tokens > self.capacity_tokens
        if contended and held and held + tokens > (share := self.share_tokens(user_id)):
            self.refused += 1
            self.refused_over_share += 1
            raise EngineAtCapacity(f"the engine is contended and shared by {len(self._by_user)} users with requests "
                                   f"in flight; this user holds {held} tokens of its share of {share} (this "
                                   f"request: {tokens}); retry later")
        self.in_flight_tokens += tokens
        self.in_flight += 1
        self._by_user[user_id] = held + tokens
        self.admitted += 1
        try:
            yield
        finally:
            self.in_flight_tokens -= tokens
            self.in_flight -= 1
            left = self._by_user[user_id] - tokens
            if left:
                self._by_user[user_id] = left
            else:
                del self._by_user[user_id]

    def stats(self) -> dict:
        return {"capacity_tokens": self.capacity_tokens, "limit_tokens": self.limit_tokens,
                "in_flight_tokens": self.in_flight_tokens, "in_flight": self.in_flight,
                "users_in_flight": len(self._by_user), "admitted": self.admitted, "refused": self.refused,
                "refused_over_share": self.refused_over_share}
