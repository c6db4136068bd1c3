"""The engine replica's books of its worker store's KV (services/engine_replica/books.py ResidentKV; issue 31): on
fair_lru.FairLRU, they evict exactly what the scan of every user they replaced evicted, over thousands of random
operations, and choosing each fact to evict no longer costs work in proportion to the users held. (Its first tests,
the rule on small cases, are in test_kv_tier.py.)"""
from __future__ import annotations

import random
import sys
from collections import OrderedDict

import pytest

from inferscale_server.engine_replica.books import ResidentKV


class ScanResidentKV:
    """ResidentKV as it was before FairLRU (commit 4e6b59b), verbatim but for its docstring: the reference model.
    Each evicted fact took a copy of every user's bytes and a max() over them."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the KV budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._held: dict[str, OrderedDict[str, int]] = {}  # user -> kv_id -> bytes, least recently used first
        self._user_bytes: dict[str, int] = {}
        self._count = 0
        self.bytes = 0

    def has(self, user_id: str, kv: str) -> bool:
        return kv in self._held.get(user_id, ())

    def touch(self, user_id: str, kvs: list[str]) -> None:
        held = self._held.get(user_id)
        if held is not None:
            for kv in kvs:
                if kv in held:
                    held.move_to_end(kv)

    def add(self, user_id: str, items: list[tuple[str, int | None]]) -> list[tuple[str, str]]:
        for kv, nbytes in items:
            if nbytes is None:
                nbytes = self.bytes // self._count if self._count else 0
            self._drop(user_id, kv)
            self._held.setdefault(user_id, OrderedDict())[kv] = nbytes
            self._user_bytes[user_id] = self._user_bytes.get(user_id, 0) + nbytes
            self.bytes += nbytes
            self._count += 1
        keep = {kv for kv, _ in items}
        out: list[tuple[str, str]] = []
        while self.bytes > self.budget_bytes:
            victim = self._victim(user_id, keep)
            if victim is None:  # only the facts just added are left: kept, over budget
                break
            self._drop(*victim)
            out.append(victim)
        return out

    def _victim(self, adding: str, keep: set[str]) -> tuple[str, str] | None:
        candidates = dict(self._user_bytes)
        while candidates:
            user = max(candidates, key=lambda u: (candidates[u], u == adding))
            for kv in self._held[user]:
                if user != adding or kv not in keep:
                    return user, kv
            del candidates[user]
        return None

    def _drop(self, user_id: str, kv: str) -> None:
        held = self._held.get(user_id)
        nbytes = held.pop(kv, None) if held is not None else None
        if nbytes is None:
            return
        self.bytes -= nbytes
        self._count -= 1
        self._user_bytes[user_id] -= nbytes
        if not held:
            del self._held[user_id], self._user_bytes[user_id]

    def user_bytes(self, user_id: str) -> int:
        return self._user_bytes.get(user_id, 0)

    def discard(self, user_id: str, kvs) -> None:
        for kv in kvs:
            self._drop(user_id, kv)

    def kvs_of(self, user_id: str) -> list[str]:
        return list(self._held.get(user_id, ()))

    def drop_user(self, user_id: str) -> None:
        self.discard(user_id, self.kvs_of(user_id))

    def count(self) -> int:
        return self._count


USERS = [f"u{i}" for i in range(7)]


def assert_same_books(new: ResidentKV, ref: ScanResidentKV, step: int) -> None:
    assert (new.bytes, new.count()) == (ref.bytes, ref.count()), step
    for user in USERS:
        assert new.kvs_of(user) == ref.kvs_of(user), (step, user)  # the same facts, in the same LRU order
        assert new.user_bytes(user) == ref.user_bytes(user), (step, user)


# budget 0: every add evicts all but what it adds; 40: a few facts; 400: rarely full (the tie and keep paths each)
@pytest.mark.parametrize("budget,seed", [(0, 1), (40, 2), (40, 3), (120, 4), (400, 5)])
def test_the_books_evict_exactly_what_the_scan_of_every_user_evicted(budget, seed):
    rnd = random.Random(seed)
    new, ref = ResidentKV(budget), ScanResidentKV(budget)
    kvs = [f"f{i}@v{v}" for i in range(12) for v in (1, 2)]  # few ids: re-adds of a held fact are common
    sizes = [0, 1, 5, 10, 10, 20, 50, None, None]  # repeated sizes: ties between users are common
    for step in range(4000):
        user, op = rnd.choice(USERS), rnd.random()
        if op < 0.55:
            # 1-4 facts (a fact named twice now and then), each of a size or unknown (the average)
            items = [(rnd.choice(kvs), rnd.choice(sizes)) for _ in range(rnd.randint(1, 4))]
            if rnd.random() < 0.05:
                items = []
            assert new.add(user, items) == ref.add(user, items), step
        elif op < 0.75:
            names = rnd.sample(kvs, rnd.randint(1, 5))
            new.touch(user, names)
            ref.touch(user, names)
        elif op < 0.93:
            names = rnd.sample(kvs, rnd.randint(1, 3))
            new.discard(user, names)
            ref.discard(user, names)
        else:
            new.drop_user(user)
            ref.drop_user(user)
        assert all(new.has(user, kv) == ref.has(user, kv) for kv in kvs), step
        assert_same_books(new, ref, step)


def test_among_other_users_holding_the_same_the_one_holding_kv_the_longest_pays():
    """The scan's tie order, kept: max() over the users in the order they came to hold KV."""
    for books in (ResidentKV(60), ScanResidentKV(60)):
        books.add("x", [("x1", 10), ("x2", 10)])
        books.add("y", [("y1", 20)])
        books.add("x", [("x3", 0)])  # x's holding changed last, it still holds KV the longest
        books.discard("y", ["y1"])
        books.add("y", [("y1", 20)])  # y emptied and came back: the shortest now
        books.add("z", [("z1", 20)])
        assert books.add("w", [("w1", 5)]) == [("x", "x1")], type(books).__name__


