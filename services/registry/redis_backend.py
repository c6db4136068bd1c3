"""RedisRegistry: the deployment backend. Every replica of every deployment sees the same data, and it survives
process restarts. Multi-key changes are WATCH/MULTI transactions, retried when a watched key moved, so
quotas hold under concurrent writers; deletes are Lua scripts, so that they work on a full Redis (DELETE_FACT)."""
from __future__ import annotations

import json
import os
import time
from urllib.parse import urlsplit

import numpy as np

from inferscale_core.errors import UnknownFactError, check_id

from .base import (
    MAX_HISTORY,
    TOMBSTONES_KEPT,
    DuplicateFactError,
    FactRecord,
    FactVersion,
    Registry,
    Tombstone,
    VersionConflictError,
    _as_embedding,
    check_quota,
    fact_bytes,
    new_version,
)

PASSWORD_ENV = "INFERSCALE_REDIS_PASSWORD"
CONNECT_TIMEOUT_S = 1.0   # a Redis host that does not answer
SOCKET_TIMEOUT_S = 2.0    # a command (or a new connection's handshake) without an answer: half-open, stalled
RETRIES = 1               # connection/timeout errors retried this often (with backoff) before they are raised

# The registry counts as full (Registry.is_full: Health says so) this close to Redis' maxmemory: a write is refused
# when used memory with the write's own request buffered passes maxmemory, and a refused MULTI is dropped whole, so
# a Redis that refuses creates can sit below maxmemory (redis 6.2: by 23 KB after a refused 8-fact create). One
# request is at most 1 MiB (api.Limits.max_request_bytes).
FULL_WITHIN_BYTES = 1 << 20

# Deletes are Lua scripts, not WATCH/MULTI transactions, so that they work on a full Redis (maxmemory reached,
# policy noeviction, as the chart ships it): that is when a user or an operator deletes facts to free space.
# Redis over maxmemory refuses every command queued in a MULTI, a DEL included (Redis 6.2, 7.0: tested), and a
# command that may grow memory (XADD, INCR, DECRBY: the "denyoom" ones) sent alone. A script without a shebang
# line (no flags) is refused such a command only while it has written nothing yet: once it has written, Redis
# runs it to its end, since a script cannot stop halfway. So each script's first write is the DEL that frees
# the fact(s); the tombstone and the counters follow in the same script, one atomic step that Redis applies,
# replicates and appends to its AOF whole. Nothing is acknowledged without its tombstone (engine replicas learn
# of deletes only from the tombstone stream), and no crash can leave a deleted fact without one, as a delete
# then a separate tombstone write could. A script on a full Redis grows it by a tombstone and its counters
# (a few hundred bytes) past maxmemory, after freeing the fact(s); what maxmemory leaves below the memory limit
# (the chart: 1536 MiB of a 2 GiB pod) absorbs that.
# The delete script writes only if the fact is still the one read (owner, version, creation sequence number:
# a fact deleted and created again under its id has a new one); else it returns 0 and the delete reads again,
# as a WATCH that saw the fact move would. Everything that changes the bytes the delete subtracts (text,
# metadata, window, history, kv_bytes) is an update, which raises the version.
DELETE_FACT = """
-- KEYS: fact, history, user's facts (zset), user bytes, user kv bytes, tombstones, user version
-- ARGV: user_id, fact_id, version, creation sequence (-1: not listed), bytes, kv bytes, tombstones kept
local seq = redis.call('ZSCORE', KEYS[3], ARGV[2])
if redis.call('HGET', KEYS[1], 'user_id') ~= ARGV[1]
    or tonumber(redis.call('HGET', KEYS[1], 'version')) ~= tonumber(ARGV[3])
    or (tonumber(seq) or -1) ~= tonumber(ARGV[4]) then
  return 0
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('DECRBY', KEYS[4], ARGV[5])
redis.call('DECRBY', KEYS[5], ARGV[6])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[7], '*', 'user', ARGV[1], 'fact', ARGV[2], 'upto', ARGV[3],
           'gone', '1')
redis.call('INCR', KEYS[7])
return 1
"""
# The fact and history keys of the user's facts are built in the script from their prefixes (the ids are read
# there, in the same atomic step), not passed as KEYS: fine on the one standalone Redis the registry runs on
# (its transactions span keys of any hash slot already; Redis Cluster is not supported).
DELETE_USER = """
-- KEYS: user's facts (zset), user bytes, user kv bytes, placement, placed users, tombstones, user version
-- ARGV: user_id, fact key prefix, history key prefix, tombstones kept
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
for _, f in ipairs(ids) do
  redis.call('DEL', ARGV[2] .. f, ARGV[3] .. f)
end
redis.call('SREM', KEYS[5], ARGV[1])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[4], '*', 'user', ARGV[1], 'fact', '', 'upto', '0', 'gone', '1')
redis.call('INCR', KEYS[7])
return #ids
"""


