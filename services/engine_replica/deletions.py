"""Deletes and updates reaching an engine replica's KV, by one path: the registry's tombstone log.

The registry writes a tombstone in the same atomic step as every delete, update and DeleteUser (services/registry:
user, fact, the last version to remove, whether the fact is gone). Each replica reads the log from its cursor and
removes what a tombstone names from its books, its worker store (memory and disk: held users, users it unloaded,
users it held before a restart) and, for deletes, the cluster tier (every replica does: one that was down at the
time may be the only one left). It reads the log:
  - at start, from where this slot's last replica stopped (the cursor is saved on the disk tier, beside the files
    it covers), before any request;
  - every watch round (services/engine_replica/core.py);
  - when the gateway pushes a delete to the replica that serves the user (`apply` now: the push is only a hint
    that the log moved, so a lost push costs a watch round, never a fact).
A request's own sync (books.UserBooks) drops a held fact whose version moved, should its tombstone be late.
A tombstone that names what no request may name (the reserved owner of the shared prefix, an invalid id) is
logged, counted (`tombstones_skipped`) and passed: one bad entry never stops a replica from applying everyone's
deletes. A failure that may pass (the engine or the cluster tier away) keeps the cursor before it: retried."""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from inferscale_core.cluster_store import VERSIONS_NAMED
from inferscale_core.errors import check_id
from inferscale_core.types import SHARED_USER_ID, check_user_id, kv_id, kv_id_parts

from .books import ResidentKV, UserBooks
from .engine import ServingEngine

log = logging.getLogger("inferscale.engine_replica")
TOMBSTONE_CURSOR = "tombstones.cursor"  # in the replica's disk folder: how far it applied the registry's tombstones
# Beside it: the cluster tier's removes that could not be done yet (the store away); ClusterStore keeps the file.
CLUSTER_REMOVES_PENDING = "cluster-removes.pending"