def test_negative_bytes_are_refused_before_anything_changes():
    r = ResidentKV(100)
    r.add("a", [("f@v1", 10)])
    with pytest.raises(ValueError, match="must be >= 0, got -1 for 'g@v1'"):
        r.add("a", [("f@v1", 20), ("g@v1", -1)])
    assert (r.bytes, r.count(), r.kvs_of("a"), r.user_bytes("a")) == (10, 1, ["f@v1"], 10)


def profile_events(work) -> int:
    """How many Python and builtin calls `work()` makes (sys.setprofile's events): deterministic, where a time on
    this shared machine is not. A scan of every user is a call per user in the scan above (its max() key)."""
    events = 0

    def count(frame, event, arg):
        nonlocal events
        events += 1

    sys.setprofile(count)
    try:
        work()
    finally:
        sys.setprofile(None)
    return events


def eviction_work(cls, users: int) -> tuple[int, int]:
    """(profile events, facts evicted) of 40 adds that each evict, beside `users` users each holding 20 bytes: new
    users adding more than any (all of theirs kept: the largest other user pays), and a user adding at a tie (it
    pays itself)."""
    books = cls(budget_bytes=20 * users)
    for i in range(users):
        books.add(f"u{i}", [(f"a{i}", 10), (f"b{i}", 10)])
    evicted: list[tuple[str, str]] = []

    def work():
        for i in range(20):
            evicted.extend(books.add(f"new{i}", [(f"n{i}", 30)]))
            evicted.extend(books.add("steady", [(f"s{i}", 10)]))

    events = profile_events(work)
    assert books.bytes <= books.budget_bytes
    return events, len(evicted)


def test_choosing_what_to_evict_does_not_scan_every_user():
    """The same 40 adds beside 10 users and beside 10,000: the books' work per evicted fact stays the same (a heap
    of users: O(log users), and logarithms are builtin heapq calls here), where the scan's grows with the users."""
    small_events, small_evicted = eviction_work(ResidentKV, 10)
    big_events, big_evicted = eviction_work(ResidentKV, 10_000)
    assert small_evicted >= 40 and big_evicted >= 40
    assert big_events / big_evicted <= 1.5 * small_events / small_evicted, (small_events, big_events)
    # the measure has teeth: the scan it replaced, on the same adds, makes a call per user held per evicted fact
    scan_events, scan_evicted = eviction_work(ScanResidentKV, 10_000)
    assert scan_events >= 10_000 * scan_evicted
