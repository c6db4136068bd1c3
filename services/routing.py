"""Soft user affinity for the engine replicas: Serve's request router for EngineReplica (wired in services/app.py).

A user's KV lives in the cluster tier (Mooncake, readable by every replica) and, once used, in the fast tiers
(memory, disk) of the replica that served it. So any replica CAN serve any user; the router only makes it
likely that the replica it picks already holds the user:

  1. Home: every user has a home replica, the winner of a rendezvous hash of (user, replica slot). The slot is
     Serve's rank of the replica within the deployment (0, 1, ...): a replica that dies is replaced under the
     same rank, so a restart keeps every user's home (and, with a disk tier, the slot's folder,
     engine_replica/placement.py replica_disk_dir), unlike Serve's replica ids, which are new on every start. Every router
     (each gateway replica's handles, a driver's handle) computes the same home without talking to the
     others; adding a replica moves only the users it wins, losing one moves only its users.
  2. Soft: a home with `move_at` or more requests in flight is passed over for the replicas that have at least
     `move_at` fewer in flight, in the user's hash order. A replica's requests in flight are the larger of two
     counts: what it reports (its admission's count, all routers' requests, sent every ROUTING_STATS_PERIOD_S
     as Serve's routing stats, so up to a second old) and what this router sent it and has not seen finish
     (exact and current, but only this router's). Either alone moved users that should have stayed: with the
     report alone, a replica that reported before a wave of its users arrived still looked idle a second later
     (bench/results/service_n1_n100_k50_2replicas_2retrieval_bf16_stream8.md: 20 users moved to a replica
     whose ~50 requests were still running, each a cold load); Serve's per-router queue-length cache, used before
     the report, keeps a probe taken under load while the router keeps sending elsewhere. Such a replica reads
     the user's KV from the cluster tier. A move is a cold load (at k=50 some 35 MB read and written into the
     cache, queued behind that replica's other loads), so a home only a few requests busier than the others
     keeps its users (the rule before moved a user from a home at `move_at` to any replica below it, one request
     less busy at worst: bench/results/service_n1_n100_k50_2replicas_2retrieval_bf16_spread.md, 16 cold loads of
     200 at N=100, every one a user both replicas held). Serve itself skips a replica at its max_ongoing_requests and tries
     the next in the order, so a full or dead home never holds a user up.
  3. When the load falls the user goes home again (the home still holds it, or reads it from the cluster).
Requests without a user (plain chat, health) keep Serve's power-of-two choice.

`preference_order` is the whole policy, a pure function, and `InFlight` the router's own count (both tested
without Ray in tests/unit/test_routing.py).
"""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

# Serve's own router, subclassed for requests without a user; a private module in ray 2.60 (pinned in pyproject).
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

ROUTER_PATH = "inferscale_server.routing:UserAffinityRouter"  # what a deployment's request_router_class names
SLOT = "slot"  # the key of a replica's stable slot in its replica_metadata / routing_stats (EngineReplica)
IN_FLIGHT = "in_flight"  # the key of a replica's requests in flight in its routing_stats (EngineReplica)
ROUTING_STATS_PERIOD_S = 1.0  # how often Serve asks each replica for its routing stats

R = TypeVar("R")


