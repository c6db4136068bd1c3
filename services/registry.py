"""The fact registry: the source of truth for every fact's text, embedding, metadata, version and owner, plus
the placement map (which engine replica holds which user's KV store).

Three backends with one interface: `RedisRegistry` (a deployment; every replica of every deployment sees the
same data, and it survives process restarts), `EmbeddedRegistry` (in-process, for a single-process run
without a Redis URL; its data lives as long as the process) and `ActorRegistry` (an EmbeddedRegistry in a
named Ray actor, so the replicas of a Serve app without Redis share one registry; its data lives as long as
the Ray cluster). `open_registry(url)` picks one.

KV tensors are never stored here: they are derived data (re-encodable from the text) and live in the
engine replicas' stores. Every change to a user's facts bumps that user's version counter, so a replica
that cached the user's index or KV can tell with one read that it is stale.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import numpy as np

from inferscale_core.errors import InferScaleError, UnknownFactError, check_id


class VersionConflictError(InferScaleError):
    """An update named an expected version and the fact has moved on (optimistic concurrency)."""

    def __init__(self, fact_id: str, expected: int, actual: int):
        super().__init__(f"fact {fact_id!r} is at version {actual}, the update expected version {expected}")
        self.fact_id, self.expected, self.actual = fact_id, expected, actual

    def __reduce__(self):  # crosses process boundaries (ActorRegistry)
        return (VersionConflictError, (self.fact_id, self.expected, self.actual))


class DuplicateFactError(InferScaleError):
    """A caller-chosen fact id that is already taken (by this user or another one)."""


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
    window: tuple[str, ...] = ()  # conversation turns the fact was encoded behind (re-encoding needs them)

    def public(self) -> dict:
        """The fields a client may see (no embedding)."""
        return {"fact_id": self.fact_id, "user_id": self.user_id, "text": self.text, "metadata": dict(self.metadata),
                "version": self.version, "created_at": self.created_at, "updated_at": self.updated_at}


@dataclass(frozen=True)
class NewFact:
    text: str
    metadata: dict = field(default_factory=dict)
    embedding: np.ndarray | None = None
    fact_id: str | None = None  # None: the registry picks a uuid4
    window: tuple[str, ...] = ()


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
    def create(self, user_id: str, facts: list[NewFact]) -> list[FactRecord]: ...

    @abstractmethod
    def get(self, user_id: str, fact_id: str) -> FactRecord: ...

    @abstractmethod
    def get_many(self, user_id: str, fact_ids: list[str]) -> list[FactRecord]:
        """Records in the order asked; raises UnknownFactError for the first id the user does not own."""

    @abstractmethod
    def list(self, user_id: str, offset: int = 0, limit: int | None = None) -> tuple[list[FactRecord], int | None]:
        """Facts in creation order from `offset`; returns (records, next offset or None at the end)."""

    @abstractmethod
    def count(self, user_id: str) -> int: ...

    @abstractmethod
    def fact_versions(self, user_id: str) -> dict[str, int]:
        """fact_id -> version for every fact of the user: what a replica compares its cache against."""

    @abstractmethod
    def update(self, user_id: str, fact_id: str, text: str | None = None, metadata: dict | None = None,
               replace_metadata: bool = False, embedding=None, expected_version: int = 0) -> FactRecord:
        """New text and/or metadata; version + 1. A new text without a new embedding clears the embedding
        (the old one describes the old text)."""

    @abstractmethod
    def set_embedding(self, user_id: str, fact_id: str, version: int, embedding) -> bool:
        """Store the embedding computed for `version`; False (nothing written) if the fact moved on."""

    @abstractmethod
    def delete(self, user_id: str, fact_id: str) -> FactRecord: ...

    @abstractmethod
    def delete_user(self, user_id: str) -> int:
        """Removes every fact of the user and its placements; returns how many facts were removed."""

    @abstractmethod
    def user_version(self, user_id: str) -> int:
        """Counter bumped by every change to the user's facts (0 for a user never written)."""

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

    def close(self) -> None:
        pass

    # shared helpers
    @staticmethod
    def _checked_update(user_id: str, fact_id: str, text, metadata, embedding) -> np.ndarray | None:
        """Validate an update's arguments (both backends); returns the embedding as an array, or None."""
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        if text is not None:
            _check_text(text)
        if metadata is not None:
            _check_metadata(metadata)
        return _as_embedding(embedding)

    @staticmethod
    def _updated(cur: FactRecord, text, metadata, replace_metadata, emb) -> FactRecord:
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
                       embedding=emb)

    @staticmethod
    def _new_records(user_id: str, facts: list[NewFact], now: float) -> list[FactRecord]:
        check_id("user_id", user_id)
        out, seen = [], set()
        for i, f in enumerate(facts):
            if not isinstance(f, NewFact):
                raise TypeError(f"facts[{i}] must be a NewFact, got {type(f).__name__}")
            fid = check_id("fact_id", f.fact_id) if f.fact_id is not None else uuid.uuid4().hex
            if fid in seen:
                raise DuplicateFactError(f"fact id {fid!r} appears twice in one request")
            seen.add(fid)
            out.append(FactRecord(fid, user_id, _check_text(f.text), _check_metadata(f.metadata), 1, now, now,
                                  _as_embedding(f.embedding), _check_window(f.window)))
        return out


