"""services/routing.py's choice of engine replica, without Ray: a user's home is a rendezvous hash over the
replicas' stable slots, the same in every process and after a restart; it spreads users and moves only the users
of a replica that comes or goes; an overloaded home is passed over for the next replica in the user's order.
(tests/service/two_engines/test_multi_replica.py, tests/service/ray_nodes/test_node_failure.py and
tests/service/test_kv_tier_service.py run it inside Serve.)"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from inferscale_server.routing import (
    IN_FLIGHT,
    InFlight,
    UserAffinityRouter,
    affinity_score,
    move_threshold,
    preference_order,
    replica_in_flight,
    replica_key,
)

ROOT = Path(__file__).resolve().parents[2]
USERS = [f"user-{i}" for i in range(900)]


@dataclass(frozen=True)
class _ReplicaId:
    unique_id: str


@dataclass
class Replica:
    """What the router reads of Serve's RunningReplica: its id, what it reports (the slot), and the ongoing
    requests the router's queue-length cache holds for it (None: unknown)."""
    unique_id: str
    slot: int | None = None
    ongoing: int | None = None
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 512

    @property
    def replica_id(self) -> _ReplicaId:
        return _ReplicaId(self.unique_id)

    @property
    def replica_metadata(self) -> dict:
        return {} if self.slot is None else {"slot": self.slot}


def order(user: str, replicas: list[Replica], move_at: int = 8) -> list[Replica]:
    return preference_order(user, replicas, replica_key, lambda r: r.ongoing, move_at)


def home(user: str, replicas: list[Replica], move_at: int = 8) -> Replica:
    return order(user, replicas, move_at)[0]


def three() -> list[Replica]:
    return [Replica(f"id-{s}", slot=s) for s in range(3)]


def test_the_home_is_the_hash_winner_whatever_the_order():
    replicas = three()
    for user in USERS[:50]:
        chosen = home(user, replicas)
        assert chosen is max(replicas, key=lambda r: affinity_score(user, f"slot-{r.slot}"))
        assert home(user, replicas[::-1]) is chosen


def test_a_restarted_replica_keeps_its_users():
    """Serve gives the replacement of a dead replica its rank but a new replica id: the homes do not change."""
    before = three()
    after = [before[0], Replica("id-new", slot=1), before[2]]
    assert all(home(u, before).slot == home(u, after).slot for u in USERS)
    # Keyed by Serve's replica ids (what the router used before), the dead replica's users (1/3) and the users the
    # new id wins from the others (1/3 of 2/3) would all have moved: 5/9 of them, 500 in expectation.
    by_id = [Replica(r.unique_id) for r in before]
    by_id_after = [by_id[0], Replica("id-new"), by_id[2]]
    moved = sum(home(u, by_id).unique_id != home(u, by_id_after).unique_id for u in USERS)
    assert 400 <= moved <= 600, moved


def test_users_spread_over_the_replicas():
    counts = Counter(home(u, three()).slot for u in USERS)
    assert set(counts) == {0, 1, 2}
    assert all(240 <= n <= 360 for n in counts.values()), counts  # 300 each in expectation


def test_losing_a_replica_moves_only_its_users_and_adding_one_only_those_it_wins():
    replicas = three()
    before = {u: home(u, replicas).slot for u in USERS}
    after = {u: home(u, replicas[:2]).slot for u in USERS}
    assert {u for u in USERS if before[u] != after[u]} == {u for u in USERS if before[u] == 2}
    grown = {u: home(u, [*replicas, Replica("id-3", slot=3)]).slot for u in USERS}  # scale 3 -> 4
    moved = {u for u in USERS if grown[u] != before[u]}
    assert all(grown[u] == 3 for u in moved) and 150 <= len(moved) <= 300, len(moved)  # 225 in expectation


def test_an_overloaded_home_is_passed_over_for_the_next_in_the_users_order():
    replicas = three()
    user = USERS[0]
    quiet = order(user, replicas)
    quiet[0].ongoing = 8  # at move_at, the others idle: overloaded
    busy = order(user, replicas)
    assert busy == [quiet[1], quiet[2], quiet[0]]  # the next in the user's own order, the home last
    quiet[0].ongoing = 7  # below: home again
    assert order(user, replicas) == quiet
    quiet[0].ongoing, quiet[1].ongoing = 9, 20  # home over, its second choice busier: the idle one, then home
    assert order(user, replicas) == [quiet[2], quiet[0], quiet[1]]
    for r in replicas:
        r.ongoing = None  # nothing known (Serve's cache entry expired): the hash order
    assert order(user, replicas) == quiet


