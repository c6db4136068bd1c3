"""EmbeddedRegistry: the same interface kept in this process behind one lock (a single-process run without
Redis; its data lives as long as the process)."""
from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict
from dataclasses import replace

from inferscale_core.errors import UnknownFactError, check_id
from inferscale_core.types import kv_id

from .base import (
    IDEMPOTENCY_PURGE_PER_CREATE,
    MAX_HISTORY,
    TOMBSTONES_KEPT,
    DuplicateFactError,
    IdempotentAdd,
    IdempotentRepeatError,
    Registry,
    Tombstone,
    VersionConflictError,
    _as_embedding,
    check_quota,
    fact_bytes,
    new_version,
)


class EmbeddedRegistry(Registry):
    def __init__(self):
        self._lock = threading.Lock()
        self._facts = {}                            # fact_id -> FactRecord
        self._order: dict[str, list[str]] = {}      # user -> fact ids in creation order
        self._seq: dict[str, int] = {}              # fact_id -> creation sequence number (list_after's cursor)
        self._last_seq = 0
        self._bytes: dict[str, int] = {}            # user -> fact_bytes + kept versions' bytes (the byte quota)
        self._history: dict[str, list] = {}         # fact_id -> earlier FactVersions, oldest first
        self._kv_bytes: dict[str, int] = {}         # user -> kv_bytes summed (the KV quota)
        self._tombs: list[Tombstone] = []           # the tombstone log; _tombs[0] has number _tombs_base
        self._tombs_base = 0
        self._ver: dict[str, int] = {}
        self._placement: dict[str, set[str]] = {}
        # user -> idempotency key -> the add that used it, in the order written (so oldest, first to expire, first)
        self._idem: dict[str, dict[str, IdempotentAdd]] = {}
        # user -> fact_id -> (version, bytes) booked in the cluster KV tier, least recently used first
        self._kv_tier: dict[str, OrderedDict[str, tuple[int, int]]] = {}

    def _owned(self, user_id, fact_id):
        rec = self._facts.get(fact_id)
        if rec is None or rec.user_id != user_id:
            raise UnknownFactError(user_id, fact_id)
        return rec

    def _bump(self, user_id):
        self._ver[user_id] = self._ver.get(user_id, 0) + 1

    def _tomb(self, t: Tombstone):
        self._tombs.append(t)
        if len(self._tombs) > TOMBSTONES_KEPT:
            self._tombs.pop(0)
            self._tombs_base += 1

    def create(self, user_id, facts, quota=None, idempotent=None):
        now = time.time()
        recs = self._new_records(user_id, facts, now)
        if not recs:
            return []
        kept = self._kept_add(idempotent, recs, now)
        added = sum(fact_bytes(r) for r in recs)
        with self._lock:
            held = self._idem.get(user_id, {})
            earlier = held.get(kept.key) if kept is not None else None
            if earlier is not None and earlier.expires_at > now:
                raise IdempotentRepeatError(earlier)
            taken = [r.fact_id for r in recs if r.fact_id in self._facts]
            if taken:
                raise DuplicateFactError(f"fact id {taken[0]!r} already exists")
            # The user's expired keys leave with this write (at most IDEMPOTENCY_PURGE_PER_CREATE, oldest first;
            # the one this write reuses among them), their bytes with them.
            expired = [a for a in list(held.values())[:IDEMPOTENCY_PURGE_PER_CREATE] if a.expires_at <= now]
            if earlier is not None and earlier not in expired:
                expired.append(earlier)
            grown = added - sum(a.stored_bytes() for a in expired) + (kept.stored_bytes() if kept else 0)
            added_kv = sum(r.kv_bytes for r in recs)
            check_quota(quota, user_id, len(self._order.get(user_id, [])), self._bytes.get(user_id, 0), len(recs),
                        grown, self._kv_bytes.get(user_id, 0), added_kv)
            for r in recs:
                self._facts[r.fact_id] = r
                self._order.setdefault(user_id, []).append(r.fact_id)
                self._last_seq += 1
                self._seq[r.fact_id] = self._last_seq
            for a in expired:
                del held[a.key]
            if kept is not None:
                self._idem.setdefault(user_id, held)[kept.key] = kept
            self._bytes[user_id] = self._bytes.get(user_id, 0) + grown
            self._kv_bytes[user_id] = self._kv_bytes.get(user_id, 0) + added_kv
            self._bump(user_id)
        return recs

    def idempotent_add(self, user_id, key, now=None, answering=None):
        check_id("user_id", user_id)
        now = time.time() if now is None else now
        with self._lock:
            held = self._idem.get(user_id, {})
            earlier = held.get(key)
            if earlier is None or earlier.expires_at <= now:
                return None
            if answering == earlier.fingerprint and not earlier.answered:
                earlier = held[key] = replace(earlier, answered=True)  # in place: the keys' order is their age
            return earlier

    def release_idempotency_key(self, user_id, key):
        check_id("user_id", user_id)
        with self._lock:
            held = self._idem.get(user_id, {})
            earlier = held.get(key)
            if earlier is None:
                return True
            if earlier.answered:
                return False
            del held[key]
            self._bytes[user_id] = self._bytes.get(user_id, 0) - earlier.stored_bytes()
            return True

    def get(self, user_id, fact_id):
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        with self._lock:
            return self._owned(user_id, fact_id)

    def get_many(self, user_id, fact_ids):
        check_id("user_id", user_id)
        with self._lock:
            return [self._owned(user_id, check_id("fact_id", f)) for f in fact_ids]

    def find_many(self, user_id, fact_ids):
        check_id("user_id", user_id)
        with self._lock:
            out = {}
            for f in fact_ids:
                rec = self._facts.get(check_id("fact_id", f))
                if rec is not None and rec.user_id == user_id:
                    out[f] = rec
            return out

    def list(self, user_id, offset=0, limit=None):
        check_id("user_id", user_id)
        if offset < 0 or (limit is not None and limit < 1):
            raise ValueError(f"bad page: offset={offset}, limit={limit}")
        with self._lock:
            ids = self._order.get(user_id, [])
            page = ids[offset:] if limit is None else ids[offset:offset + limit]
            more = limit is not None and offset + limit < len(ids)
            return [self._facts[f] for f in page], (offset + len(page) if more else None)

    def list_after(self, user_id, after, limit):
        check_id("user_id", user_id)
        if after < 0 or limit < 1:
            raise ValueError(f"bad page: after={after}, limit={limit}")
        with self._lock:
            ids = self._order.get(user_id, [])
            start = bisect.bisect_right(ids, after, key=self._seq.__getitem__)
            page = ids[start:start + limit]
            more = start + limit < len(ids)
            return [(self._seq[f], self._facts[f]) for f in page], (self._seq[page[-1]] if more else None)

    def seq_of(self, user_id, fact_id):
        check_id("user_id", user_id)
        with self._lock:
            rec = self._facts.get(fact_id)
            return self._seq[fact_id] if rec is not None and rec.user_id == user_id else None

    def count(self, user_id):
        check_id("user_id", user_id)
        with self._lock:
            return len(self._order.get(user_id, []))

    def latest(self, user_id, n):
        check_id("user_id", user_id)
        with self._lock:
            return [self._facts[f] for f in self._order.get(user_id, [])[-n:]] if n > 0 else []

    def user_bytes(self, user_id):
        check_id("user_id", user_id)
        with self._lock:
            return self._bytes.get(user_id, 0)

    def fact_versions(self, user_id):
        check_id("user_id", user_id)
        with self._lock:
            return {f: self._facts[f].version for f in self._order.get(user_id, [])}

    def update(self, user_id, fact_id, text=None, metadata=None, replace_metadata=False, embedding=None,
               expected_version=0, quota=None, window=None, kv_bytes=None, expires_at=None):
        emb = self._checked_update(user_id, fact_id, text, metadata, embedding, window, expires_at)
        with self._lock:
            cur = self._owned(user_id, fact_id)
            if expected_version and cur.version != expected_version:
                raise VersionConflictError(fact_id, expected_version, cur.version)
            new = self._updated(cur, text, metadata, replace_metadata, emb, window, kv_bytes, expires_at)
            grown, grown_kv = fact_bytes(new) - fact_bytes(cur), new.kv_bytes - cur.kv_bytes
            kept = self._history.get(fact_id, [])
            old = new_version(cur, new)
            if old is not None:
                kept = [*kept, old]
                grown += len(old.to_json()) - sum(len(v.to_json()) for v in kept[:-MAX_HISTORY])
                kept = kept[-MAX_HISTORY:]
            check_quota(quota, user_id, 0, self._bytes.get(user_id, 0), 0, grown, self._kv_bytes.get(user_id, 0),
                        grown_kv)
            self._facts[fact_id] = new
            if kept:
                self._history[fact_id] = kept
            self._bytes[user_id] = self._bytes.get(user_id, 0) + grown
            self._kv_bytes[user_id] = self._kv_bytes.get(user_id, 0) + grown_kv
            self._tomb(Tombstone(user_id, fact_id, cur.version))
            self._bump(user_id)
            return new

    def _set(self, user_id, fact_id, version, **changes) -> bool:
        with self._lock:
            cur = self._owned(user_id, fact_id)
            if cur.version != version:
                return False
            self._facts[fact_id] = replace(cur, **changes)
            return True

    def set_embedding(self, user_id, fact_id, version, embedding):
        return self._set(user_id, fact_id, version, embedding=_as_embedding(embedding))

    def set_unservable(self, user_id, fact_id, version, reason):
        return self._set(user_id, fact_id, version, unservable_reason=str(reason) or "unservable")

    def history(self, user_id, fact_id):
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        with self._lock:
            self._owned(user_id, fact_id)
            return list(self._history.get(fact_id, []))

    def expired_facts(self, user_id, now):
        check_id("user_id", user_id)
        with self._lock:  # in memory: a pass over the user's records
            return [f for f in self._order.get(user_id, []) if self._facts[f].expired(now)]

    def owners_of(self, fact_id):
        check_id("fact_id", fact_id)
        with self._lock:
            rec = self._facts.get(fact_id)
            return [] if rec is None else [rec.user_id]

    def delete(self, user_id, fact_id):
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        with self._lock:
            rec = self._owned(user_id, fact_id)
            del self._facts[fact_id]
            del self._seq[fact_id]
            self._order[user_id].remove(fact_id)
            kept = self._history.pop(fact_id, [])
            self._bytes[user_id] = (self._bytes.get(user_id, 0) - fact_bytes(rec)
                                    - sum(len(v.to_json()) for v in kept))
            self._kv_bytes[user_id] = self._kv_bytes.get(user_id, 0) - rec.kv_bytes
            self._kv_tier.get(user_id, {}).pop(fact_id, None)
            self._tomb(Tombstone(user_id, fact_id, rec.version, gone=True))
            self._bump(user_id)
            return rec

    def delete_user(self, user_id):
        check_id("user_id", user_id)
        with self._lock:
            ids = self._order.pop(user_id, [])
            for f in ids:
                del self._facts[f]
                self._history.pop(f, None)
                del self._seq[f]
            self._bytes.pop(user_id, None)
            self._kv_bytes.pop(user_id, None)
            self._kv_tier.pop(user_id, None)
            self._placement.pop(user_id, None)
            self._idem.pop(user_id, None)
            self._tomb(Tombstone(user_id, gone=True))
            self._bump(user_id)
            return len(ids)

    def user_kv_bytes(self, user_id):
        check_id("user_id", user_id)
        with self._lock:
            return self._kv_bytes.get(user_id, 0)

    def kv_tier_admit(self, user_id, items, cap):
        items = self._checked_admit(user_id, items, cap)
        with self._lock:
            booked = self._kv_tier.setdefault(user_id, OrderedDict())
            for fact_id, version, nbytes in items:
                booked.pop(fact_id, None)
                booked[fact_id] = (version, nbytes)
            total = sum(n for _, n in booked.values())
            new = {f for f, _, _ in items}
            out = []
            for fact_id in [f for f in booked if f not in new]:  # least recently used first
                if total <= cap:
                    break
                version, nbytes = booked.pop(fact_id)
                total -= nbytes
                out.append(kv_id(fact_id, version))
            return out

    def kv_tier_touch(self, user_id, fact_ids):
        check_id("user_id", user_id)
        with self._lock:
            booked = self._kv_tier.get(user_id, {})
            for fact_id in fact_ids:
                if fact_id in booked:
                    booked.move_to_end(fact_id)

    def kv_tier_bytes(self, user_id):
        check_id("user_id", user_id)
        with self._lock:
            return sum(n for _, n in self._kv_tier.get(user_id, {}).values())

    def tombstones_after(self, cursor, limit=1000):
        with self._lock:
            end = self._tombs_base + len(self._tombs)
            if cursor is None:
                return [], str(end)
            start = max(int(cursor), self._tombs_base)
            out = self._tombs[start - self._tombs_base:start - self._tombs_base + limit]
            return out, str(start + len(out))

    def tombstones_missed(self, cursor):
        with self._lock:
            return int(cursor) < self._tombs_base

    def user_version(self, user_id):
        check_id("user_id", user_id)
        with self._lock:
            return self._ver.get(user_id, 0)

    def user_versions(self, user_ids):
        with self._lock:
            return [self._ver.get(check_id("user_id", u), 0) for u in user_ids]

    def add_placement(self, user_id, replica_id):
        check_id("user_id", user_id)
        with self._lock:
            self._placement.setdefault(user_id, set()).add(replica_id)

    def remove_placement(self, user_id, replica_id):
        check_id("user_id", user_id)
        with self._lock:
            s = self._placement.get(user_id)
            if s is not None:
                s.discard(replica_id)
                if not s:
                    del self._placement[user_id]

    def placement(self, user_id):
        check_id("user_id", user_id)
        with self._lock:
            return set(self._placement.get(user_id, ()))

    def placements(self):
        with self._lock:
            return {u: set(s) for u, s in self._placement.items()}

    def ping(self):
        return None