# --------------------------------------------------------------------------------------------- Redis
class RedisRegistry(Registry):
    """Keys (all under `prefix`):
      fact:{fact_id}        hash  user_id, text, metadata (JSON), version, created_at, updated_at, embedding
      user:{user_id}:facts  zset  fact_id -> creation sequence (stable listing order)
      user:{user_id}:ver    int   the user's change counter
      placement:{user_id}   set   engine replica ids
      placed_users          set   users with a non-empty placement
      seq                   int   global creation sequence
    """

    def __init__(self, url: str, prefix: str = "inferscale:"):
        import redis

        self.url, self.prefix = url, prefix
        self.r = redis.Redis.from_url(url, decode_responses=False, socket_connect_timeout=5)

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def _fact_key(self, fact_id: str) -> str:
        return self._k("fact", fact_id)

    def _record(self, fact_id: str, h: dict) -> FactRecord:
        emb = h.get(b"embedding")
        return FactRecord(
            fact_id=fact_id, user_id=h[b"user_id"].decode(), text=h[b"text"].decode(),
            metadata=json.loads(h[b"metadata"]), version=int(h[b"version"]),
            created_at=float(h[b"created_at"]), updated_at=float(h[b"updated_at"]),
            embedding=np.frombuffer(emb, dtype=np.float32).copy() if emb else None,
            window=tuple(json.loads(h.get(b"window", b"[]"))))

    @staticmethod
    def _mapping(rec: FactRecord) -> dict:
        m = {"user_id": rec.user_id, "text": rec.text, "metadata": json.dumps(rec.metadata),
             "version": rec.version, "created_at": repr(rec.created_at), "updated_at": repr(rec.updated_at),
             "embedding": rec.embedding.astype(np.float32).tobytes() if rec.embedding is not None else b"",
             "window": json.dumps(list(rec.window))}
        return m

    def _owned(self, user_id: str, fact_id: str, h: dict) -> FactRecord:
        if not h or h[b"user_id"].decode() != user_id:
            raise UnknownFactError(user_id, fact_id)
        return self._record(fact_id, h)

    def create(self, user_id, facts):
        recs = self._new_records(user_id, facts, time.time())
        if not recs:
            return []
        import redis

        keys = [self._fact_key(r.fact_id) for r in recs]
        # Creation sequence numbers first (gaps are harmless), then facts + listing + version in one MULTI.
        first = int(self.r.incrby(self._k("seq"), len(recs))) - len(recs) + 1
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(*keys)  # caller-chosen ids: never overwrite an existing fact
                    taken = [r.fact_id for r, k in zip(recs, keys) if pipe.exists(k)]
                    if taken:
                        raise DuplicateFactError(f"fact id {taken[0]!r} already exists")
                    pipe.multi()
                    for r, k in zip(recs, keys):
                        pipe.hset(k, mapping=self._mapping(r))
                    pipe.zadd(self._k("user", user_id, "facts"), {r.fact_id: first + i for i, r in enumerate(recs)})
                    pipe.incr(self._k("user", user_id, "ver"))
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        return recs

    def get(self, user_id, fact_id):
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        return self._owned(user_id, fact_id, self.r.hgetall(self._fact_key(fact_id)))

    def get_many(self, user_id, fact_ids):
        check_id("user_id", user_id)
        for f in fact_ids:
            check_id("fact_id", f)
        with self.r.pipeline(transaction=False) as pipe:
            for f in fact_ids:
                pipe.hgetall(self._fact_key(f))
            rows = pipe.execute()
        return [self._owned(user_id, f, h) for f, h in zip(fact_ids, rows)]

    def list(self, user_id, offset=0, limit=None):
        check_id("user_id", user_id)
        if offset < 0 or (limit is not None and limit < 1):
            raise ValueError(f"bad page: offset={offset}, limit={limit}")
        end = -1 if limit is None else offset + limit  # one extra to know whether more follow
        ids = [x.decode() for x in self.r.zrange(self._k("user", user_id, "facts"), offset, end)]
        more = limit is not None and len(ids) > limit
        ids = ids[:limit] if limit is not None else ids
        recs = self.get_many(user_id, ids) if ids else []
        return recs, (offset + len(ids) if more else None)

    def count(self, user_id):
        check_id("user_id", user_id)
        return int(self.r.zcard(self._k("user", user_id, "facts")))

    def fact_versions(self, user_id):
        check_id("user_id", user_id)
        ids = [x.decode() for x in self.r.zrange(self._k("user", user_id, "facts"), 0, -1)]
        with self.r.pipeline(transaction=False) as pipe:
            for f in ids:
                pipe.hget(self._fact_key(f), "version")
            vers = pipe.execute()
        return {f: int(v) for f, v in zip(ids, vers) if v is not None}

    def update(self, user_id, fact_id, text=None, metadata=None, replace_metadata=False, embedding=None,
               expected_version=0):
        import redis

        emb = self._checked_update(user_id, fact_id, text, metadata, embedding)
        key = self._fact_key(fact_id)
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    cur = self._owned(user_id, fact_id, pipe.hgetall(key))
                    if expected_version and cur.version != expected_version:
                        raise VersionConflictError(fact_id, expected_version, cur.version)
                    new = self._updated(cur, text, metadata, replace_metadata, emb)
                    pipe.multi()
                    pipe.hset(key, mapping=self._mapping(new))
                    pipe.incr(self._k("user", user_id, "ver"))
                    pipe.execute()
                    return new
                except redis.WatchError:
                    continue

    def set_embedding(self, user_id, fact_id, version, embedding):
        import redis

        emb = _as_embedding(embedding)
        key = self._fact_key(fact_id)
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    cur = self._owned(user_id, fact_id, pipe.hgetall(key))
                    if cur.version != version:
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.hset(key, "embedding", emb.tobytes())
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    def delete(self, user_id, fact_id):
        import redis

        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        key = self._fact_key(fact_id)
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    rec = self._owned(user_id, fact_id, pipe.hgetall(key))
                    pipe.multi()
                    pipe.delete(key)
                    pipe.zrem(self._k("user", user_id, "facts"), fact_id)
                    pipe.incr(self._k("user", user_id, "ver"))
                    pipe.execute()
                    return rec
                except redis.WatchError:
                    continue

    def delete_user(self, user_id):
        check_id("user_id", user_id)
        facts_key = self._k("user", user_id, "facts")
        ids = [x.decode() for x in self.r.zrange(facts_key, 0, -1)]
        with self.r.pipeline(transaction=True) as pipe:
            for f in ids:
                pipe.delete(self._fact_key(f))
            pipe.delete(facts_key, self._k("placement", user_id))
            pipe.srem(self._k("placed_users"), user_id)
            pipe.incr(self._k("user", user_id, "ver"))  # kept: replicas must still see the change
            pipe.execute()
        return len(ids)

    def user_version(self, user_id):
        check_id("user_id", user_id)
        v = self.r.get(self._k("user", user_id, "ver"))
        return int(v) if v is not None else 0

    def add_placement(self, user_id, replica_id):
        check_id("user_id", user_id)
        with self.r.pipeline(transaction=True) as pipe:
            pipe.sadd(self._k("placement", user_id), replica_id)
            pipe.sadd(self._k("placed_users"), user_id)
            pipe.execute()

    def remove_placement(self, user_id, replica_id):
        check_id("user_id", user_id)
        key = self._k("placement", user_id)
        self.r.srem(key, replica_id)
        if self.r.scard(key) == 0:
            self.r.srem(self._k("placed_users"), user_id)

    def placement(self, user_id):
        check_id("user_id", user_id)
        return {x.decode() for x in self.r.smembers(self._k("placement", user_id))}

    def placements(self):
        users = [u.decode() for u in self.r.smembers(self._k("placed_users"))]
        out = {u: self.placement(u) for u in users}
        return {u: s for u, s in out.items() if s}

    def ping(self):
        self.r.ping()

    def close(self):
        self.r.close()


