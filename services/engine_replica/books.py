"""What an engine replica records of its users: the facts it serves them from (`UserBooks`: per user, the registry's
servable facts at the last sync, the locks that order a user's work) and the KV it keeps in its worker store
(`ResidentKV`: under a byte budget, the user holding the most pays first). Only bookkeeping: no I/O here."""
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


class ResidentKV:
    """The facts this replica put into its worker store, per user least recently used first, and their KV bytes.
    Over `budget_bytes` facts leave (the caller deletes them from the worker store), each time the least recently
    used fact of the user holding the most: every user holding KV has the same share of the budget (budget / users),
    so the user furthest beyond it pays first (issue 31). A tenant whose requests name ever new facts recycles its
    own KV and never flushes the others', however many tenants there are; a user alone still uses the whole budget.
    A fact found in the worker store's disk tier, whose size is not known here, counts as the average fact."""

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
        """Records `(kv_id, bytes or None)`; returns the (user, kv_id) to evict, never one of these."""
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
        """The least recently used fact of the user holding the most bytes (on a tie, `adding`), the facts `adding`
        just added aside."""
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
