"""services/routing.py's choice of engine replica, without Ray: the holder first, else a rendezvous hash that every
process computes the same way, spreads users, and moves only the users of a replica that goes away.
(tests/test_multi_replica.py and tests/test_node_failure.py run the router inside Serve.)"""
from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from inferscale_server.routing import affinity_score, preferred_replica

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class _ReplicaId:
    unique_id: str


@dataclass
class Replica:
    """The two attributes of Serve's RunningReplica that the choice reads."""
    name: str
    multiplexed_model_ids: set[str] = field(default_factory=set)

    @property
    def replica_id(self) -> _ReplicaId:
        return _ReplicaId(self.name)


USERS = [f"user-{i}" for i in range(900)]


def test_a_new_user_goes_to_the_hash_winner_whatever_the_order():
    replicas = [Replica("a1"), Replica("b2"), Replica("c3")]
    for user in USERS[:50]:
        chosen = preferred_replica(user, replicas)
        assert chosen is max(replicas, key=lambda r: affinity_score(user, r.name))
        assert preferred_replica(user, replicas[::-1]) is chosen


def test_users_spread_over_the_replicas():
    replicas = [Replica("a1"), Replica("b2"), Replica("c3")]
    counts = Counter(preferred_replica(u, replicas).name for u in USERS)
    assert set(counts) == {"a1", "b2", "c3"}
    assert all(240 <= n <= 360 for n in counts.values()), counts  # 300 each in expectation


def test_losing_a_replica_moves_only_its_users():
    replicas = [Replica("a1"), Replica("b2"), Replica("c3")]
    before = {u: preferred_replica(u, replicas).name for u in USERS}
    after = {u: preferred_replica(u, replicas[:2]).name for u in USERS}
    moved = {u for u in USERS if before[u] != after[u]}
    assert moved == {u for u in USERS if before[u] == "c3"}


def test_the_holder_wins_over_the_hash():
    user = USERS[0]
    a, b = Replica("a1"), Replica("b2")
    winner, loser = sorted((a, b), key=lambda r: affinity_score(user, r.name), reverse=True)
    loser.multiplexed_model_ids.add(user)
    assert preferred_replica(user, [a, b]) is loser
    winner.multiplexed_model_ids.add(user)  # held twice: the hash picks among the holders
    assert preferred_replica(user, [a, b]) is winner


def test_the_score_is_the_same_in_every_process():
    """Every gateway replica routes alike: the score must not depend on Python's per-process hash seed."""
    code = "from inferscale_server.routing import affinity_score; print(affinity_score('alice', 'replica-7'))"
    outs = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert outs == {str(affinity_score("alice", "replica-7"))}