# ------------------------------------------------------------------------------------------ embedded
class EmbeddedRegistry(Registry):
    """Same interface, kept in this process behind one lock (a single-process run without Redis)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._facts: dict[str, FactRecord] = {}
        self._order: dict[str, list[str]] = {}  # user -> fact ids in creation order
        self._ver: dict[str, int] = {}
        self._placement: dict[str, set[str]] = {}

    def _owned(self, user_id, fact_id) -> FactRecord:
        rec = self._facts.get(fact_id)
        if rec is None or rec.user_id != user_id:
            raise UnknownFactError(user_id, fact_id)
        return rec

    def _bump(self, user_id):
        self._ver[user_id] = self._ver.get(user_id, 0) + 1

    def create(self, user_id, facts):
        recs = self._new_records(user_id, facts, time.time())
        with self._lock:
            taken = [r.fact_id for r in recs if r.fact_id in self._facts]
            if taken:
                raise DuplicateFactError(f"fact id {taken[0]!r} already exists")
            for r in recs:
                self._facts[r.fact_id] = r
                self._order.setdefault(user_id, []).append(r.fact_id)
            if recs:
                self._bump(user_id)
        return recs

    def get(self, user_id, fact_id):
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        with self._lock:
            return self._owned(user_id, fact_id)

    def get_many(self, user_id, fact_ids):
        check_id("user_id", user_id)
        with self._lock:
            return [self._owned(user_id, check_id("fact_id", f)) for f in fact_ids]

    def list(self, user_id, offset=0, limit=None):
        check_id("user_id", user_id)
        if offset < 0 or (limit is not None and limit < 1):
            raise ValueError(f"bad page: offset={offset}, limit={limit}")
        with self._lock:
            ids = self._order.get(user_id, [])
            page = ids[offset:] if limit is None else ids[offset:offset + limit]
            more = limit is not None and offset + limit < len(ids)
            return [self._facts[f] for f in page], (offset + len(page) if more else None)

    def count(self, user_id):
        check_id("user_id", user_id)
        with self._lock:
            return len(self._order.get(user_id, []))

    def fact_versions(self, user_id):
        check_id("user_id", user_id)
        with self._lock:
            return {f: self._facts[f].version for f in self._order.get(user_id, [])}

    def update(self, user_id, fact_id, text=None, metadata=None, replace_metadata=False, embedding=None,
               expected_version=0):
        emb = self._checked_update(user_id, fact_id, text, metadata, embedding)
        with self._lock:
            cur = self._owned(user_id, fact_id)
            if expected_version and cur.version != expected_version:
                raise VersionConflictError(fact_id, expected_version, cur.version)
            new = self._updated(cur, text, metadata, replace_metadata, emb)
            self._facts[fact_id] = new
            self._bump(user_id)
            return new

    def set_embedding(self, user_id, fact_id, version, embedding):
        emb = _as_embedding(embedding)
        with self._lock:
            cur = self._owned(user_id, fact_id)
            if cur.version != version:
                return False
            self._facts[fact_id] = replace(cur, embedding=emb)
            return True

    def delete(self, user_id, fact_id):
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        with self._lock:
            rec = self._owned(user_id, fact_id)
            del self._facts[fact_id]
            self._order[user_id].remove(fact_id)
            self._bump(user_id)
            return rec

    def delete_user(self, user_id):
        check_id("user_id", user_id)
        with self._lock:
            ids = self._order.pop(user_id, [])
            for f in ids:
                del self._facts[f]
            self._placement.pop(user_id, None)
            self._bump(user_id)
            return len(ids)

    def user_version(self, user_id):
        check_id("user_id", user_id)
        with self._lock:
            return self._ver.get(user_id, 0)

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


# ------------------------------------------------------------------------------------------ Ray actor
ACTOR_SCHEME = "ray-actor://"
ACTOR_NAMESPACE = "inferscale"


class _RegistryActor:
    """The actor behind ActorRegistry: one EmbeddedRegistry; Ray runs its calls one at a time."""

    def __init__(self):
        self.registry = EmbeddedRegistry()

    def call(self, method: str, args: tuple, kwargs: dict):
        return getattr(self.registry, method)(*args, **kwargs)


class ActorRegistry(Registry):
    """An EmbeddedRegistry inside a named, detached Ray actor (created by the first process that opens it):
    every replica of a Serve application without Redis sees the same facts. In memory only: the data
    lives as long as the Ray cluster."""

    def __init__(self, name: str, namespace: str = ACTOR_NAMESPACE):
        import ray

        check_id("registry actor name", name)
        self.name = name
        self.actor = ray.remote(_RegistryActor).options(
            name=name, namespace=namespace, lifetime="detached", get_if_exists=True, num_cpus=0).remote()

    def _call(self, method: str, *args, **kwargs):
        import ray

        try:
            return ray.get(self.actor.call.remote(method, args, kwargs))
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None  # the registry's own error (UnknownFactError, ...), not Ray's wrapper
            raise

    def create(self, user_id, facts):
        return self._call("create", user_id, facts)

    def get(self, user_id, fact_id):
        return self._call("get", user_id, fact_id)

    def get_many(self, user_id, fact_ids):
        return self._call("get_many", user_id, fact_ids)

    def list(self, user_id, offset=0, limit=None):
        return self._call("list", user_id, offset, limit)

    def count(self, user_id):
        return self._call("count", user_id)

    def fact_versions(self, user_id):
        return self._call("fact_versions", user_id)

    def update(self, user_id, fact_id, text=None, metadata=None, replace_metadata=False, embedding=None,
               expected_version=0):
        return self._call("update", user_id, fact_id, text=text, metadata=metadata,
                          replace_metadata=replace_metadata, embedding=embedding, expected_version=expected_version)

    def set_embedding(self, user_id, fact_id, version, embedding):
        return self._call("set_embedding", user_id, fact_id, version, embedding)

    def delete(self, user_id, fact_id):
        return self._call("delete", user_id, fact_id)

    def delete_user(self, user_id):
        return self._call("delete_user", user_id)

    def user_version(self, user_id):
        return self._call("user_version", user_id)

    def add_placement(self, user_id, replica_id):
        return self._call("add_placement", user_id, replica_id)

    def remove_placement(self, user_id, replica_id):
        return self._call("remove_placement", user_id, replica_id)

    def placement(self, user_id):
        return self._call("placement", user_id)

    def placements(self):
        return self._call("placements")

    def ping(self):
        return self._call("ping")


def open_registry(url: str | None, prefix: str = "inferscale:") -> Registry:
    """RedisRegistry for a redis:// (or rediss://, unix://) URL, ActorRegistry for ray-actor://NAME (inside
    a Ray cluster), EmbeddedRegistry for None or ""."""
    if not url:
        return EmbeddedRegistry()
    if url.startswith(ACTOR_SCHEME):
        return ActorRegistry(url[len(ACTOR_SCHEME):])
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"registry URL {url!r} is not a redis://, rediss://, unix:// or {ACTOR_SCHEME} URL")
    return RedisRegistry(url, prefix=prefix)
