"""What an engine replica records of its users: the facts it serves them from (`UserBooks`: per user, the registry's
servable facts at the last sync, the locks that order a user's work) and the KV it keeps in its worker store
(`ResidentKV`: under a byte budget, the user holding the most pays first). Only bookkeeping: no I/O here."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from inferscale_core.fair_lru import FairLRU

from ..user_sync import UserBook


@dataclass(frozen=True)
class HeldFact:
    """A servable fact of a held user, as the registry had it at the last sync: its version, its text (prompt
    mode needs it) and its window (a re-encode needs it)."""
    version: int
    text: str
    window: tuple[str, ...] = ()
    expires_at: float = math.inf  # FactRecord.expires_at: not injected from then on


class UserBooks:
    """Per user: its servable facts and the registry version they were synced at (`book`, the record the retrieval
    replica keeps too), the kv_ids a disk tier may still hold of it, and the
    lock that orders its syncs, loads and deletes. A user is held from its first write or request until it is
    unloaded or deleted (`forget`)."""

    def __init__(self):
        self.book: UserBook[HeldFact] = UserBook(lambda h: h.version)
        # kv_ids the worker store may hold that ResidentKV does not count: its disk tier's files at start and what a
        # disk tier keeps of users this replica unloaded. A request asks the engine core about these only (one
        # RPC into its step loop); any other fact not counted resident is known to be absent.
        self.maybe_on_disk: dict[str, set[str]] = {}
        self.loaded: set[str] = set()  # users registered here (outside Serve: Serve's loader keeps its own)
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, user_id: str) -> asyncio.Lock:
        return self._locks.setdefault(user_id, asyncio.Lock())

    def held(self, user_id: str) -> dict[str, HeldFact]:
        """The user's servable facts (an empty record for a user not synced yet)."""
        return self.book.of(user_id)

    def held_users(self) -> list[str]:
        return sorted(self.book.facts)

    def forget(self, user_id: str) -> None:
        """Every record of the user goes (its lock stays: a task may be waiting on it)."""
        self.book.forget(user_id)
        self.maybe_on_disk.pop(user_id, None)


class ResidentKV:
    """The facts this replica put into its worker store, per user least recently used first, and their KV bytes.
    Over `budget_bytes` facts leave (the caller deletes them from the worker store), each time the least recently
    used fact of the user holding the most: every user holding KV has the same share of the budget (budget / users),
    so the user furthest beyond it pays first (issue 31). A tenant whose requests name ever new facts recycles its
    own KV and never flushes the others', however many tenants there are; a user alone still uses the whole budget.
    A fact found in the worker store's disk tier, whose size is not known here, counts as the average fact.

    The books are a `FairLRU` (the fact store's tiers' rule, a heap of users by bytes): choosing each fact to evict
    costs O(log users) on the replica's event loop, where a scan of every user held cost O(users) per fact."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the KV budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        # user -> kv_id -> (user, kv_id): the value is what `add` returns for an evicted fact. ties="held": among
        # other users holding the same bytes the one holding KV the longest pays, the order the scan this replaced
        # took (the adding user pays any tie first, as the rule says).
        self._lru: FairLRU[str, tuple[str, str]] = FairLRU(ties="held")
        self._count = 0

    @property
    def bytes(self) -> int:
        return self._lru.bytes

    def has(self, user_id: str, kv: str) -> bool:
        return (user_id, kv) in self._lru

    def touch(self, user_id: str, kvs: list[str]) -> None:
        for kv in kvs:
            if (user_id, kv) in self._lru:
                self._lru.touch(user_id, kv)

    def add(self, user_id: str, items: list[tuple[str, int | None]]) -> list[tuple[str, str]]:
        """Records `(kv_id, bytes or None)`; returns the (user, kv_id) to evict, never one of these (when only
        these are left over the budget, they stay, over it, until a later call evicts)."""
        for kv, nbytes in items:  # refused before anything changes
            if nbytes is not None and nbytes < 0:
                raise ValueError(f"a fact's KV bytes must be >= 0, got {nbytes} for {kv!r}")
        for kv, nbytes in items:
            if nbytes is None:  # the average as it stands, a fact this replaces still counted
                nbytes = self.bytes // self._count if self._count else 0
            self._drop(user_id, kv)
            self._lru.add(user_id, kv, (user_id, kv), nbytes)
            self._count += 1
        keep = {kv for kv, _ in items}
        out: list[tuple[str, str]] = []
        while self.bytes > self.budget_bytes:
            # the user holding the most (on a tie, the adding user), the facts it just added aside
            victim = self._lru.victim(user_id, keep=keep)
            if victim is None:  # only the facts just added are left: kept, over budget
                break
            self._drop(*victim)
            out.append(victim)
        return out

    def _drop(self, user_id: str, kv: str) -> None:
        if (user_id, kv) in self._lru:
            self._lru.remove(user_id, kv)
            self._count -= 1

    def user_bytes(self, user_id: str) -> int:
        return self._lru.owner_bytes(user_id)

    def discard(self, user_id: str, kvs) -> None:
        for kv in kvs:
            self._drop(user_id, kv)

    def kvs_of(self, user_id: str) -> list[str]:
        """The user's kv_ids, least recently used first."""
        return self._lru.keys_of(user_id)

    def drop_user(self, user_id: str) -> None:
        self.discard(user_id, self.kvs_of(user_id))

    def count(self) -> int:
        return self._count