def redacted(url: str) -> str:
    """The URL with its password replaced, for logs and banners."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


class RedisRegistry(Registry):
    """Keys (all under `prefix`):
      fact:{fact_id}        hash  user_id, text, metadata (JSON), version, created_at, updated_at, embedding,
                                  window (JSON), unservable (reason; empty when servable), kv_bytes
      history:{fact_id}     list  the fact's earlier versions (FactVersion JSON), oldest first, at most MAX_HISTORY
      user:{user_id}:facts  zset  fact_id -> creation sequence (stable listing order)
      user:{user_id}:bytes  int   fact_bytes of the user's facts plus their history's bytes (the byte quota)
      user:{user_id}:kvbytes int  kv_bytes of the user's facts (the KV quota)
      tombstones            stream  user, fact, upto, gone: KV to remove from every tier (base.Tombstone), capped at
                                  TOMBSTONES_KEPT entries
      user:{user_id}:ver    int   the user's change counter
      placement:{user_id}   set   engine replica ids
      placed_users          set   users with a non-empty placement
      seq                   int   global creation sequence

    The password comes from the URL (`redis://:PASSWORD@host:port/0`) or, when the URL has none, from
    $INFERSCALE_REDIS_PASSWORD, so a Kubernetes Secret can supply it without it appearing in any config.
    """

    def __init__(self, url: str, prefix: str = "inferscale:"):
        import redis

        self.url, self.prefix = url, prefix
        kw = {}
        if urlsplit(url).password is None and os.environ.get(PASSWORD_ENV):
            kw["password"] = os.environ[PASSWORD_ENV]
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        # Bounded waits: a Redis that is down or a half-open connection fails a call within
        # (1 + RETRIES) * (CONNECT_TIMEOUT_S + 2 * SOCKET_TIMEOUT_S) = 10 s (UNAVAILABLE at the API) instead of
        # blocking a thread, and with it a user's lock, for minutes. The pool reconnects once Redis is back.
        self.r = redis.Redis.from_url(url, decode_responses=False, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                      socket_timeout=SOCKET_TIMEOUT_S, health_check_interval=15,
                                      retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES), **kw)
        self._delete_fact, self._delete_user = self.r.register_script(DELETE_FACT), self.r.register_script(DELETE_USER)

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
            window=tuple(json.loads(h.get(b"window", b"[]"))),
            unservable_reason=h.get(b"unservable", b"").decode(), kv_bytes=int(h.get(b"kv_bytes", 0)))

    @staticmethod
    def _mapping(rec: FactRecord) -> dict:
        return {"user_id": rec.user_id, "text": rec.text, "metadata": json.dumps(rec.metadata),
                "version": rec.version, "created_at": repr(rec.created_at), "updated_at": repr(rec.updated_at),
                "embedding": rec.embedding.astype(np.float32).tobytes() if rec.embedding is not None else b"",
                "window": json.dumps(list(rec.window)), "unservable": rec.unservable_reason, "kv_bytes": rec.kv_bytes}

    def _owned(self, user_id: str, fact_id: str, h: dict) -> FactRecord:
        if not h or h[b"user_id"].decode() != user_id:
            raise UnknownFactError(user_id, fact_id)
        return self._record(fact_id, h)

    def _tomb(self, pipe, t: Tombstone) -> None:
        """Queues the tombstone in the transaction `pipe` (after pipe.multi())."""
        pipe.xadd(self._k("tombstones"), {"user": t.user_id, "fact": t.fact_id, "upto": t.upto, "gone": int(t.gone)},
                  maxlen=TOMBSTONES_KEPT, approximate=True)

    def _transaction(self, keys: list[str], body):
        """Runs body(pipe) under WATCH keys until no watched key moved in between; returns its result.
        body reads through `pipe` (immediate mode), then calls pipe.multi() and queues its writes."""
        import redis

        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(*keys)
                    out = body(pipe)
                    if pipe.explicit_transaction:
                        pipe.execute()
                    else:
                        pipe.unwatch()
                    return out
                except redis.WatchError:
                    continue

    def create(self, user_id, facts, quota=None):
        recs = self._new_records(user_id, facts, time.time())
        if not recs:
            return []
        keys = [self._fact_key(r.fact_id) for r in recs]
        facts_key, bytes_key = self._k("user", user_id, "facts"), self._k("user", user_id, "bytes")
        kv_key = self._k("user", user_id, "kvbytes")
        added, added_kv = sum(fact_bytes(r) for r in recs), sum(r.kv_bytes for r in recs)
        # Creation sequence numbers first (gaps are harmless), then facts + listing + counters in one MULTI.
        first = int(self.r.incrby(self._k("seq"), len(recs))) - len(recs) + 1

        def body(pipe):
            taken = [r.fact_id for r, k in zip(recs, keys) if pipe.exists(k)]  # never overwrite a fact
            if taken:
                raise DuplicateFactError(f"fact id {taken[0]!r} already exists")
            check_quota(quota, user_id, int(pipe.zcard(facts_key)), int(pipe.get(bytes_key) or 0), len(recs), added,
                        int(pipe.get(kv_key) or 0), added_kv)
            pipe.multi()
            for r, k in zip(recs, keys):
                pipe.hset(k, mapping=self._mapping(r))
            pipe.zadd(facts_key, {r.fact_id: first + i for i, r in enumerate(recs)})
            pipe.incrby(bytes_key, added)
            pipe.incrby(kv_key, added_kv)
            pipe.incr(self._k("user", user_id, "ver"))

        self._transaction([*keys, facts_key, bytes_key, kv_key], body)
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

    def find_many(self, user_id, fact_ids):
        check_id("user_id", user_id)
        for f in fact_ids:
            check_id("fact_id", f)
        if not fact_ids:
            return {}
        with self.r.pipeline(transaction=False) as pipe:
            for f in fact_ids:
                pipe.hgetall(self._fact_key(f))
            rows = pipe.execute()
        return {f: self._record(f, h) for f, h in zip(fact_ids, rows) if h and h[b"user_id"].decode() == user_id}

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

    def list_after(self, user_id, after, limit):
        check_id("user_id", user_id)
        if after < 0 or limit < 1:
            raise ValueError(f"bad page: after={after}, limit={limit}")
        # One extra to know whether more follow; the score is the creation sequence (exclusive lower bound).
        rows = self.r.zrangebyscore(self._k("user", user_id, "facts"), f"({after}", "+inf", start=0, num=limit + 1,
                                    withscores=True)
        more, rows = len(rows) > limit, rows[:limit]
        found = self.find_many(user_id, [f.decode() for f, _ in rows])  # one deleted in between is left out
        page = [(int(s), found[f.decode()]) for f, s in rows if f.decode() in found]
        return page, (int(rows[-1][1]) if more else None)

    def seq_of(self, user_id, fact_id):
        check_id("user_id", user_id)
        seq = self.r.zscore(self._k("user", user_id, "facts"), check_id("fact_id", fact_id))
        return None if seq is None else int(seq)

    def count(self, user_id):
        check_id("user_id", user_id)
        return int(self.r.zcard(self._k("user", user_id, "facts")))

    def latest(self, user_id, n):
        check_id("user_id", user_id)
        if n <= 0:
            return []
        ids = [x.decode() for x in self.r.zrange(self._k("user", user_id, "facts"), -n, -1)]
        found = self.find_many(user_id, ids)  # one deleted in between is left out
        return [found[f] for f in ids if f in found]

    def user_bytes(self, user_id):
        check_id("user_id", user_id)
        return int(self.r.get(self._k("user", user_id, "bytes")) or 0)

    def user_kv_bytes(self, user_id):
        check_id("user_id", user_id)
        return int(self.r.get(self._k("user", user_id, "kvbytes")) or 0)

    def tombstones_after(self, cursor, limit=1000):
        key = self._k("tombstones")
        if cursor is None:
            last = self.r.xrevrange(key, count=1)
            return [], last[0][0].decode() if last else "0-0"
        read = self.r.xread({key: cursor}, count=limit)
        entries = read[0][1] if read else []
        out = [Tombstone(f[b"user"].decode(), f[b"fact"].decode(), int(f[b"upto"]), f[b"gone"] == b"1")
               for _, f in entries]
        return out, entries[-1][0].decode() if entries else cursor

    def fact_versions(self, user_id):
        check_id("user_id", user_id)
        ids = [x.decode() for x in self.r.zrange(self._k("user", user_id, "facts"), 0, -1)]
        with self.r.pipeline(transaction=False) as pipe:
            for f in ids:
                pipe.hget(self._fact_key(f), "version")
            vers = pipe.execute()
        return {f: int(v) for f, v in zip(ids, vers) if v is not None}

    def update(self, user_id, fact_id, text=None, metadata=None, replace_metadata=False, embedding=None,
               expected_version=0, quota=None, window=None, kv_bytes=None):
        # A full Redis refuses the whole MULTI (redis-py's OutOfMemoryError; UNAVAILABLE REGISTRY_FULL at the API),
        # nothing of it written: an update may grow memory, so it waits for deletes to free space.
        emb = self._checked_update(user_id, fact_id, text, metadata, embedding, window)
        key, bytes_key = self._fact_key(fact_id), self._k("user", user_id, "bytes")
        hist_key = self._k("history", fact_id)
        kv_key = self._k("user", user_id, "kvbytes")

        def body(pipe):
            cur = self._owned(user_id, fact_id, pipe.hgetall(key))
            if expected_version and cur.version != expected_version:
                raise VersionConflictError(fact_id, expected_version, cur.version)
            new = self._updated(cur, text, metadata, replace_metadata, emb, window, kv_bytes)
            grown, grown_kv = fact_bytes(new) - fact_bytes(cur), new.kv_bytes - cur.kv_bytes
            old = new_version(cur, new)
            if old is not None:
                old = old.to_json()
                over = int(pipe.llen(hist_key)) + 1 - MAX_HISTORY  # the oldest versions dropped
                grown += len(old) - (sum(len(v) for v in pipe.lrange(hist_key, 0, over - 1)) if over > 0 else 0)
            check_quota(quota, user_id, 0, int(pipe.get(bytes_key) or 0), 0, grown, int(pipe.get(kv_key) or 0),
                        grown_kv)
            pipe.multi()
            pipe.hset(key, mapping=self._mapping(new))
            if old is not None:
                pipe.rpush(hist_key, old)
                pipe.ltrim(hist_key, -MAX_HISTORY, -1)
            pipe.incrby(bytes_key, grown)
            pipe.incrby(kv_key, grown_kv)
            self._tomb(pipe, Tombstone(user_id, fact_id, cur.version))
            pipe.incr(self._k("user", user_id, "ver"))
            return new

        return self._transaction([key, bytes_key, hist_key, kv_key], body)

    def history(self, user_id, fact_id):
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        with self.r.pipeline(transaction=False) as pipe:
            pipe.hget(self._fact_key(fact_id), "user_id")
            pipe.lrange(self._k("history", fact_id), 0, -1)
            owner, rows = pipe.execute()
        if owner is None or owner.decode() != user_id:
            raise UnknownFactError(user_id, fact_id)
        return [FactVersion.from_json(v) for v in rows]

    def _set_field(self, user_id, fact_id, version, field_name, value) -> bool:
        key = self._fact_key(fact_id)

        def body(pipe):
            cur = self._owned(user_id, fact_id, pipe.hgetall(key))
            if cur.version != version:
                return False
            pipe.multi()
            pipe.hset(key, field_name, value)
            return True

        return self._transaction([key], body)

    def set_embedding(self, user_id, fact_id, version, embedding):
        return self._set_field(user_id, fact_id, version, "embedding", _as_embedding(embedding).tobytes())

    def set_unservable(self, user_id, fact_id, version, reason):
        return self._set_field(user_id, fact_id, version, "unservable", str(reason) or "unservable")

    def delete(self, user_id, fact_id):
        """A Lua script (DELETE_FACT, see there): works on a full Redis too."""
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        key, hist_key = self._fact_key(fact_id), self._k("history", fact_id)
        facts_key = self._k("user", user_id, "facts")
        keys = [key, hist_key, facts_key, self._k("user", user_id, "bytes"), self._k("user", user_id, "kvbytes"),
                self._k("tombstones"), self._k("user", user_id, "ver")]
        while True:
            with self.r.pipeline(transaction=False) as pipe:
                pipe.hgetall(key)
                pipe.lrange(hist_key, 0, -1)
                pipe.zscore(facts_key, fact_id)
                h, kept, seq = pipe.execute()
            rec = self._owned(user_id, fact_id, h)
            args = [user_id, fact_id, rec.version, -1 if seq is None else int(seq),
                    fact_bytes(rec) + sum(len(v) for v in kept), rec.kv_bytes, TOMBSTONES_KEPT]
            if self._delete_fact(keys=keys, args=args):
                return rec

    def delete_user(self, user_id):
        """A Lua script (DELETE_USER, see DELETE_FACT): works on a full Redis too."""
        check_id("user_id", user_id)
        keys = [self._k("user", user_id, "facts"), self._k("user", user_id, "bytes"),
                self._k("user", user_id, "kvbytes"), self._k("placement", user_id), self._k("placed_users"),
                self._k("tombstones"), self._k("user", user_id, "ver")]  # ver kept: replicas must still see the change
        return int(self._delete_user(keys=keys, args=[user_id, self._fact_key(""), self._k("history", ""),
                                                      TOMBSTONES_KEPT]))

    def user_version(self, user_id):
        check_id("user_id", user_id)
        v = self.r.get(self._k("user", user_id, "ver"))
        return int(v) if v is not None else 0

    def user_versions(self, user_ids):
        for u in user_ids:
            check_id("user_id", u)
        if not user_ids:
            return []
        return [int(v) if v is not None else 0 for v in self.r.mget([self._k("user", u, "ver") for u in user_ids])]

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

    def is_full(self):
        """Within FULL_WITHIN_BYTES of maxmemory (0: no limit, never full)."""
        m = self.r.info("memory")
        limit = int(m.get("maxmemory", 0))
        # What Redis compares with maxmemory before a write: used memory less its replicas' and AOF buffers.
        used = int(m["used_memory"]) - int(m.get("mem_not_counted_for_evict", 0))
        return limit > 0 and used >= limit - FULL_WITHIN_BYTES

    def close(self):
        self.r.close()