class Deletions:
    def __init__(self, engine: ServingEngine, registry, cluster, books: UserBooks, resident: ResidentKV,
                 counters: dict, disk_dir: str | None):
        self.engine, self.registry, self.cluster = engine, registry, cluster
        self.books, self.resident, self.counters, self.disk_dir = books, resident, counters, disk_dir
        self._cursor: str | None = None
        self._reading = asyncio.Lock()  # one reader of the log at a time: a tombstone is applied once

    async def start(self) -> None:
        """From the cursor this slot saved, else (no disk tier, a new slot) from the log's end: this replica holds
        nothing older. Applies what it finds. A saved cursor the log was trimmed past (the slot was away longer
        than the log keeps) cannot say what was deleted meanwhile: the replica then checks what it holds against
        the registry (reconcile) and reads on from the log's end as it was before that check."""
        saved = self._saved_cursor()
        if saved is not None and await asyncio.to_thread(self.registry.tombstones_missed, saved):
            log.warning("the registry's tombstone log was trimmed past this slot's cursor: checking what this "
                        "replica holds against the registry")
            saved = None
            end = (await asyncio.to_thread(self.registry.tombstones_after, None))[1]
            await self.reconcile()
            self._cursor = end
        else:
            self._cursor = saved or (await asyncio.to_thread(self.registry.tombstones_after, None))[1]
        await asyncio.to_thread(self._save_cursor)
        await self.apply()

    async def reconcile(self) -> int:
        """What this replica holds (its worker store's facts, memory and disk, and its books), checked user by user
        against the registry: the KV of a fact deleted, or of a version not the current one, is removed (and a
        deleted fact's objects from the cluster tier); a user the registry no longer has is forgotten everywhere.
        One read per user held: for a start after missed tombstones, not a request path. Returns the KV entries
        removed."""
        held = await self.engine.list_encoded()
        users = (set(held) | set(self.books.book.facts)) - {SHARED_USER_ID}
        removed = 0
        for user in sorted(users):
            current = await asyncio.to_thread(self.registry.fact_versions, user)
            async with self.books.lock(user):
                if not current:  # deleted (DeleteUser, or every fact)
                    self.forget_user_books(user)
                    removed += len(held.get(user, []))
                    await self.engine.delete_encoded(user, None)
                    if self.cluster is not None:
                        await asyncio.to_thread(self.cluster.remove_user, user)
                    continue
                book = self.books.book.facts.get(user, {})
                for fact_id in [f for f, h in book.items() if current.get(f) != h.version]:
                    del book[fact_id]
                    self.books.book.synced.pop(user, None)  # the next request syncs the user again
                stale = [kv for kv in held.get(user, []) if kv_id_parts(kv)[1] != current.get(kv_id_parts(kv)[0])]
                if stale:
                    self.resident.discard(user, stale)
                    await self.engine.delete_encoded(user, stale)
                    removed += len(stale)
                    gone = {kv_id_parts(kv)[0] for kv in stale} - set(current)
                    for fact_id in sorted(gone) if self.cluster is not None else ():
                        await asyncio.to_thread(self.cluster.remove_versions, user, fact_id)
        self.counters["kv_reconciled"] += removed
        log.info("reconciled %d users against the registry: %d KV entries removed", len(users), removed)
        return removed

    async def apply(self) -> int:
        """Applies every tombstone written since the cursor; returns how many."""
        applied = 0
        async with self._reading:
            while True:
                tombs, cursor = await asyncio.to_thread(self.registry.tombstones_after, self._cursor)
                for t in tombs:
                    try:
                        check_user_id("user_id", t.user_id)
                        if t.fact_id:
                            check_id("fact_id", t.fact_id)
                        await self._bury(t)
                    except ValueError as err:  # bad input, the same on every retry: skipped, never a wedge
                        log.error("skipped a tombstone that cannot be applied (user %r, fact %r): %s",
                                  str(t.user_id)[:80], str(t.fact_id)[:80], err)
                        self.counters["tombstones_skipped"] += 1
                        applied -= 1
                self._cursor = cursor
                if not tombs:
                    break
                applied += len(tombs)
                await asyncio.to_thread(self._save_cursor)
        self.counters["tombstones_applied"] += applied
        return applied

    async def _bury(self, t) -> None:
        async with self.books.lock(t.user_id):
            if not t.fact_id:  # DeleteUser
                self.forget_user_books(t.user_id)
                await self.engine.delete_encoded(t.user_id, None)
                if self.cluster is not None:
                    await asyncio.to_thread(self.cluster.remove_user, t.user_id)
                return
            ids = [kv_id(t.fact_id, v) for v in range(max(1, t.upto - VERSIONS_NAMED + 1), t.upto + 1)]
            held = self.books.book.facts.get(t.user_id, {})
            if t.fact_id in held and held[t.fact_id].version <= t.upto:  # the next request re-syncs the user
                del held[t.fact_id]
                self.books.book.synced.pop(t.user_id, None)
            self.resident.discard(t.user_id, ids)
            await self.engine.delete_encoded(t.user_id, ids)
            if t.gone and self.cluster is not None:  # an update's older versions: the encoder pool removes them
                await asyncio.to_thread(self.cluster.remove_versions, t.user_id, t.fact_id)

    def forget_user_books(self, user_id: str) -> None:
        self.books.forget(user_id)
        self.resident.drop_user(user_id)

    def _saved_cursor(self) -> str | None:
        path = Path(self.disk_dir) / TOMBSTONE_CURSOR if self.disk_dir else None
        return path.read_text().strip() or None if path is not None and path.is_file() else None

    def _save_cursor(self) -> None:
        assert self._cursor is not None  # read or asked for before the first save
        if self.disk_dir:
            path = Path(self.disk_dir) / TOMBSTONE_CURSOR
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(self._cursor)
            os.replace(tmp, path)

