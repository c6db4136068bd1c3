"""What an engine replica records of its users: the facts it serves them from (`UserBooks`: per user, the registry's
servable facts at the last sync, the locks that order a user's work) and the KV it keeps in its worker store
(`ResidentKV`: least recently used first, under a byte budget). Only bookkeeping: no I/O here."""
from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from dataclasses import dataclass

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


# A user's fair share of a replica's resident KV: over budget, the facts of users above it leave first (their
# least recently used), and only then the least recently used of all. A user alone may use the whole budget; one
# whose requests name ever new facts recycles its own share instead of flushing everyone else's KV.
USER_SHARE = 0.25


class ResidentKV:
    """The facts this replica put into its worker store, least recently used first, and their KV bytes. Over
    `budget_bytes` facts leave (the caller deletes them from the worker store): first the least recently used of
    users holding more than USER_SHARE of the budget, then the least recently used of all; a fact found in the
    worker store's disk tier, whose size is not known here, counts as the average fact."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the KV budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lru: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._user_bytes: dict[str, list[int]] = {}  # user -> [KV bytes, facts] held
        self.bytes = 0

    def has(self, user_id: str, kv: str) -> bool:
        return (user_id, kv) in self._lru

    def touch(self, user_id: str, kvs: list[str]) -> None:
        for kv in kvs:
            if (user_id, kv) in self._lru:
                self._lru.move_to_end((user_id, kv))

    def add(self, user_id: str, items: list[tuple[str, int | None]]) -> list[tuple[str, str]]:
        """Records `(kv_id, bytes or None)`; returns the (user, kv_id) to evict, never one of these."""
        for kv, nbytes in items:
            if nbytes is None:
                nbytes = self.bytes // len(self._lru) if self._lru else 0
            self._drop((user_id, kv))
            self._lru[(user_id, kv)] = nbytes
            self.bytes += nbytes
            held = self._user_bytes.setdefault(user_id, [0, 0])
            held[0] += nbytes
            held[1] += 1
        keep = {(user_id, kv) for kv, _ in items}
        share = self.budget_bytes * USER_SHARE
        out: list[tuple[str, str]] = []
        for over_share_only in (True, False):  # two passes over the LRU order: O(facts held)
            for key in list(self._lru):
                if self.bytes <= self.budget_bytes:
                    return out
                if key not in keep and (not over_share_only or self._user_bytes[key[0]][0] > share):
                    self._drop(key)
                    out.append(key)
        return out

    def _drop(self, key: tuple[str, str]) -> None:
        nbytes = self._lru.pop(key, None)
        if nbytes is None:
            return
        self.bytes -= nbytes
        held = self._user_bytes[key[0]]
        held[0] -= nbytes
        held[1] -= 1
        if not held[1]:
            del self._user_bytes[key[0]]

    def user_bytes(self, user_id: str) -> int:
        return self._user_bytes.get(user_id, [0, 0])[0]

    def discard(self, user_id: str, kvs) -> None:
        for kv in kvs:
            self._drop((user_id, kv))

    def kvs_of(self, user_id: str) -> list[str]:
        return [kv for u, kv in self._lru if u == user_id]

    def drop_user(self, user_id: str) -> None:
        self.discard(user_id, self.kvs_of(user_id))

    def count(self) -> int:
        return len(self._lru)
