"""User affinity for the engine replicas: Serve's request router for EngineReplica (wired in services/app.py).

Serve's default router (power of two choices + multiplexing) prefers a replica that holds the user, but when
that replica has been at max_ongoing_requests for RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S (1 s) it
falls back to the replicas with the fewest users, then to any replica: under load a user is loaded again on
another replica (its facts re-encoded or read from disk there) and then lives on two.

`UserAffinityRouter` never falls back while the holder is alive:
  1. a request for a user goes to the live replica that holds it (loaded or loading, as the replicas report
     to Serve); the request waits there if that replica is full (the replica's own admission decides what to
     shed);
  2. a user no live replica holds goes to the replica that wins a rendezvous hash of (user, replica id): every
     router (each gateway replica's handles, a driver's handle) picks the same replica without talking to the
     others, users spread evenly in expectation, and adding or losing a replica moves only the users it wins
     or held;
  3. when the holder dies Serve drops it from the live set, so the user's next request goes to (2) and the
     user moves; a user held by two replicas (left from before, or two routers racing on its first request)
     is sent to the one the hash prefers among them, so every router agrees.
Requests without a user (plain chat, health) keep Serve's power-of-two choice.
"""
from __future__ import annotations

import hashlib

# Serve's own router, subclassed for requests without a user; a private module in ray 2.60 (pinned in pyproject).
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

ROUTER_PATH = "inferscale_server.routing:UserAffinityRouter"  # what a deployment's request_router_class names


def affinity_score(user_id: str, replica_key: str) -> int:
    """Rendezvous weight of a replica for a user: stable across processes (unlike hash())."""
    digest = hashlib.blake2b(f"{user_id}\0{replica_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def preferred_replica(user_id: str, replicas: list[RunningReplica]) -> RunningReplica:
    """The replica the user belongs on among `replicas` (non-empty): a holder if there is one, else the
    rendezvous winner; ties between holders are broken by the same hash."""
    holders = [r for r in replicas if user_id in r.multiplexed_model_ids]
    return max(holders or replicas, key=lambda r: affinity_score(user_id, r.replica_id.unique_id))


class UserAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Serve request router: one replica per user while it lives (see the module docstring)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        user_id = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not user_id or not candidate_replicas:
            return await super().choose_replicas(candidate_replicas, pending_request)
        # Only this replica: when it is full Serve backs off (0.025 s doubling to 0.5 s) and asks again, so the
        # request waits for it. Without should_backoff Serve would ask again at once, in a busy loop.
        pending_request.routing_context.should_backoff = True
        return [[preferred_replica(user_id, candidate_replicas)]]
