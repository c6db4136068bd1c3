"""The registry's shared part: records, argument checks, quotas and the interface every backend implements
(services/registry/__init__.py lists the backends)."""
from __future__ import annotations

import builtins
import json
import math
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import numpy as np

from inferscale_core.errors import InferScaleError, check_id


class VersionConflictError(InferScaleError):
    """An update named an expected version and the fact has moved on (optimistic concurrency)."""

    def __init__(self, fact_id: str, expected: int, actual: int):
        super().__init__(f"fact {fact_id!r} is at version {actual}, the update expected version {expected}")
        self.fact_id, self.expected, self.actual = fact_id, expected, actual

    def __reduce__(self):  # crosses process boundaries (ActorRegistry)
        return (VersionConflictError, (self.fact_id, self.expected, self.actual))


class DuplicateFactError(InferScaleError):
    """A caller-chosen fact id that is already taken. RedisRegistry: by this user (a fact id is its user's own);
    the in-process registries (EmbeddedRegistry, ActorRegistry) keep one space of ids: by any user."""


class UnconfirmedWriteError(InferScaleError):
    """A write the registry could not confirm: it may or may not have been applied. Its Redis master failed or
    stalled after the write was sent (no reply), or fewer replicas than required acknowledged it within the wait
    (WAIT; applied on the master, which may still lose it if it fails before they catch up). Never retried by the
    registry itself, since re-sending could apply it twice; a caller that retries gets the answer a repeated
    request gets (docs/deploy.md, "Failover")."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __reduce__(self):  # crosses process boundaries (Ray)
        return (UnconfirmedWriteError, (self.message,))


class QuotaExceededError(InferScaleError):
    """A write would take the user past its quota of facts, bytes or KV bytes; nothing was written. `quota_id`
    names the quota ("facts_per_user", "bytes_per_user", "kv_bytes_per_user") and `limit` its value (the API's
    google.rpc.QuotaFailure)."""

    def __init__(self, message: str, user_id: str = "", quota_id: str = "", limit: int = 0):
        super().__init__(message, user_id, quota_id, limit)
        self.user_id, self.quota_id, self.limit = user_id, quota_id, limit

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Tombstone:
    """KV that must leave every tier of every replica: versions 1..`upto` of a fact (an update: those before the
    new version; a delete, `gone`: all of them), or, with `fact_id` empty, every fact of the user (DeleteUser).
    Written in the same atomic step as the change, to a log every engine replica reads (`tombstones_after`), so
    a replica that held the user once (evicted it, or was down at the time) removes the bytes too."""
    user_id: str
    fact_id: str = ""
    upto: int = 0
    gone: bool = False  # the fact (or user) was deleted, not updated


TOMBSTONES_KEPT = 1_000_000  # the log's length: a replica down for more deletes than this misses the oldest


# An add's idempotency key (Registry.create's `idempotent`): chosen by the client, kept per user for
# IDEMPOTENCY_TTL_S after the add, so that a retry of an add whose answer was lost (a dropped connection,
# UNAVAILABLE WRITE_UNCONFIRMED) finds the facts the first try stored instead of storing them again.
IDEMPOTENCY_TTL_S = 24 * 3600
MAX_IDEMPOTENCY_KEY_CHARS = 128  # a UUID is 36; visible ASCII only (it travels as an HTTP header too)
# What Redis keeps for a key beyond its name and value: a hash field and a sorted-set entry (the expiry) with the
# key's name twice (counted: len(key) again) and their own overhead (~80 B, as a fact's hash field costs). Counted
# in the user's byte quota with the key, so a client that sends a new key with every add cannot grow Redis past it.
IDEMPOTENCY_STORED_BYTES = 80
# A create forgets at most this many of its user's expired keys (RedisRegistry: one bounded read in the create's
# transaction); a user adds one key per create, so its expired keys cannot pile up faster than they are forgotten.
IDEMPOTENCY_PURGE_PER_CREATE = 64


def check_idempotency_key(key) -> str:
    """The key, or ValueError naming what is wrong with it."""
    if not isinstance(key, str) or not key:
        raise ValueError("an idempotency key must be a non-empty string")
    if len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        raise ValueError(f"an idempotency key is at most {MAX_IDEMPOTENCY_KEY_CHARS} characters, got {len(key)}")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError("an idempotency key holds visible ASCII characters only (no spaces), e.g. a UUID")
    return key


@dataclass(frozen=True)
class IdempotentAdd:
    """What an add with an idempotency key stored: the key, a fingerprint of the request (the caller's: a repeat
    of the key must send the same request), the ids of the facts it stored, in order, until when the key is
    kept (Unix time), and whether a repeat was answered with its facts (`answered`: from then on the add stands,
    release_idempotency_key no longer takes it back)."""
    key: str
    fingerprint: str
    fact_ids: tuple[str, ...] = ()
    expires_at: float = 0.0
    answered: bool = False

    def to_json(self) -> bytes:
        """As stored (`answered` only once true)."""
        d = {"fp": self.fingerprint, "ids": list(self.fact_ids), "exp": self.expires_at}
        return json.dumps({**d, "ans": 1} if self.answered else d).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "IdempotentAdd":
        d = json.loads(raw)
        return cls(key, d["fp"], tuple(d["ids"]), float(d["exp"]), bool(d.get("ans")))

    def stored_bytes(self) -> int:
        """What it counts against the user's byte quota: the same answered or not (IDEMPOTENCY_STORED_BYTES covers
        the flag), so that marking it answered, a write outside the quota check, moves no counter."""
        return 2 * len(self.key.encode()) + len(replace(self, answered=False).to_json()) + IDEMPOTENCY_STORED_BYTES


class IdempotentRepeatError(InferScaleError):
    """create() with an idempotency key the user's earlier add still holds: nothing was written. `earlier` is
    that add (its fingerprint and fact ids): the caller answers with its facts, or refuses a different request."""

    def __init__(self, earlier: IdempotentAdd):
        super().__init__(f"idempotency key {earlier.key!r} was used by an earlier add of this user")
        self.earlier = earlier

    def __reduce__(self):  # crosses process boundaries (ActorRegistry)
        return (IdempotentRepeatError, (self.earlier,))


@dataclass(frozen=True)
class Quota:
    """Per-user bounds checked atomically with the write (concurrent writers cannot overshoot them): facts, stored
    bytes (fact_bytes) and KV bytes (each fact version's tokens x the serving model's KV bytes per token, as the
    encoder measured them before the write; None: no KV bound)."""
    max_facts: int
    max_bytes: int
    max_kv_bytes: int | None = None


# What Redis stores for a fact beyond its text, metadata and window: the embedding (384 float32, 1,536 B) and
# Redis's own keys, hash fields, listing entry and counters, ~1,570 B (bench/registry.py: 3,675 B a fact in all at
# 10,000 facts, 3,105 B of it neither text, metadata nor window). Counted in the byte quota, so a user's quota
# bounds what the user costs Redis, not only the text sent: 100,000 one-character facts take ~310 MB, not ~100 KB.
FACT_STORED_BYTES = 3_100


def fact_bytes(rec: "FactRecord") -> int:
    """What a fact counts against its user's byte quota: text, metadata and window as stored (UTF-8), plus
    FACT_STORED_BYTES for what Redis keeps with every fact."""
    return (len(rec.text.encode()) + len(json.dumps(rec.metadata).encode())
            + len(json.dumps(list(rec.window)).encode()) + FACT_STORED_BYTES)


def check_quota(quota: "Quota | None", user_id: str, facts: int, nbytes: int, add_facts: int, add_bytes: int,
                kv_bytes: int = 0, add_kv_bytes: int = 0) -> None:
    """Raises QuotaExceededError if the user, now at `facts`/`nbytes`/`kv_bytes`, cannot take `add_facts`/
    `add_bytes`/`add_kv_bytes` more."""
    if quota is None:
        return
    if add_facts > 0 and facts + add_facts > quota.max_facts:
        raise QuotaExceededError(f"user {user_id!r} has {facts} facts; adding {add_facts} would pass the limit of "
                                 f"{quota.max_facts} facts per user", user_id, "facts_per_user", quota.max_facts)
    if add_bytes > 0 and nbytes + add_bytes > quota.max_bytes:
        raise QuotaExceededError(f"user {user_id!r} stores {nbytes} bytes; {add_bytes} more would pass the limit "
                                 f"of {quota.max_bytes} bytes per user", user_id, "bytes_per_user", quota.max_bytes)
    if add_kv_bytes > 0 and quota.max_kv_bytes is not None and kv_bytes + add_kv_bytes > quota.max_kv_bytes:
        raise QuotaExceededError(f"user {user_id!r} holds {kv_bytes} bytes of KV; {add_kv_bytes} more would pass the "
                                 f"limit of {quota.max_kv_bytes} KV bytes per user", user_id, "kv_bytes_per_user",
                                 quota.max_kv_bytes)


@dataclass(frozen=True)
class FactRecord:
    fact_id: str
    user_id: str
    text: str
    metadata: dict = field(default_factory=dict)
    version: int = 1
    created_at: float = 0.0
    updated_at: float = 0.0
    embedding: np.ndarray | None = None  # float32 [dim], None until indexed
    window: tuple[str, ...] = ()  # what the fact was encoded behind: turns or neighbour lines (re-encoding needs it)
    unservable_reason: str = ""  # non-empty: this version failed to encode; Answer leaves it out
    kv_bytes: int = 0  # this version's KV (tokens x KV bytes per token, the encoder's measure); 0: not measured
    # Unix time from which the fact is not served (retrieval does not pick it, Answer does not inject it, Mem0's
    # listings hide it); it stays stored until deleted. inf: never expires.
    expires_at: float = math.inf

    def expired(self, now: float) -> bool:
        return now >= self.expires_at

    def public(self) -> dict:
        """The fields a client may see (no embedding)."""
        return {"fact_id": self.fact_id, "user_id": self.user_id, "text": self.text, "metadata": dict(self.metadata),
                "version": self.version, "created_at": self.created_at, "updated_at": self.updated_at,
                "unservable_reason": self.unservable_reason}


MAX_HISTORY = 20  # earlier versions kept per fact, oldest dropped first (bounded; counted in the byte quota)


@dataclass(frozen=True)
class FactVersion:
    """An earlier version of a fact: its text and metadata as they were until `replaced_at` (Mem0's history()).
    Kept when an update changes the text or metadata (a re-windowing alone is no new version for the user),
    and erased with the fact."""
    version: int
    text: str
    metadata: dict
    updated_at: float   # when this version was written
    replaced_at: float  # when the next one replaced it

    @classmethod
    def of(cls, rec: "FactRecord", replaced_at: float) -> "FactVersion":
        return cls(rec.version, rec.text, dict(rec.metadata), rec.updated_at, replaced_at)

    def to_json(self) -> bytes:
        """As stored; its length is what the version counts against the user's byte quota."""
        return json.dumps({"version": self.version, "text": self.text, "metadata": self.metadata,
                           "updated_at": self.updated_at, "replaced_at": self.replaced_at}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "FactVersion":
        d = json.loads(raw)
        return cls(d["version"], d["text"], d["metadata"], d["updated_at"], d["replaced_at"])


def new_version(cur: "FactRecord", new: "FactRecord") -> "FactVersion | None":
    """The earlier version an update keeps in the fact's history: only when the text or metadata changed."""
    if cur.text == new.text and cur.metadata == new.metadata:
        return None
    return FactVersion.of(cur, new.updated_at)


@dataclass(frozen=True)
class NewFact:
    text: str
    metadata: dict = field(default_factory=dict)
    embedding: np.ndarray | None = None
    fact_id: str | None = None  # None: the registry picks a uuid4
    window: tuple[str, ...] = ()
    kv_bytes: int = 0  # what its KV will take (the encoder's measure), counted against Quota.max_kv_bytes
    created_at: float | None = None  # None: now (the time of the write); else a Unix time (an import's own)
    expires_at: float = math.inf  # FactRecord.expires_at


def _check_text(text) -> str:
    if not isinstance(text, str) or not text.strip():
        raise ValueError("fact text must be a non-empty string")
    return text


def _check_metadata(metadata) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise ValueError("fact metadata must be a dict with str keys")
    json.dumps(metadata)  # raises TypeError on values that cannot be stored
    return dict(metadata)


def _check_window(window) -> tuple[str, ...]:
    if not isinstance(window, (list, tuple)) or not all(isinstance(t, str) for t in window):
        raise ValueError("a fact's window must be a list of str (conversation turns)")
    return tuple(window)


def _check_kv_bytes(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"kv_bytes must be an int >= 0, got {n!r}")
    return n


def _check_time(name: str, t, allow_inf: bool = False) -> float:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or (math.isinf(t) and not allow_inf):
        raise ValueError(f"{name} must be a Unix time in seconds{' (or inf)' if allow_inf else ''}, got {t!r}")
    return float(t)


def _as_embedding(e) -> np.ndarray | None:
    if e is None:
        return None
    arr = np.asarray(e, dtype=np.float32)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"an embedding must be a non-empty 1-D vector, got shape {arr.shape}")
    return arr


class Registry(ABC):
    """Interface shared by both backends. All methods raise UnknownFactError for a fact the user does not
    own, whether it does not exist or belongs to someone else: the two cases look the same from outside."""

    # --- facts ---
    @abstractmethod
    def create(self, user_id: str, facts: list[NewFact], quota: Quota | None = None,
               idempotent: IdempotentAdd | None = None) -> list[FactRecord]:
        """All the facts or none; QuotaExceededError if they would take the user past `quota`. `idempotent` (its
        key and fingerprint; fact_ids and expires_at are the registry's): kept with the facts in the same atomic
        step for IDEMPOTENCY_TTL_S, its bytes counted in the user's byte quota; if the user still holds the key,
        nothing is written and IdempotentRepeatError names the earlier add. Each create also forgets some of the
        user's expired keys (and their bytes)."""

    @abstractmethod
    def idempotent_add(self, user_id: str, key: str, now: float | None = None,
                       answering: str | None = None) -> IdempotentAdd | None:
        """The user's earlier add under this idempotency key, None when there is none or it expired (at `now`,
        default the time of the call). `answering`: the fingerprint of a repeat about to be answered with that
        add's facts; when it is the add's own, the add is marked answered in the same atomic step, so that an undo
        of the add racing the repeat (release_idempotency_key, then the deletes) cannot remove facts the repeat
        returned."""

    @abstractmethod
    def release_idempotency_key(self, user_id: str, key: str) -> bool:
        """Forgets the key (and its bytes), so that the add can be sent again: for an add undone after its
        facts were stored (the caller was told nothing was stored). A key the user does not hold: nothing. False,
        forgetting nothing, when a repeat was answered with the add's facts (idempotent_add's `answering`): the add
        stands, and its facts must stay."""

    @abstractmethod
    def get(self, user_id: str, fact_id: str) -> FactRecord: ...

    @abstractmethod
    def get_many(self, user_id: str, fact_ids: list[str]) -> list[FactRecord]:
        """Records in the order asked; raises UnknownFactError for the first id the user does not own."""

    @abstractmethod
    def find_many(self, user_id: str, fact_ids: list[str]) -> dict[str, FactRecord]:
        """fact_id -> record for those of `fact_ids` the user owns now (one round trip); the others (deleted
        meanwhile, or never the user's) are left out: what a hot path that may race a delete wants."""

    @abstractmethod
    def list(self, user_id: str, offset: int = 0, limit: int | None = None) -> tuple[list[FactRecord], int | None]:
        """Facts in creation order from `offset`; returns (records, next offset or None at the end)."""

    @abstractmethod
    def list_after(self, user_id: str, after: int,
                   limit: int) -> tuple[builtins.list[tuple[int, FactRecord]], int | None]:
        """Up to `limit` facts created after creation sequence number `after` (0: from the first), in creation
        order, each with its sequence number; and the cursor to go on from (None at the end). A cursor, not an
        offset: facts deleted meanwhile do not shift it, so a listing that deletes as it pages skips no
        surviving fact and returns none twice."""

    @abstractmethod
    def count(self, user_id: str) -> int: ...

    @abstractmethod
    def seq_of(self, user_id: str, fact_id: str) -> int | None:
        """The fact's creation sequence number (list_after's cursor), None when the user has no such fact."""

    def latest(self, user_id: str, n: int) -> builtins.list[FactRecord]:
        """The user's n most recently stored facts, oldest first: the neighbours a new fact is encoded behind
        (inferscale_core/defaults.py). Backends that can do it in one read override this."""
        if n <= 0:
            return []
        return self.list(user_id, max(0, self.count(user_id) - n), n)[0]

    @abstractmethod
    def fact_versions(self, user_id: str) -> dict[str, int]:
        """fact_id -> version for every fact of the user: what a replica compares its cache against."""

    @abstractmethod
    def update(self, user_id: str, fact_id: str, text: str | None = None, metadata: dict | None = None,
               replace_metadata: bool = False, embedding=None, expected_version: int = 0,
               quota: Quota | None = None, window: tuple[str, ...] | None = None,
               kv_bytes: int | None = None, expires_at: float | None = None) -> FactRecord:
        """New text, metadata, window (what the fact is encoded behind) and/or expiry; version + 1. A new text
        without a new embedding clears the embedding (the old one describes the old text); a new version is
        servable until an encoder says otherwise. A changed text or metadata keeps the old version in history().
        `kv_bytes`: the new version's KV size (None: as before). `expires_at`: FactRecord.expires_at (None: as
        before; inf: never). Writes the tombstone of the older versions."""

    @abstractmethod
    def set_embedding(self, user_id: str, fact_id: str, version: int, embedding) -> bool:
        """Store the embedding computed for `version`; False (nothing written) if the fact moved on."""

    @abstractmethod
    def set_unservable(self, user_id: str, fact_id: str, version: int, reason: str) -> bool:
        """Mark `version` as one the encoder cannot serve; False (nothing written) if the fact moved on."""

    @abstractmethod
    def user_bytes(self, user_id: str) -> int:
        """Bytes the user's facts count against its quota (fact_bytes summed, plus their kept earlier versions)."""

    @abstractmethod
    def history(self, user_id: str, fact_id: str) -> builtins.list[FactVersion]:
        """The fact's earlier versions (text or metadata changed), oldest first, at most MAX_HISTORY; the
        current version is the record itself. Erased with the fact."""

    @abstractmethod
    def user_kv_bytes(self, user_id: str) -> int:
        """KV bytes the user's facts count against Quota.max_kv_bytes (kv_bytes summed)."""

    @abstractmethod
    def expired_facts(self, user_id: str, now: float) -> builtins.list[str]:
        """Ids of the user's facts expired at `now` (expires_at <= now). RedisRegistry: one read of an index of
        the user's facts that have an expiry, however many facts the user has."""

    @abstractmethod
    def owners_of(self, fact_id: str) -> builtins.list[str]:
        """The users that have a fact of this id, sorted: at most one in the in-process registries (one space of
        ids), possibly several in RedisRegistry (a fact id is its user's own). For a caller that may act for every
        user (a server without authentication) only: it tells whose a fact id is. Its cost does not grow with the
        number of facts or users stored."""

    @abstractmethod
    def delete(self, user_id: str, fact_id: str) -> FactRecord: ...

    @abstractmethod
    def delete_user(self, user_id: str) -> int:
        """Removes every fact of the user, its placements and idempotency keys; returns how many facts were
        removed."""

    @abstractmethod
    def user_version(self, user_id: str) -> int:
        """Counter bumped by every change to the user's facts (0 for a user never written)."""

    @abstractmethod
    def user_versions(self, user_ids: builtins.list[str]) -> builtins.list[int]:
        """user_version of each user, in order, in one round trip (an engine replica's watch of its users)."""

    @abstractmethod
    def tombstones_after(self, cursor: str | None, limit: int = 1000) -> tuple[builtins.list[Tombstone], str]:
        """Tombstones written after `cursor`, oldest first (at most `limit`), and the cursor after them. `cursor`
        None: the log's end now (no tombstones, the cursor to start from); "0": its beginning."""

    @abstractmethod
    def tombstones_missed(self, cursor: str) -> bool:
        """Whether tombstones written after `cursor` may have been trimmed from the log before they were read (a
        replica that was away longer than the log keeps). Conservative: True costs the reader a reconcile of what
        it holds against the registry, never a fact; False is sure."""

    # --- the cluster KV tier's books: per user, the fact versions whose objects the encoder pool wrote there ---

    @abstractmethod
    def kv_tier_admit(self, user_id: str, items: builtins.list[tuple[str, int, int]],
                      cap: int) -> builtins.list[str]:
        """Books `(fact_id, version, bytes)` the encoder pool is about to write to the cluster tier (a fact's
        earlier entry is replaced: one object per fact), as used now; then, while the user's booked bytes are
        over `cap`, unbooks the user's least recently used other facts and returns their kv_ids (`fact@vN`),
        which the caller removes from the tier. Only this user's facts, never another's. Atomic. The books may
        count objects the master evicted or that were never written: the user then holds less than `cap` in
        the tier, never more (the facts being written are kept even when they alone pass it). A deleted fact's entry goes with it (delete, delete_user)."""

    @abstractmethod
    def kv_tier_touch(self, user_id: str, fact_ids: builtins.list[str]) -> None:
        """Marks these booked facts used now (a request read them from the cluster tier)."""

    @abstractmethod
    def kv_tier_bytes(self, user_id: str) -> int:
        """The bytes booked for the user in the cluster tier."""

    # --- placement map: user -> engine replicas that hold the user's KV store ---

    @abstractmethod
    def add_placement(self, user_id: str, replica_id: str) -> None: ...

    @abstractmethod
    def remove_placement(self, user_id: str, replica_id: str) -> None: ...

    @abstractmethod
    def placement(self, user_id: str) -> set[str]: ...

    @abstractmethod
    def placements(self) -> dict[str, set[str]]: ...

    @abstractmethod
    def ping(self) -> None:
        """Raises when the backend cannot be reached."""

    def is_full(self) -> bool:
        """True when the backend refuses writes for lack of memory (Redis at its maxmemory under noeviction):
        reads and deletes still work, creates and updates fail until space is freed. The in-process registries
        (EmbeddedRegistry, ActorRegistry) have no such bound: never full."""
        return False

    def close(self) -> None:
        pass

    # shared helpers
    @staticmethod
    def _checked_admit(user_id: str, items, cap) -> builtins.list[tuple[str, int, int]]:
        check_id("user_id", user_id)
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise ValueError(f"the cluster tier's cap per user must be an int >= 0 bytes, got {cap!r}")
        out = []
        for fact_id, version, nbytes in items:
            check_id("fact_id", fact_id)
            if isinstance(version, bool) or not isinstance(version, int) or version < 1:
                raise ValueError(f"version must be an int >= 1, got {version!r}")
            out.append((fact_id, version, _check_kv_bytes(nbytes)))
        return out

    @staticmethod
    def _checked_update(user_id: str, fact_id: str, text, metadata, embedding, window=None,
                        expires_at=None) -> np.ndarray | None:
        """Validate an update's arguments (both backends); returns the embedding as an array, or None."""
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        if expires_at is not None:
            _check_time("expires_at", expires_at, allow_inf=True)
        if text is not None:
            _check_text(text)
        if window is not None:
            _check_window(window)
        if metadata is not None:
            _check_metadata(metadata)
        return _as_embedding(embedding)

    @staticmethod
    def _updated(cur: FactRecord, text, metadata, replace_metadata, emb, window=None, kv_bytes=None,
                 expires_at=None) -> FactRecord:
        if metadata is None:
            meta = cur.metadata
        elif replace_metadata:
            meta = dict(metadata)
        else:
            meta = {**cur.metadata, **metadata}
        new_text = cur.text if text is None else text
        if emb is None:
            emb = cur.embedding if new_text == cur.text else None
        return replace(cur, text=new_text, metadata=meta, version=cur.version + 1, updated_at=time.time(),
                       embedding=emb, unservable_reason="",
                       window=cur.window if window is None else tuple(window),
                       kv_bytes=cur.kv_bytes if kv_bytes is None else _check_kv_bytes(kv_bytes),
                       expires_at=cur.expires_at if expires_at is None else float(expires_at))

    @staticmethod
    def _kept_add(idempotent: "IdempotentAdd | None", recs: builtins.list[FactRecord],
                  now: float) -> "IdempotentAdd | None":
        """What a create stores for its idempotency key: the key checked, its facts' ids, its expiry; no repeat
        answered yet."""
        if idempotent is None:
            return None
        if not isinstance(idempotent, IdempotentAdd):
            raise TypeError(f"idempotent must be an IdempotentAdd, got {type(idempotent).__name__}")
        return replace(idempotent, key=check_idempotency_key(idempotent.key),
                       fact_ids=tuple(r.fact_id for r in recs), expires_at=now + IDEMPOTENCY_TTL_S, answered=False)

    @staticmethod
    def _new_records(user_id: str, facts: builtins.list[NewFact], now: float) -> builtins.list[FactRecord]:
        check_id("user_id", user_id)
        out: builtins.list[FactRecord] = []
        seen: set[str] = set()
        for i, f in enumerate(facts):
            if not isinstance(f, NewFact):
                raise TypeError(f"facts[{i}] must be a NewFact, got {type(f).__name__}")
            fid = check_id("fact_id", f.fact_id) if f.fact_id is not None else uuid.uuid4().hex
            if fid in seen:
                raise DuplicateFactError(f"fact id {fid!r} appears twice in one request")
            seen.add(fid)
            # A fact stored with its own creation time (Mem0's timestamp) was last updated then too.
            at = now if f.created_at is None else _check_time("created_at", f.created_at)
            out.append(FactRecord(fid, user_id, _check_text(f.text), _check_metadata(f.metadata), 1, at, at,
                                  _as_embedding(f.embedding), _check_window(f.window),
                                  kv_bytes=_check_kv_bytes(f.kv_bytes),
                                  expires_at=_check_time("expires_at", f.expires_at, allow_inf=True)))
        return out