def affinity_score(user_id: str, replica_key: str) -> int:
    """Rendezvous weight of a replica for a user: stable across processes (unlike hash())."""
    digest = hashlib.blake2b(f"{user_id}\0{replica_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def move_threshold(target_ongoing_requests: float, max_ongoing_requests: int) -> int:
    """Ongoing requests at which a user's home counts as overloaded: twice the autoscaling target (the
    autoscaler is adding replicas by then), at most Serve's own limit."""
    return max(1, min(int(max_ongoing_requests), round(2 * target_ongoing_requests)))


def preference_order(user_id: str, replicas: Sequence[R], key: Callable[[R], str],
                     ongoing: Callable[[R], int | None], move_at: int) -> list[R]:
    """`replicas` in the order to try for the user: the user's hash order over the stable keys (its home first),
    except that a home with `move_at` or more ongoing requests goes after the replicas with at least `move_at`
    fewer (those in the user's hash order, so one busy home's users spread over their own second choices).
    Unknown counts count as 0. Ties of the same key (never two live replicas, briefly during a replacement) keep
    the hash order by the key then the input order."""
    ranked = sorted(replicas, key=lambda r: affinity_score(user_id, key(r)), reverse=True)
    if not ranked:
        return ranked
    home_load = ongoing(ranked[0]) or 0
    if home_load < move_at:
        return ranked
    relief = [r for r in ranked[1:] if (ongoing(r) or 0) <= home_load - move_at]
    return relief + [r for r in ranked if r not in relief]


class InFlight:
    """The requests a router sent to each replica and has not seen finish: Serve calls `on_request_routed` when
    a replica accepted a request and `on_request_completed` once for every request it dispatched (accepted,
    rejected or failed), the latter from whichever thread finishes the request; so requests are counted by id,
    under a lock, and a completion of a request never counted (a rejected try) changes nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_replica: dict[str, set[str]] = {}  # replica id -> internal request ids in flight there

    def routed(self, replica: str, request: str) -> None:
        with self._lock:
            self._by_replica.setdefault(replica, set()).add(request)

    def completed(self, replica: str, request: str) -> None:
        with self._lock:
            requests = self._by_replica.get(replica)
            if requests is not None:
                requests.discard(request)
                if not requests:
                    del self._by_replica[replica]

    def count(self, replica: str) -> int:
        with self._lock:
            return len(self._by_replica.get(replica, ()))


def replica_in_flight(reported: int | None, own: int) -> int | None:
    """A replica's requests in flight as the router weighs them: the larger of its last report (every router's
    requests, up to a second old) and this router's own count (current, this router's only); None when neither
    knows of any (no report yet and nothing sent)."""
    if reported is None:
        return own or None
    return max(reported, own)


def replica_key(replica: RunningReplica) -> str:
    """A replica's stable slot ("slot-N", its Serve rank, reported by the replica), else its id (a replica
    that does not report one: it still gets users, but not the same ones after a restart)."""
    slot = replica.routing_stats.get(SLOT, replica.replica_metadata.get(SLOT))
    return f"slot-{slot}" if slot is not None else replica.replica_id.unique_id


class UserAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Serve request router: a user's home replica unless it is overloaded (see the module docstring)."""

    move_at: int | None = None  # None: a replica's own max_ongoing_requests

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent = InFlight()  # this router's requests in flight per replica (Serve's hooks below keep it)

    def initialize_state(self, move_at: int | None = None, **kwargs) -> None:
        super().initialize_state(**kwargs)
        if move_at is not None and (not isinstance(move_at, int) or move_at < 1):
            raise ValueError(f"request_router_kwargs.move_at must be a positive int, got {move_at!r}")
        self.move_at = move_at

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        self.sent.routed(replica_id.unique_id, pending_request.metadata.internal_request_id)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self.sent.completed(replica_id.unique_id, internal_request_id)

    def in_flight(self, replica: RunningReplica) -> int | None:
        return replica_in_flight(replica.routing_stats.get(IN_FLIGHT), self.sent.count(replica.replica_id.unique_id))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        user_id = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if pending_request is None or not user_id or not candidate_replicas:
            return await super().choose_replicas(candidate_replicas, pending_request)
        move_at = self.move_at or min(r.max_ongoing_requests for r in candidate_replicas)
        order = preference_order(user_id, candidate_replicas, replica_key, self.in_flight, move_at)
        # One replica per rank: Serve tries them in this order, each only if it accepts (below its
        # max_ongoing_requests); when none does it backs off (0.025 s doubling to 0.5 s) and asks again.
        pending_request.routing_context.should_backoff = True
        return [[r] for r in order]