def test_a_busy_home_keeps_its_user_unless_another_has_move_at_fewer_in_flight():
    """A move is a cold load: a home at or above move_at (8 here) keeps the user while every other replica has
    fewer than move_at fewer in flight, whether those are above move_at themselves or just below it (a move from 8
    to 7 would gain one request of queue for a cold load); at move_at fewer or more, those replicas go first."""
    replicas = three()
    for user in USERS[:20]:
        quiet = order(user, replicas)
        quiet[0].ongoing, quiet[1].ongoing, quiet[2].ongoing = 50, 45, 48  # all busy, alike: home
        assert order(user, replicas)[0] is quiet[0]
        quiet[1].ongoing = 43  # 7 fewer: still home
        assert order(user, replicas)[0] is quiet[0]
        quiet[1].ongoing = 42  # move_at fewer: that one first, then home
        assert order(user, replicas) == [quiet[1], quiet[0], quiet[2]]
        quiet[0].ongoing, quiet[1].ongoing, quiet[2].ongoing = 9, 7, 5  # home just over move_at, the others
        assert order(user, replicas) == quiet                            # just under it: home
        quiet[0].ongoing, quiet[1].ongoing, quiet[2].ongoing = 30, 41, 48  # home busy, the others busier: home
        assert order(user, replicas) == quiet
        for r in replicas:
            r.ongoing = None


def test_overflow_spreads_a_busy_replicas_users_over_the_others():
    """The users of an overloaded home go to their own second choices, not all to one replica."""
    replicas = [Replica(f"id-{s}", slot=s) for s in range(4)]
    replicas[0].ongoing = 100
    users = [u for u in USERS if home(u, replicas, move_at=1000).slot == 0]
    counts = Counter(home(u, replicas).slot for u in users)
    assert set(counts) == {1, 2, 3} and min(counts.values()) >= len(users) // 6, counts


def test_the_stable_key():
    assert replica_key(Replica("abc", slot=2)) == "slot-2"
    assert replica_key(Replica("abc")) == "abc"  # a replica that reports no slot: its id
    re_ranked = Replica("abc", slot=2, routing_stats={"slot": 0})  # Serve re-ranked it: the latest report wins
    assert replica_key(re_ranked) == "slot-0"


@pytest.mark.parametrize("target, max_ongoing, want", [(16, 512, 32), (8, 4, 4), (0.25, 512, 1), (2.5, 100, 5)])
def test_the_move_threshold_is_twice_the_autoscaling_target(target, max_ongoing, want):
    assert move_threshold(target, max_ongoing) == want


def test_the_score_is_the_same_in_every_process():
    """Every gateway replica routes alike: the score must not depend on Python's per-process hash seed."""
    code = "from inferscale_server.routing import affinity_score; print(affinity_score('alice', 'slot-7'))"
    outs = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert outs == {str(affinity_score("alice", "slot-7"))}


def test_the_routers_own_count_is_per_request_and_ignores_what_it_never_counted():
    """Serve calls on_request_routed for an accepted request and on_request_completed for every dispatched one,
    rejected tries included, from the thread that finishes it."""
    sent = InFlight()
    sent.routed("a", "r1")
    sent.routed("a", "r2")
    sent.routed("b", "r3")
    sent.completed("a", "rejected-try")  # dispatched to a, refused there: never counted
    sent.completed("b", "r1")  # r1 is a's
    assert (sent.count("a"), sent.count("b"), sent.count("c")) == (2, 1, 0)
    sent.completed("a", "r1")
    sent.completed("a", "r1")  # once only
    assert sent.count("a") == 1
    threads = [threading.Thread(target=lambda i=i: [f("c", f"{i}-{j}") for f in (sent.routed, sent.completed)
                                                    for j in range(500)]) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sent.count("c") == 0


@pytest.mark.parametrize("reported, own, want", [(None, 0, None), (None, 3, 3), (7, 0, 7), (7, 40, 40), (40, 7, 40)])
def test_a_replicas_load_is_the_larger_of_its_report_and_the_routers_count(reported, own, want):
    assert replica_in_flight(reported, own) == want


@dataclass
class _Metadata:
    multiplexed_model_id: str
    internal_request_id: str


@dataclass
class _Pending:
    metadata: _Metadata
    routing_context: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(should_backoff=False))


def test_a_user_stays_home_while_the_other_replicas_report_is_older_than_the_routers_own_sends():
    """Run (18) of issue 30: the other replica reported before its users' wave arrived, so a second later it still
    looked idle while this router had ~50 requests running there; 20 users of the busy home moved to it, each a cold
    load. The router's own count keeps them home; once its requests there finish, the move happens as before."""
    router = UserAffinityRouter(deployment_id=DeploymentID(name="EngineReplica", app_name="test"),
                                handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(move_at=32)
    replicas = [Replica(f"id-{s}", slot=s) for s in range(2)]
    user = USERS[0]
    home_, other = order(user, replicas, move_at=32)
    home_.routing_stats, other.routing_stats = {IN_FLIGHT: 50}, {IN_FLIGHT: 5}

    async def first_choice(request_id: str) -> Replica:
        ranks = await router.choose_replicas(replicas, _Pending(_Metadata(user, request_id)))
        return ranks[0][0]

    assert asyncio.run(first_choice("q0")) is other  # the report alone: 50 vs 5, moved
    for i in range(48):  # the other's wave, sent by this router since that report
        router.on_request_routed(_Pending(_Metadata(f"u{i}", f"w{i}")), other.replica_id, None)
    assert asyncio.run(first_choice("q1")) is home_
    for i in range(48):
        router.on_request_completed(other.replica_id, f"w{i}")
    assert asyncio.run(first_choice("q2")) is other
