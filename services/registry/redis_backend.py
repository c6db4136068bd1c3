"""RedisRegistry: the deployment backend. Every replica of every deployment sees the same data, and it survives
process restarts. Multi-key changes are WATCH/MULTI transactions, retried when a watched key moved, so
quotas hold under concurrent writers; deletes are Lua scripts, so that they work on a full Redis (DELETE_FACT).

The same code runs on one Redis and on a Redis Cluster (detected at the first call: `INFO cluster` on the node the
URL names). Every key of a user carries the hash tag of the user's bucket, `{b<N>}` (N = bucket_of(user_id), one of
BUCKETS), so every command, transaction and script of one operation touches one hash slot, as a cluster requires;
nothing on a write path is global (the creation sequence, the tombstone log and the set of placed users are per
bucket). Data written by the layout before buckets (global `fact:{id}`, `seq`, `tombstones`) is not read."""
from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

import numpy as np

from inferscale_core.errors import InferScaleError, UnknownFactError, check_id

from .base import (
    IDEMPOTENCY_PURGE_PER_CREATE,
    MAX_HISTORY,
    TOMBSTONES_KEPT,
    DuplicateFactError,
    FactRecord,
    FactVersion,
    IdempotentAdd,
    IdempotentRepeatError,
    Registry,
    Tombstone,
    UnconfirmedWriteError,
    VersionConflictError,
    _as_embedding,
    check_quota,
    fact_bytes,
    new_version,
)

PASSWORD_ENV = "INFERSCALE_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "INFERSCALE_REDIS_PASSWORD_FILE"  # a file holding it (the chart mounts the Secret there)
CONNECT_TIMEOUT_S = 1.0   # a Redis host that does not answer
SOCKET_TIMEOUT_S = 2.0    # a command (or a new connection's handshake) without an answer: half-open, stalled
RETRIES = 1               # connection/timeout errors retried this often (with backoff) before they are raised
# On a Redis Cluster a master that fails is replaced by its replica within about cluster-node-timeout plus a second or
# two; until then its slots answer nothing. Reads retry that often (about 4 s of backoff, the slot map refreshed at
# each try) and a write re-runs until WRITE_RIDE_THROUGH_S have passed, as long as nothing of it can have been
# applied; then UNAVAILABLE (retry hint) at the API.
CLUSTER_RETRIES = 6
WRITE_RIDE_THROUGH_S = 4.0

# Durability: a write is acknowledged once `WAIT` says enough replicas of its master have it (see _confirm). Set in
# the registry URL's query, e.g. redis://host:6379/0?wait_replicas=1&wait_timeout_ms=500:
#   wait_replicas    "auto" (the default): 1 when the master has a replica (see _replicas_wanted), else 0; a number:
#                    that many, always (a master with fewer refuses every write as unconfirmed); 0: never wait
#   wait_timeout_ms  how long a write waits for them (default WAIT_TIMEOUT_MS), below the socket timeout
WAIT_REPLICAS_OPTION, WAIT_TIMEOUT_OPTION = "wait_replicas", "wait_timeout_ms"
WAIT_TIMEOUT_MS = 500
REPLICAS_RECHECK_S = 5.0
# More nodes of a Redis Cluster to start from when the URL's own host does not answer (a cluster client learns
# every node from any one): redis://node-a:6379/0?seeds=node-b:6379,node-c:6379. They share the URL's scheme,
# password and TLS options.
SEEDS_OPTION = "seeds"
# TLS: a rediss:// URL; redis-py's own options in its query say what to trust, e.g.
# rediss://redis-0:6379/0?ssl_ca_certs=/var/run/secrets/inferscale/redis-tls/ca.crt (the chart mounts
# redis.tls.caSecret there and adds the option):
#   ssl_ca_certs          PEM file of the CA that signed the server's certificate (without it: the system's CAs)
#   ssl_check_hostname    true (the default): the certificate must name the host connected to (on a cluster, the
#                         addresses its nodes announce); false: only the CA is checked
#   ssl_certfile, ssl_keyfile   a client certificate, for a server that asks for one (tls-auth-clients yes)
# A TLS failure at the first connection is RegistryTlsError, which says which side is wrong (a certificate the CA did
# not sign, a plain URL for a TLS-only port or the reverse, an unreadable file); UNAVAILABLE at the API.
TLS_FILE_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
TLS_PROBE_TIMEOUT_S = 1.0  # the diagnosis's own connection: does that port speak TLS, or plain Redis?

# Users are grouped into BUCKETS by a stable hash of their id (bucket_of); a bucket's keys share one hash tag, so on
# a Redis Cluster they live in one slot, and the buckets spread over the masters. Per-bucket rather than per-user
# keys for what readers scan (the tombstone log, the placed users): a reader reads BUCKETS streams, not one per
# user. Changing BUCKETS moves every user to another bucket: existing data would no longer be found.
BUCKETS = 1024
# Each bucket's tombstone stream is capped at this many entries (approximately: MAXLEN ~), so the whole log holds at
# most about 2 x TOMBSTONES_KEPT; a replica down for more deletes than this in one bucket misses the oldest of them.
TOMBSTONES_PER_BUCKET = max(1000, 2 * TOMBSTONES_KEPT // BUCKETS)
# tombstones_after reads at most this many entries of one bucket per call (then the caller reads again), so a
# reader far behind on many buckets does not fetch BUCKETS x limit entries at once.
TOMBSTONES_READ_PER_BUCKET = 128
TOMBSTONES_FULL_READ_S = 30.0  # tombstones_after reads every bucket at least this often (see there)
CURSOR_TAG = "b:"  # a tombstone cursor: "b:" then "bucket=last-id" for the buckets read so far, comma-separated

# The registry counts as full (Registry.is_full: Health says so) this close to Redis' maxmemory: a write is refused
# when used memory with the write's own request buffered passes maxmemory, and a refused MULTI is dropped whole, so
# a Redis that refuses creates can sit below maxmemory (redis 6.2: by 23 KB after a refused 8-fact create). One
# request is at most 1 MiB (services/limits.py: Limits.max_request_bytes). On a cluster: any master that close.
FULL_WITHIN_BYTES = 1 << 20


def bucket_of(user_id: str) -> int:
    """The user's bucket: a stable hash of its id (the same in every process and release; not Python's hash())."""
    return int.from_bytes(hashlib.sha1(user_id.encode()).digest()[:8], "big") % BUCKETS

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
KV_TIER_KINDS = ("kvtier", "kvtierv", "kvtiersum")  # the user's cluster-tier books (KV_TIER_ADMIT)
DELETE_FACT = """
-- KEYS: fact, history, user's facts (zset), user bytes, user kv bytes, tombstones, user version, the fact id's
--       owners (set), user's expiring facts (zset), the user's cluster-tier books (zset, hash, bytes)
-- ARGV: user_id, fact_id, version, creation sequence (-1: not listed), bytes, kv bytes, tombstones kept
local seq = redis.call('ZSCORE', KEYS[3], ARGV[2])
if redis.call('HGET', KEYS[1], 'user_id') ~= ARGV[1]
    or tonumber(redis.call('HGET', KEYS[1], 'version')) ~= tonumber(ARGV[3])
    or (tonumber(seq) or -1) ~= tonumber(ARGV[4]) then
  return 0
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('SREM', KEYS[8], ARGV[1])
redis.call('ZREM', KEYS[9], ARGV[2])
redis.call('DECRBY', KEYS[4], ARGV[5])
redis.call('DECRBY', KEYS[5], ARGV[6])
local booked = redis.call('HGET', KEYS[11], ARGV[2])
if booked then
  redis.call('DECRBY', KEYS[12], string.match(booked, ':(%d+)$'))
  redis.call('HDEL', KEYS[11], ARGV[2])
  redis.call('ZREM', KEYS[10], ARGV[2])
end
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[7], '*', 'user', ARGV[1], 'fact', ARGV[2], 'upto', ARGV[3],
           'gone', '1')
redis.call('INCR', KEYS[7])
return 1
"""
# The fact, history and owners keys of the user's facts are built in the script from their prefixes (the ids are read
# there, in the same atomic step), not passed as KEYS. On a Redis Cluster a script may touch only keys of the node
# it runs on, and (Redis 7, a script without flags) of the slot of its declared KEYS: these keys carry the user's
# bucket tag, as the declared ones do, so they are in the same slot (tests/unit/test_registry.py checks it on a real
# cluster). What this relies on is Redis running a script that names keys it was not given, in the slot of the
# ones it was: every Redis does (only the scripting docs' advice is stricter).
DELETE_USER = """
-- KEYS: user's facts (zset), user bytes, user kv bytes, placement, placed users, tombstones, user version,
--       user's expiring facts (zset), user's idempotency keys (hash), their expiry (zset), the user's
--       cluster-tier books (zset, hash, bytes)
-- ARGV: user_id, fact key prefix, history key prefix, tombstones kept, owners key prefix
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13])
for _, f in ipairs(ids) do
  redis.call('DEL', ARGV[2] .. f, ARGV[3] .. f)
  redis.call('SREM', ARGV[5] .. f, ARGV[1])
end
redis.call('SREM', KEYS[5], ARGV[1])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[4], '*', 'user', ARGV[1], 'fact', '', 'upto', '0', 'gone', '1')
redis.call('INCR', KEYS[7])
return #ids
"""

# The cluster KV tier's books of one user (Registry.kv_tier_admit): facts by last use, their "version:bytes", and the
# bytes booked. The order of use is a logical clock per user (the highest score + 1), not a wall clock: two uses in
# the same millisecond, or on two machines, still come in the order Redis ran them. Byte counts stay strings
# (INCRBY/DECRBY of the caller's digits): a Lua number written back could come out in exponent form.
KV_TIER_ADMIT = """
-- KEYS: the user's booked facts by last use (zset), their "version:bytes" (hash), the bytes booked
-- ARGV: cap, then fact_id, version, bytes of each fact about to be written
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local top = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local now = (tonumber(top[2]) or 0) + 1
local new = {}
for i = 2, #ARGV, 3 do
  local f = ARGV[i]
  local old = redis.call('HGET', KEYS[2], f)
  if old then
    local n = string.match(old, ':(%d+)$')
    redis.call('DECRBY', KEYS[3], n)
    total = total - tonumber(n)
  end
  redis.call('HSET', KEYS[2], f, ARGV[i + 1] .. ':' .. ARGV[i + 2])
  redis.call('ZADD', KEYS[1], now, f)
  redis.call('INCRBY', KEYS[3], ARGV[i + 2])
  total = total + tonumber(ARGV[i + 2])
  new[f] = true
end
local cap = tonumber(ARGV[1])
local out = {}
local skipped = 0  -- the facts just written, kept: always the first `skipped` of the range read next
while total > cap do
  local batch = redis.call('ZRANGE', KEYS[1], skipped, skipped + 63)
  if #batch == 0 then break end
  for _, f in ipairs(batch) do
    if total <= cap then break end
    if new[f] then
      skipped = skipped + 1
    else
      local booked = redis.call('HGET', KEYS[2], f)
      local version, n = string.match(booked, '^(%d+):(%d+)$')
      redis.call('DECRBY', KEYS[3], n)
      redis.call('HDEL', KEYS[2], f)
      redis.call('ZREM', KEYS[1], f)
      total = total - tonumber(n)
      out[#out + 1] = f .. '@v' .. version
    end
  end
end
return out
"""
KV_TIER_TOUCH = """
-- KEYS: the user's booked facts by last use (zset)   ARGV: the facts used now (only booked ones are marked)
local top = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local now = (tonumber(top[2]) or 0) + 1
for _, f in ipairs(ARGV) do
  redis.call('ZADD', KEYS[1], 'XX', now, f)
end
return 1
"""

# Atomic, so that a concurrent add_placement cannot leave a placed user out of its bucket's set of placed users.
REMOVE_PLACEMENT = """
-- KEYS: placement, placed users (the bucket's)   ARGV: replica id, user_id
redis.call('SREM', KEYS[1], ARGV[1])
if redis.call('SCARD', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[2], ARGV[2])
end
return 1
"""

class RegistryTlsError(InferScaleError):
    """TLS between the registry and its Redis failed, or was asked of one side only: the message names the node and
    what to fix (the registry URL's scheme or ssl_* options, or the server's certificate)."""


def tls_failure(err: BaseException) -> bool:
    """Whether `err` is the registry's TLS failing: RegistryTlsError, or a redis-py error that an ssl.SSLError caused
    (a connection made after the first: its ConnectionError, or a cluster client's RedisClusterException from it)."""
    if isinstance(err, RegistryTlsError):
        return True
    import ssl

    try:
        from redis.exceptions import RedisClusterException, RedisError
    except ImportError:  # no redis-py: no Redis error to be
        return False
    return isinstance(err, (RedisError, RedisClusterException)) and any(isinstance(c, ssl.SSLError)
                                                                         for c in _chain(err))


def check_tls_options(url: str) -> None:
    """ValueError when the URL asks for TLS options (ssl_*) without TLS: redis-py would fail on them at the first
    call with a TypeError that names neither the URL nor the fix."""
    parts = urlsplit(url)
    asked = sorted({k for k, _ in parse_qsl(parts.query, keep_blank_values=True) if k.startswith("ssl_")})
    if asked and parts.scheme != "rediss":
        raise ValueError(f"registry URL option {asked[0]}= is for TLS: the URL must be rediss://, got "
                         f"{parts.scheme}://")


def _check_tls_files(parts) -> None:
    """RegistryTlsError naming an ssl_* file option whose file cannot be read (redis-py would say only "Error 2
    connecting ... No such file or directory")."""
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k in TLS_FILE_OPTIONS:
            try:
                Path(v).read_bytes()
            except OSError as e:
                raise RegistryTlsError(f"registry URL option {k}={v}: cannot read it ({e.strerror})") from None


def _tls_diagnosis(parts, err: BaseException) -> RegistryTlsError | None:
    """What a failed first connection to the node of `parts` says about TLS, else None: the certificate check
    failed; or the port answers the other protocol (asked with a connection of its own, only after a failure)."""
    import ssl

    host, port = parts.hostname, parts.port or 6379
    where = f"the registry's Redis at {host}:{port}"
    diagnosis = None
    if parts.scheme == "rediss":
        if any(isinstance(c, ssl.SSLCertVerificationError) for c in _chain(err)):
            diagnosis = RegistryTlsError(
                f"TLS with {where} failed: {_tls_reason(err)}; the server's certificate must be signed by the CA "
                "that the registry URL's ssl_ca_certs= names (without it: the system's CAs) and name the host "
                "connected to (or ssl_check_hostname=false)")
        elif any(isinstance(c, ssl.SSLError) for c in _chain(err)):
            diagnosis = RegistryTlsError(
                f"TLS with {where} failed: {_tls_reason(err)}; the server ended the handshake: one that asks for "
                "a client certificate (tls-auth-clients yes) needs the registry URL's ssl_certfile= and "
                "ssl_keyfile=, one the server's CA signed")
        elif _answers_plain_redis(host, port):
            diagnosis = RegistryTlsError(f"{where} answers plain Redis, not TLS: use a redis:// URL, or the server's "
                                         "TLS port")
    elif parts.scheme == "redis" and _speaks_tls(host, port):
        diagnosis = RegistryTlsError(f"{where} speaks TLS only: the registry URL must be rediss:// (with "
                                     "?ssl_ca_certs=PATH for a private CA)")
    if diagnosis is not None:
        diagnosis.__cause__ = err  # redis-py's own error, for the log's traceback
    return diagnosis


def _tls_reason(err: BaseException) -> str:
    """What the ssl.SSLError that caused `err` says (a certificate check's own message where there is one)."""
    import ssl

    cause = next((c for c in _chain(err) if isinstance(c, ssl.SSLError)), None)
    if cause is None:
        return str(err)
    return (getattr(cause, "verify_message", None) or cause.reason or str(cause)).rstrip(".")


def _chain(err: BaseException):
    """`err`, then what caused it (raise ... from, or raised while handling), and so on."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        yield cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__


def _speaks_tls(host: str, port: int) -> bool:
    """Whether a TLS handshake with host:port succeeds, its certificate unchecked (only the protocol is asked)."""
    import socket
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=TLS_PROBE_TIMEOUT_S) as sock:
            with ctx.wrap_socket(sock, server_hostname=host):
                return True
    except (OSError, ssl.SSLError):
        return False


def _answers_plain_redis(host: str, port: int) -> bool:
    """Whether host:port answers a plain-text PING as Redis does (+PONG, or an error such as -NOAUTH)."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=TLS_PROBE_TIMEOUT_S) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64)[:1] in (b"+", b"-")
    except OSError:
        return False


def _read_password_file(path: str | None) -> str | None:
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or None
    except OSError as e:
        raise ValueError(f"cannot read the Redis password file ${PASSWORD_FILE_ENV}={path}: {e.strerror}") from None


def redacted(url: str) -> str:
    """The URL with its password replaced, for logs and banners."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


def _entry_order(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


def _next_id(entry_id: str) -> str:
    """The smallest stream id after `entry_id` ("ms-seq"): XRANGE from it reads what follows (any Redis version;
    the exclusive "(" start needs 6.2)."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}" if int(seq or 0) < (1 << 64) - 1 else f"{int(ms) + 1}-0"


def encode_cursor(last: dict[int, str]) -> str:
    """A tombstone cursor: the last entry id read of each bucket read so far (the others: from their start)."""
    return CURSOR_TAG + ",".join(f"{b}={last[b]}" for b in sorted(last))


def decode_cursor(cursor: str) -> dict[int, str]:
    """bucket -> last entry id read. Also takes "0" (the beginning) and a plain stream id, the cursor of the layout
    before buckets (a replica's saved cursor): every bucket from that id on."""
    def stream_id(s: str) -> str:
        ms, dash, seq = s.partition("-")
        if not ms.isdigit() or (dash and not seq.isdigit()):
            raise ValueError(f"not a tombstone cursor: {cursor[:80]!r}")
        return s

    if cursor.startswith(CURSOR_TAG):
        out = {}
        for part in filter(None, cursor[len(CURSOR_TAG):].split(",")):
            b, eq, eid = part.partition("=")
            if not eq or not b.isdigit() or not 0 <= int(b) < BUCKETS:
                raise ValueError(f"not a tombstone cursor: {cursor[:80]!r}")
            out[int(b)] = stream_id(eid)
        return out
    if cursor in ("0", "0-0"):
        return {}
    return dict.fromkeys(range(BUCKETS), stream_id(cursor))


def seed_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """(the URL without its `seeds` option, the seed nodes it names as (host, port)); ValueError naming a bad one."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    seeds = []
    for k, v in query:
        if k != SEEDS_OPTION:
            continue
        for node in filter(None, v.split(",")):
            host, colon, port = node.rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"registry URL option {SEEDS_OPTION}={v!r}: comma-separated HOST:PORT nodes of a "
                                 f"Redis Cluster, e.g. {SEEDS_OPTION}=redis-1:6379,redis-2:6379; {node!r} is not one")
            seeds.append((host.strip("[]"), int(port)))
    rest = urlencode([(k, v) for k, v in query if k != SEEDS_OPTION])
    return parts._replace(query=rest).geturl(), seeds


def durability_options(url: str) -> tuple[str, int | None, int]:
    """(the URL without the registry's own query options, replicas to wait for (None: auto), wait timeout in ms)
    from the registry URL; ValueError naming a bad value."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in (WAIT_REPLICAS_OPTION, WAIT_TIMEOUT_OPTION)}
    replicas, timeout_ms = ours.get(WAIT_REPLICAS_OPTION, "auto"), ours.get(WAIT_TIMEOUT_OPTION, str(WAIT_TIMEOUT_MS))
    if replicas != "auto" and not (replicas.isdigit() and int(replicas) <= 16):
        raise ValueError(f"registry URL option {WAIT_REPLICAS_OPTION}={replicas!r}: 'auto' or a number of replicas "
                         "from 0 to 16")
    limit = int(SOCKET_TIMEOUT_S * 1000) - 500  # WAIT's answer must come before the socket gives up on it
    if not (timeout_ms.isdigit() and 1 <= int(timeout_ms) <= limit):
        raise ValueError(f"registry URL option {WAIT_TIMEOUT_OPTION}={timeout_ms!r}: milliseconds from 1 to {limit}")
    rest = urlencode([(k, v) for k, v in query if k not in ours])
    return (parts._replace(query=rest).geturl(), None if replicas == "auto" else int(replicas), int(timeout_ms))


class _HeldConnection:
    """A connection pool of one connection that a write holds from its WATCH to its WAIT: a transaction pipeline
    made on it runs on that connection, and WAIT counts the replicas that have the writes of the connection it is
    sent on."""

    def __init__(self, conn):
        self.conn = conn

    def get_connection(self, *args, **kwargs):
        return self.conn

    def release(self, conn):
        pass  # the write gives it back to its real pool when it is done


def _reduce_redis_error(err: BaseException):
    """What pickle makes of a redis-py error by default (its class, args and attributes), less `connection`."""
    state = {k: v for k, v in vars(err).items() if k != "connection"}
    return type(err), err.args, state or None


def picklable_redis_errors() -> None:
    """Makes every redis-py error picklable again (idempotent; in each process that opens a registry). redis-py's
    cluster client stores the node or connection a command failed on in the error it raises (`err.connection`, for
    its metrics), and that object holds locks: the error cannot be pickled. Raised in a backend replica (retrieval,
    engine, encoder) during a failover, Ray then hands the gateway a bare RayError in its place, and the gateway,
    unable to tell the registry was unreachable, answered INTERNAL (seen: a master SIGKILLed under load,
    tests/service/test_kv_tier_service.py). Pickled without that attribute, the error reaches the gateway as what it
    is: UNAVAILABLE with a retry hint (errors.to_api_error)."""
    import copyreg

    from redis.exceptions import RedisClusterException, RedisError

    todo: list[type] = [RedisError, RedisClusterException]
    while todo:  # copyreg is keyed by the exact class: every subclass redis-py defines
        cls = todo.pop()
        copyreg.pickle(cls, _reduce_redis_error)
        todo.extend(cls.__subclasses__())


class RedisRegistry(Registry):
    """Keys, all under `prefix` and then the user's bucket tag T = `{b<N>}` (N = bucket_of(user_id)):
      T:fact/{user_id}/{fact_id}     hash  user_id, text, metadata (JSON), version, created_at, updated_at,
                                           embedding, window (JSON), unservable (reason; empty when servable),
                                           kv_bytes, expires_at ("inf" or absent: never)
      T:history/{user_id}/{fact_id}  list  the fact's earlier versions (FactVersion JSON), oldest first, at most
                                           MAX_HISTORY
      T:user/{user_id}/facts    zset  fact_id -> creation sequence (stable listing order, list_after's cursor)
      T:user/{user_id}/bytes    int   fact_bytes of the user's facts plus their history's bytes (the byte quota)
      T:user/{user_id}/kvbytes  int   kv_bytes of the user's facts (the KV quota)
      T:user/{user_id}/kvtier   zset  fact_id -> last use (a logical clock) of the facts booked in the cluster KV tier
      T:user/{user_id}/kvtierv  hash  fact_id -> "version:bytes" booked there (kv_tier_admit)
      T:user/{user_id}/kvtiersum int  the bytes booked there
      T:user/{user_id}/ver      int   the user's change counter
      T:user/{user_id}/expiry   zset  fact_id -> expires_at, for the user's facts that expire (expired_facts)
      T:user/{user_id}/idem     hash  idempotency key -> the add that used it (IdempotentAdd JSON: fingerprint,
                                      fact ids, expiry), written in the create's transaction
      T:user/{user_id}/idemexp  zset  idempotency key -> its expiry: what a create forgets (the hash's field and
                                      its bytes) once it has passed; a key is never read after it
      T:owners/{fact_id}        set   the users of T's bucket that have a fact of this id (owners_of)
      T:placement/{user_id}     set   engine replica ids
    and per bucket (shared by the bucket's users):
      T:seq         int     the bucket's creation sequence (monotonic per bucket: a cursor is only compared
                            within one user)
      T:tombstones  stream  user, fact, upto, gone: KV to remove from every tier (base.Tombstone), capped at
                            TOMBSTONES_PER_BUCKET entries; tombstones_after reads every bucket's
      T:placed      set     the bucket's users with a non-empty placement
    Ids cannot hold "/" (check_id), so the names are unambiguous; a fact id is the user's own (the fact's key
    names its user): another user's fact of the same id is another fact, and never found for this user.

    owners_of (a fact id -> its users, for a server without authentication, whose Mem0 clients name a memory by
    its id alone) reads T:owners/{fact_id} of every bucket: the owners set is written in the same transaction or
    script as the fact, and on a cluster that is only possible in the owner's slot, which a caller that knows
    only the fact id cannot name. So a lookup reads BUCKETS small keys (the same fan-out as a tombstone poll): a
    fixed cost, whatever the number of facts or users stored.

    The password comes from the URL (`redis://:PASSWORD@host:port/0`) or, when the URL has none, from
    $INFERSCALE_REDIS_PASSWORD or the file $INFERSCALE_REDIS_PASSWORD_FILE names, so a Kubernetes Secret can
    supply it without it appearing in any config.
    A URL naming any node of a Redis Cluster gives a cluster client (redis.cluster.RedisCluster), found out at the
    first call, so that constructing a registry never waits for Redis.
    Writes are acknowledged once replicated (durability_options: the URL's wait_replicas, wait_timeout_ms), and
    run on a connection to their slot's master held from WATCH to WAIT (_on_master).
    """

    def __init__(self, url: str, prefix: str = "inferscale:", index_owners: bool = False):
        """`index_owners`: write each fact's owners set (owners_of), which only a server without authentication
        reads (a Mem0 client names a memory by its id alone there); it costs ~250 bytes of Redis memory a fact
        (bench/results/registry.md), so a server with authentication leaves it out."""
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"a registry key prefix must not contain braces (the hash tag is the bucket's): "
                             f"{prefix!r}")
        self.url, self.prefix, self.index_owners = url, prefix, index_owners
        redis_url, self.seeds = seed_nodes(url)
        self._redis_url, self.wait_replicas, self.wait_timeout_ms = durability_options(redis_url)
        check_tls_options(self._redis_url)
        self._replicas: dict[str, tuple[int, float]] = {}  # master -> (replicas connected, when asked): auto mode
        self.cluster: bool | None = None  # known after the first call
        self._client = None
        self._scripts: dict = {}
        self._connecting = threading.Lock()
        self._tomb_keys = [self._bucket_key(b, "tombstones") for b in range(BUCKETS)]
        self._tomb_bucket = {k.encode(): b for b, k in enumerate(self._tomb_keys)}
        self._bucket_slots: list[int] = []  # a cluster: each bucket's hash slot (its keys share one)
        # tombstones_after's last read to the end: (its cursor, {bucket: (master, its XADD count)}, when)
        self._hint: tuple = ("", {}, 0.0)

    # ------------------------------------------------------------------ the client
    @property
    def r(self):
        """redis.Redis, or redis.cluster.RedisCluster when the URL names a cluster node; made at the first call."""
        if self._client is None:
            with self._connecting:
                if self._client is None:
                    self._client = self._connect()
        return self._client

    def _connect(self):
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        picklable_redis_errors()
        kw = {}
        if urlsplit(self.url).password is None:
            password = os.environ.get(PASSWORD_ENV) or _read_password_file(os.environ.get(PASSWORD_FILE_ENV))
            if password:
                kw["password"] = password
        # Bounded waits: a Redis that is down or a half-open connection fails a call within
        # (1 + RETRIES) * (CONNECT_TIMEOUT_S + 2 * SOCKET_TIMEOUT_S) = 10 s (UNAVAILABLE at the API) instead of
        # blocking a thread, and with it a user's lock, for minutes. The pool reconnects once Redis is back.
        kw.update(decode_responses=False, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=SOCKET_TIMEOUT_S,
                  health_check_interval=15)

        def retry(retries=RETRIES):
            return Retry(ExponentialBackoff(cap=0.5, base=0.05), retries)

        cluster, parts = False, urlsplit(self._redis_url)
        if parts.scheme == "rediss":
            _check_tls_files(parts)
        if parts.scheme != "unix":  # asked of database 0: a cluster node refuses SELECT
            cluster, parts = self._probe(parts, retry(), kw)
        if self.seeds and not cluster:
            raise ValueError(f"registry URL option {SEEDS_OPTION}= names nodes of a Redis Cluster, and "
                             f"{redacted(parts.geturl())!r} is a single Redis")
        if cluster:
            from redis.cluster import ClusterNode, RedisCluster
            from redis.crc import key_slot
            from redis.exceptions import RedisClusterException

            if parts.path not in ("", "/", "/0"):
                raise ValueError(f"a Redis Cluster has only database 0: {redacted(self.url)!r}")
            self._bucket_slots = [key_slot(k.encode()) for k in self._tomb_keys]
            # Reads ride through a failover: redis-py refreshes its slot map on a connection error, MOVED or
            # CLUSTERDOWN and tries again, with backoff 0.1, 0.2, 0.4, 0.8, 1, 1 s. Writes never go through this
            # retry (_on_master): a transaction or script re-sent after its reply was lost could apply twice.
            others = [ClusterNode(h, p) for h, p in self.seeds if (h, p) != (parts.hostname, parts.port or 6379)]
            try:  # connects to the nodes at the addresses they announce (CLUSTER SLOTS), not the URL's host
                client = RedisCluster.from_url(parts._replace(path="").geturl(), retry=Retry(
                    ExponentialBackoff(cap=1.0, base=0.05), CLUSTER_RETRIES), startup_nodes=others or None, **kw)
            except RedisClusterException as e:
                if not tls_failure(e):
                    raise
                raise RegistryTlsError(
                    f"TLS with a node of the registry's Redis Cluster failed: {_tls_reason(e)}; the client connects "
                    "to the addresses the nodes announce (CLUSTER SLOTS): their certificates must name those (or "
                    "ssl_check_hostname=false), and be signed by the CA that ssl_ca_certs= names") from e
        else:
            client = redis.Redis.from_url(self._redis_url, retry=retry(), **kw)
        self._scripts = {"delete_fact": client.register_script(DELETE_FACT),
                         "delete_user": client.register_script(DELETE_USER),
                         "remove_placement": client.register_script(REMOVE_PLACEMENT),
                         "kv_tier_admit": client.register_script(KV_TIER_ADMIT),
                         "kv_tier_touch": client.register_script(KV_TIER_TOUCH)}
        self.cluster = cluster
        return client

    def _probe(self, parts, retry, kw) -> tuple:
        """(whether the node answers as a Redis Cluster node, the URL parts of the node that answered): the URL's
        node, else each seed in turn; none answering raises the URL node's error (RegistryTlsError where it was
        TLS's: _tls_diagnosis)."""
        import redis

        first_error = None
        nodes = [(parts.hostname, parts.port)] + self.seeds
        for host, port in nodes:
            netloc = parts.netloc.rpartition("@")
            node = parts._replace(netloc=f"{netloc[0]}{netloc[1]}{f'[{host}]' if ':' in host else host}:"
                                        f"{port or 6379}") if (host, port) != nodes[0] else parts
            probe = redis.Redis.from_url(node._replace(path="/0").geturl(), retry=retry, **kw)
            try:
                return int(probe.info("cluster").get("cluster_enabled", 0)) == 1, node
            except redis.ResponseError:  # INFO refused (a managed Redis that renames it): no cluster
                return False, node
            except (redis.ConnectionError, redis.TimeoutError) as e:
                first_error = first_error or _tls_diagnosis(node, e) or e
            finally:
                probe.close()
        assert first_error is not None  # every node was tried and none answered
        raise first_error

    def _script(self, name: str, keys, args):
        """A script that is safe to run twice (redis-py re-sends it after a lost reply) and is not waited for: the
        placements, routing hints that an engine replica writes again whenever it syncs a user that changed."""
        self.r  # noqa: B018 - connects (and registers the scripts) on the first call
        return self._scripts[name](keys=keys, args=args)

    def _write_script(self, name: str, keys, args):
        """A script that writes facts: on the master of its keys' slot, sent once, then confirmed (_on_master)."""
        self.r  # noqa: B018 - connects (and registers the scripts) on the first call
        script = self._scripts[name]

        def op(node, conn, sent):
            import redis

            sent.append(True)
            try:
                return _call(node, conn, "EVALSHA", script.sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:  # a master that has not seen it (new after a failover): not run
                return _call(node, conn, "EVAL", script.script, len(keys), *keys, *args)

        return self._on_master(keys[0], op)

    def _delete_fact(self, keys, args):  # a method of its own: tests/unit/test_registry_full.py races it
        return self._write_script("delete_fact", keys, args)

    # ------------------------------------------------------------------ writes: where, how often, how durable
    def _on_master(self, key: str, op):
        """Runs op(node, conn, sent) on a connection `conn` to the master of `key`'s slot (`node`: its redis.Redis),
        held until the write is confirmed; op appends to `sent` before it sends what writes (EXEC, a script), and
        returns its result. Then the write is confirmed on the same connection (_confirm: WAIT).
        A watched key that moved (WatchError) runs op again. A master that cannot be reached, refuses the write for
        the topology (MOVED, READONLY, CLUSTERDOWN, TRYAGAIN: nothing of it was applied) or drops the connection
        before the write was sent: the slot map is refreshed and op runs again, for up to WRITE_RIDE_THROUGH_S
        (a cluster's failover), then the error is raised (UNAVAILABLE at the API). A reply lost after the write was
        sent (the master died or stalled): UnconfirmedWriteError, never a second send, which could apply it twice
        (redis-py's own retry would: its cluster transaction re-sends MULTI..EXEC on a new connection, unwatched)."""
        import redis

        deadline, pause = time.monotonic() + WRITE_RIDE_THROUGH_S, 0.05
        while True:
            node = self._master_client(key)
            sent: list = []
            conn = None
            try:
                # Inside the try: a master that refuses the connection (killed, its replica not yet promoted) has
                # been sent nothing, so it is retried like a refusal for the topology, not raised at once.
                conn = node.connection_pool.get_connection()
                out = op(node, conn, sent)
                if sent:
                    self._confirm(node, conn)
                return out
            except redis.WatchError as e:
                lost = e.__context__  # redis-py turns a connection lost while watching into a WatchError
                if not isinstance(lost, (redis.ConnectionError, redis.TimeoutError)):
                    continue  # a watched key moved: read again
                assert conn is not None  # a WatchError comes from a watch on it
                conn.disconnect()
                if sent:
                    raise _unconfirmed(node, lost) from lost
                err = lost
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if conn is not None:  # else the pool could not make one: it has dropped it already
                    conn.disconnect()
                if sent:
                    raise _unconfirmed(node, e) from e
                err = e
            except _refused_for_topology() as e:  # refused whole: a MULTI is aborted, a script stops at its first write
                err = e
            finally:
                if conn is not None:
                    node.connection_pool.release(conn)
            if time.monotonic() + pause > deadline:
                raise err
            time.sleep(pause)
            pause = min(2 * pause, 0.5)
            self._refresh_topology()

    def _master_client(self, key: str):
        """redis.Redis of the master that serves `key`'s slot (as far as the client's slot map knows)."""
        r = self.r
        if not self.cluster:
            return r
        return r.get_redis_connection(r.nodes_manager.get_node_from_slot(r.keyslot(key)))

    def _refresh_topology(self) -> None:
        if not self.cluster:
            return
        from redis.exceptions import RedisClusterException, RedisError

        try:
            self.r.nodes_manager.initialize()  # redis-py's slot map from the nodes that answer (one at a time)
        except (RedisError, RedisClusterException):
            pass  # none answers yet: the next try asks again

    def _confirm(self, node, conn) -> None:
        """WAIT on the write's own connection until the replicas asked for have it (its master's replication
        offset as of the write), at most wait_timeout_ms; fewer: UnconfirmedWriteError."""
        want = self._replicas_wanted(node)
        if want == 0:
            return
        got = int(_call(node, conn, "WAIT", want, self.wait_timeout_ms))
        if got < want:
            raise UnconfirmedWriteError(
                f"the registry's Redis master {_node_name(node)} applied the write but {got} of the {want} replicas "
                f"asked for confirmed it within {self.wait_timeout_ms} ms; it may be lost if that master fails now")

    def _replicas_wanted(self, node) -> int:
        """How many replicas a write on this master waits for: the URL's wait_replicas, or (auto) 1 when the master
        has a replica, else 0 (asked at most every REPLICAS_RECHECK_S). On a cluster a replica counts until the
        cluster has marked it failed (CLUSTER NODES), its replication link down or not: a replica cut off from its
        master is the one that would take over without the writes it missed, so those writes must be refused. On
        one Redis only the replicas connected now count (ROLE: it knows no others)."""
        if self.wait_replicas is not None:
            return self.wait_replicas
        name = _node_name(node)
        known = self._replicas.get(name)
        if known is None or time.monotonic() - known[1] > REPLICAS_RECHECK_S:
            if self.cluster:
                nodes = node.execute_command("CLUSTER NODES").values()  # parsed by redis-py: one dict per node
                me = next((n for n in nodes if "myself" in n["flags"].split(",")), {"node_id": None})
                count = sum(n["master_id"] == me["node_id"] and "fail" not in n["flags"].split(",") for n in nodes)
            else:
                role = node.execute_command("ROLE")  # [b"master", offset, [[host, port, offset], ...]]
                count = len(role[2]) if role[0] == b"master" else 0
            known = (count, time.monotonic())
            self._replicas[name] = known
        return min(1, known[0])

    # ------------------------------------------------------------------ keys
    def _bucket_key(self, bucket: int, name: str) -> str:
        return f"{self.prefix}{{b{bucket}}}:{name}"

    def _key(self, user_id: str, name: str) -> str:
        return self._bucket_key(bucket_of(user_id), name)

    def _user_key(self, user_id: str, kind: str) -> str:
        """kind: facts, bytes, kvbytes, ver"""
        return self._key(user_id, f"user/{user_id}/{kind}")

    def _fact_key(self, user_id: str, fact_id: str) -> str:
        return self._key(user_id, f"fact/{user_id}/{fact_id}")

    def _history_key(self, user_id: str, fact_id: str) -> str:
        return self._key(user_id, f"history/{user_id}/{fact_id}")

    def _owners_key(self, user_id: str, fact_id: str) -> str:
        """In the user's bucket, named by the fact id alone: owners_of reads it in every bucket."""
        return self._key(user_id, f"owners/{fact_id}")

    def _placement_key(self, user_id: str) -> str:
        return self._key(user_id, f"placement/{user_id}")

    def user_keys(self, user_id: str, fact_ids=()) -> list[str]:
        """Every key the registry may write for the user and these facts (one hash slot; what the tests check)."""
        return [*(self._user_key(user_id, k) for k in ("facts", "bytes", "kvbytes", "ver", "expiry", "idem",
                                                       "idemexp", *KV_TIER_KINDS)),
                self._placement_key(user_id), *(self._key(user_id, n) for n in ("seq", "tombstones", "placed")),
                *(k for f in fact_ids for k in (self._fact_key(user_id, f), self._history_key(user_id, f),
                                                self._owners_key(user_id, f)))]

    # ------------------------------------------------------------------ records
    def _record(self, fact_id: str, h: dict) -> FactRecord:
        emb = h.get(b"embedding")
        return FactRecord(
            fact_id=fact_id, user_id=h[b"user_id"].decode(), text=h[b"text"].decode(),
            metadata=json.loads(h[b"metadata"]), version=int(h[b"version"]),
            created_at=float(h[b"created_at"]), updated_at=float(h[b"updated_at"]),
            embedding=np.frombuffer(emb, dtype=np.float32).copy() if emb else None,
            window=tuple(json.loads(h.get(b"window", b"[]"))),
            unservable_reason=h.get(b"unservable", b"").decode(), kv_bytes=int(h.get(b"kv_bytes", 0)),
            expires_at=float(h.get(b"expires_at", b"inf")))

    @staticmethod
    def _mapping(rec: FactRecord) -> dict:
        return {"user_id": rec.user_id, "text": rec.text, "metadata": json.dumps(rec.metadata),
                "version": rec.version, "created_at": repr(rec.created_at), "updated_at": repr(rec.updated_at),
                "embedding": rec.embedding.astype(np.float32).tobytes() if rec.embedding is not None else b"",
                "window": json.dumps(list(rec.window)), "unservable": rec.unservable_reason, "kv_bytes": rec.kv_bytes,
                "expires_at": repr(rec.expires_at)}

    def _owned(self, user_id: str, fact_id: str, h: dict) -> FactRecord:
        if not h or h[b"user_id"].decode() != user_id:
            raise UnknownFactError(user_id, fact_id)
        return self._record(fact_id, h)

    def _tomb(self, pipe, t: Tombstone) -> None:
        """Queues the tombstone in the transaction `pipe` (after pipe.multi()), in the user's bucket's stream."""
        pipe.xadd(self._key(t.user_id, "tombstones"),
                  {"user": t.user_id, "fact": t.fact_id, "upto": t.upto, "gone": int(t.gone)},
                  maxlen=TOMBSTONES_PER_BUCKET, approximate=True)

    def _transaction(self, keys: list[str], body):
        """Runs body(pipe) under WATCH keys until no watched key moved in between; returns its result.
        body reads through `pipe` (immediate mode), then calls pipe.multi() and queues its writes. The keys and
        everything body touches are one user's: one hash slot, one master (_on_master: where it runs, how it is
        retried and confirmed)."""
        from redis.client import Pipeline

        def op(node, conn, sent):
            with Pipeline(_HeldConnection(conn), node.response_callbacks, transaction=True, shard_hint=None) as pipe:
                pipe.watch(*keys)
                out = body(pipe)
                if len(pipe):  # writes queued after multi()
                    sent.append(True)
                    pipe.execute()
                else:
                    pipe.unwatch()
                return out

        return self._on_master(keys[0], op)

    def _bucket_nodes(self) -> list:
        """The master that holds each bucket's slot (a cluster; from redis-py's slot map), or [None] * BUCKETS."""
        r = self.r
        if not self.cluster:
            return [None] * BUCKETS
        cache = r.nodes_manager.slots_cache  # slot -> [primary, replicas...]: read directly, get_node_from_slot is
        return [cache[slot][0] if cache.get(slot) else r.nodes_manager.get_node_from_slot(slot)  # slow (~5 us)
                for slot in self._bucket_slots]

    def _per_bucket(self, name: str, queue, buckets=None) -> dict:
        """queue(pipe, key) queues one read of a bucket's key `name`, for each of `buckets` (None: all); returns
        bucket -> answer. One pipeline on a single Redis. On a cluster one plain pipeline per master with its
        buckets, sent by hand: redis-py's cluster pipeline spends about 0.15 ms of Python on each command, too much
        for BUCKETS of them. A topology change meanwhile (MOVED, a master gone) falls back to the cluster
        pipeline, which follows it."""
        import redis
        from redis.exceptions import RedisClusterException

        buckets = range(BUCKETS) if buckets is None else list(buckets)
        r = self.r
        out: dict = {}
        if self.cluster:
            try:
                nodes = self._bucket_nodes()
                groups: dict[str, tuple] = {}  # node name -> (node, its buckets)
                for b in buckets:
                    groups.setdefault(nodes[b].name, (nodes[b], []))[1].append(b)
                for node, group in groups.values():
                    with r.get_redis_connection(node).pipeline(transaction=False) as pipe:
                        for b in group:
                            queue(pipe, self._bucket_key(b, name))
                        out.update(zip(group, pipe.execute()))
                return out
            except (redis.ResponseError, redis.ConnectionError, redis.TimeoutError, RedisClusterException):
                out = {}  # the cluster pipeline below follows redirections and refreshes the slot map
        with r.pipeline(transaction=False) as pipe:
            for b in buckets:
                queue(pipe, self._bucket_key(b, name))
            out.update(zip(buckets, pipe.execute()))
        return out

    def _xadd_calls(self) -> dict:
        """node name -> (its run id, how many XADDs it has run: INFO commandstats, in scripts and MULTI too): the
        same pair after a read of its buckets' streams means no tombstone was added there since (the run id
        changes when the node restarts and its counts start again). {} when INFO is refused."""
        import redis

        def ask(client) -> tuple:
            with client.pipeline(transaction=False) as pipe:
                pipe.info("server")
                pipe.info("commandstats")
                server, stats = pipe.execute()
            return server.get("run_id"), stats.get("cmdstat_xadd", {}).get("calls", 0)

        r = self.r
        try:
            if not self.cluster:
                return {None: ask(r)}
            return {node.name: ask(r.get_redis_connection(node)) for node in r.get_primaries()}
        except redis.ResponseError:
            return {}

    def _hgetall_many(self, user_id: str, fact_ids: list[str]) -> list[dict]:
        with self.r.pipeline(transaction=False) as pipe:
            for f in fact_ids:
                pipe.hgetall(self._fact_key(user_id, f))
            return pipe.execute()

    # ------------------------------------------------------------------ facts
    def create(self, user_id, facts, quota=None, idempotent=None):
        now = time.time()
        recs = self._new_records(user_id, facts, now)
        if not recs:
            return []
        kept = self._kept_add(idempotent, recs, now)
        keys = [self._fact_key(user_id, r.fact_id) for r in recs]
        facts_key, bytes_key = self._user_key(user_id, "facts"), self._user_key(user_id, "bytes")
        kv_key = self._user_key(user_id, "kvbytes")
        idem_key, idem_exp_key = self._user_key(user_id, "idem"), self._user_key(user_id, "idemexp")
        added, added_kv = sum(fact_bytes(r) for r in recs), sum(r.kv_bytes for r in recs)

        def body(pipe):
            earlier = None
            if kept is not None:  # a repeat writes nothing, not even a creation sequence number
                raw = pipe.hget(idem_key, kept.key)
                earlier = None if raw is None else IdempotentAdd.from_json(kept.key, raw)
                if earlier is not None and earlier.expires_at > now:
                    raise IdempotentRepeatError(earlier)
            # Creation sequence numbers first (the bucket's; gaps are harmless), on the transaction's connection so
            # that its WAIT covers them too, then facts + listing + counters in one MULTI.
            first = int(pipe.incrby(self._key(user_id, "seq"), len(recs))) - len(recs) + 1
            taken = [r.fact_id for r, k in zip(recs, keys) if pipe.exists(k)]  # never overwrite a fact
            if taken:
                raise DuplicateFactError(f"fact id {taken[0]!r} already exists")
            # The user's expired idempotency keys leave with this write (a bounded number, oldest first; the one this
            # write reuses among them), their bytes with them.
            expired = {k.decode() for k in pipe.zrangebyscore(idem_exp_key, "-inf", repr(now), start=0,
                                                              num=IDEMPOTENCY_PURGE_PER_CREATE)}
            if earlier is not None:
                expired.add(earlier.key)
            expired_list = sorted(expired)
            values = pipe.hmget(idem_key, expired_list) if expired_list else []
            freed = sum(IdempotentAdd.from_json(k, v).stored_bytes() for k, v in zip(expired_list, values) if v)
            grown = added - freed + (kept.stored_bytes() if kept is not None else 0)
            check_quota(quota, user_id, int(pipe.zcard(facts_key)), int(pipe.get(bytes_key) or 0), len(recs), grown,
                        int(pipe.get(kv_key) or 0), added_kv)
            pipe.multi()
            for r, k in zip(recs, keys):
                pipe.hset(k, mapping=self._mapping(r))
                if self.index_owners:
                    pipe.sadd(self._owners_key(user_id, r.fact_id), user_id)
            pipe.zadd(facts_key, {r.fact_id: first + i for i, r in enumerate(recs)})
            expiring = {r.fact_id: r.expires_at for r in recs if r.expires_at != math.inf}
            if expiring:
                pipe.zadd(self._user_key(user_id, "expiry"), expiring)
            if expired_list:
                pipe.hdel(idem_key, *expired_list)
                pipe.zrem(idem_exp_key, *expired_list)
            if kept is not None:
                pipe.hset(idem_key, kept.key, kept.to_json())
                pipe.zadd(idem_exp_key, {kept.key: kept.expires_at})
            pipe.incrby(bytes_key, grown)
            pipe.incrby(kv_key, added_kv)
            pipe.incr(self._user_key(user_id, "ver"))

        self._transaction([*keys, facts_key, bytes_key, kv_key, idem_key, idem_exp_key], body)
        return recs

    def idempotent_add(self, user_id, key, now=None, answering=None):
        check_id("user_id", user_id)
        now = time.time() if now is None else now
        idem_key = self._user_key(user_id, "idem")

        def held(raw) -> IdempotentAdd | None:
            earlier = None if raw is None else IdempotentAdd.from_json(key, raw)
            return earlier if earlier is not None and earlier.expires_at > now else None

        earlier = held(self.r.hget(idem_key, key))  # one read, as for every first add sent with a key
        if answering is None or earlier is None or earlier.answered or earlier.fingerprint != answering:
            return earlier

        def body(pipe):  # read again under WATCH: a release racing the mark sees it, or happened before it
            earlier = held(pipe.hget(idem_key, key))
            if earlier is None or earlier.answered or earlier.fingerprint != answering:
                return earlier
            earlier = replace(earlier, answered=True)
            pipe.multi()
            pipe.hset(idem_key, key, earlier.to_json())  # the same stored_bytes: no counter moves
            return earlier

        return self._transaction([idem_key], body)

    def release_idempotency_key(self, user_id, key):
        check_id("user_id", user_id)
        idem_key, bytes_key = self._user_key(user_id, "idem"), self._user_key(user_id, "bytes")

        def body(pipe):
            raw = pipe.hget(idem_key, key)
            if raw is None:
                return True
            earlier = IdempotentAdd.from_json(key, raw)
            if earlier.answered:
                return False
            pipe.multi()
            pipe.hdel(idem_key, key)
            pipe.zrem(self._user_key(user_id, "idemexp"), key)
            pipe.decrby(bytes_key, earlier.stored_bytes())
            return True

        return self._transaction([idem_key, bytes_key], body)

    def get(self, user_id, fact_id):
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        return self._owned(user_id, fact_id, self.r.hgetall(self._fact_key(user_id, fact_id)))

    def get_many(self, user_id, fact_ids):
        check_id("user_id", user_id)
        for f in fact_ids:
            check_id("fact_id", f)
        rows = self._hgetall_many(user_id, fact_ids) if fact_ids else []
        return [self._owned(user_id, f, h) for f, h in zip(fact_ids, rows)]

    def find_many(self, user_id, fact_ids):
        check_id("user_id", user_id)
        for f in fact_ids:
            check_id("fact_id", f)
        if not fact_ids:
            return {}
        rows = self._hgetall_many(user_id, fact_ids)
        return {f: self._record(f, h) for f, h in zip(fact_ids, rows) if h and h[b"user_id"].decode() == user_id}

    def list(self, user_id, offset=0, limit=None):
        check_id("user_id", user_id)
        if offset < 0 or (limit is not None and limit < 1):
            raise ValueError(f"bad page: offset={offset}, limit={limit}")
        end = -1 if limit is None else offset + limit  # one extra to know whether more follow
        ids = [x.decode() for x in self.r.zrange(self._user_key(user_id, "facts"), offset, end)]
        more = limit is not None and len(ids) > limit
        ids = ids[:limit] if limit is not None else ids
        recs = self.get_many(user_id, ids) if ids else []
        return recs, (offset + len(ids) if more else None)

    def list_after(self, user_id, after, limit):
        check_id("user_id", user_id)
        if after < 0 or limit < 1:
            raise ValueError(f"bad page: after={after}, limit={limit}")
        # One extra to know whether more follow; the score is the creation sequence (exclusive lower bound).
        rows = self.r.zrangebyscore(self._user_key(user_id, "facts"), f"({after}", "+inf", start=0, num=limit + 1,
                                    withscores=True)
        more, rows = len(rows) > limit, rows[:limit]
        found = self.find_many(user_id, [f.decode() for f, _ in rows])  # one deleted in between is left out
        page = [(int(s), found[f.decode()]) for f, s in rows if f.decode() in found]
        return page, (int(rows[-1][1]) if more else None)

    def seq_of(self, user_id, fact_id):
        check_id("user_id", user_id)
        seq = self.r.zscore(self._user_key(user_id, "facts"), check_id("fact_id", fact_id))
        return None if seq is None else int(seq)

    def count(self, user_id):
        check_id("user_id", user_id)
        return int(self.r.zcard(self._user_key(user_id, "facts")))

    def latest(self, user_id, n):
        check_id("user_id", user_id)
        if n <= 0:
            return []
        ids = [x.decode() for x in self.r.zrange(self._user_key(user_id, "facts"), -n, -1)]
        found = self.find_many(user_id, ids)  # one deleted in between is left out
        return [found[f] for f in ids if f in found]

    def user_bytes(self, user_id):
        check_id("user_id", user_id)
        return int(self.r.get(self._user_key(user_id, "bytes")) or 0)

    def user_kv_bytes(self, user_id):
        check_id("user_id", user_id)
        return int(self.r.get(self._user_key(user_id, "kvbytes")) or 0)

    def kv_tier_admit(self, user_id, items, cap):
        items = self._checked_admit(user_id, items, cap)
        keys = [self._user_key(user_id, k) for k in KV_TIER_KINDS]
        args = [cap, *(x for item in items for x in item)]
        return [v.decode() for v in self._write_script("kv_tier_admit", keys, args)]

    def kv_tier_touch(self, user_id, fact_ids):
        """A hint for the order of eviction: safe to run twice, not waited for (as the placements)."""
        check_id("user_id", user_id)
        if fact_ids:
            self._script("kv_tier_touch", [self._user_key(user_id, "kvtier")], list(fact_ids))

    def kv_tier_bytes(self, user_id):
        check_id("user_id", user_id)
        return int(self.r.get(self._user_key(user_id, "kvtiersum")) or 0)

    def tombstones_after(self, cursor, limit=1000):
        """Every bucket's stream from the cursor's last id of that bucket: on one Redis one XREAD over the BUCKETS
        streams; on a cluster one XRANGE per bucket, one pipeline per master. Oldest first within a bucket (so
        within a user); across buckets by entry id, which is only roughly the order of writing (each master's
        clock), and nothing needs more.
        A poll that finds nothing is cheap: a master whose run id and XADD count (INFO server and commandstats,
        read before the streams) have not moved since a call that read everything up to this very cursor is
        skipped, its buckets unread (any XADD on it moves the count; a bucket that moved to another master is
        read again). Every TOMBSTONES_FULL_READ_S every bucket is read anyway (a CONFIG RESETSTAT then as many
        XADDs would look unmoved: that long at most)."""
        if limit < 1:
            raise ValueError(f"bad limit: {limit}")
        calls = self._xadd_calls()
        nodes = self._bucket_nodes()
        seen = {b: (None if nodes[b] is None else nodes[b].name) for b in range(BUCKETS)}
        seen = {b: (node, calls[node]) for b, node in seen.items() if node in calls}  # b -> (master, (run, XADDs))
        if cursor is None:
            lasts = self._per_bucket("tombstones", lambda pipe, k: pipe.xrevrange(k, count=1))
            cursor = encode_cursor({b: rows[0][0].decode() for b, rows in lasts.items() if rows})
            self._hint = (cursor, seen, time.monotonic())
            return [], cursor
        last = decode_cursor(cursor)
        hint_cursor, hint, since = self._hint
        if hint_cursor != cursor or time.monotonic() - since > TOMBSTONES_FULL_READ_S:
            hint, since = {}, time.monotonic()
        unread = [b for b in range(BUCKETS) if b not in seen or hint.get(b) != seen[b]]
        n = min(limit, TOMBSTONES_READ_PER_BUCKET)
        r = self.r
        if not unread:
            reads = []
        elif self.cluster:
            starts = {b: _next_id(last.get(b, "0-0")) for b in unread}  # XRANGE's start is inclusive
            keys = {self._bucket_key(b, "tombstones"): b for b in unread}
            reads = self._per_bucket("tombstones", lambda pipe, k: pipe.xrange(k, starts[keys[k]], count=n),
                                     unread).items()
        else:
            read = _streams(r.xread({self._tomb_keys[b]: last.get(b, "0-0") for b in unread}, count=n))
            reads = [(self._tomb_bucket[key], entries) for key, entries in read]
        reads = [(b, entries) for b, entries in reads if entries]
        rows = sorted(((_entry_order(eid), b, eid, f) for b, entries in reads for eid, f in entries),
                      key=lambda x: (x[0], x[1]))
        everything = len(rows) <= limit and all(len(entries) < n for _, entries in reads)
        rows = rows[:limit]
        out = []
        for _, b, eid, f in rows:
            out.append(Tombstone(f[b"user"].decode(), f[b"fact"].decode(), int(f[b"upto"]), f[b"gone"] == b"1"))
            last[b] = eid.decode()
        new_cursor = encode_cursor(last) if rows else cursor
        # Read to the end of every bucket (as of `calls`): the next call from new_cursor may skip unmoved masters.
        self._hint = (new_cursor, seen, since) if everything else ("", {}, 0.0)
        return out, new_cursor

    def tombstones_missed(self, cursor):
        """A bucket's stream is trimmed (XADD MAXLEN ~) only once it holds TOMBSTONES_PER_BUCKET entries, so a
        bucket that holds fewer lost nothing; one that holds as many may have, when its oldest entry is newer than
        what follows the cursor's last id there. (Conservative: the entry that follows may happen to be the oldest
        kept.) Two reads of every bucket: for a replica's start, not its polls."""
        last = decode_cursor(cursor)
        lengths = self._per_bucket("tombstones", lambda pipe, k: pipe.xlen(k))
        full = [b for b, n in lengths.items() if n >= TOMBSTONES_PER_BUCKET]
        if not full:
            return False
        oldest = self._per_bucket("tombstones", lambda pipe, k: pipe.xrange(k, count=1), full)
        return any(rows and _entry_order(rows[0][0]) > _entry_order(_next_id(last.get(b, "0-0")).encode())
                   for b, rows in oldest.items())

    def fact_versions(self, user_id):
        check_id("user_id", user_id)
        ids = [x.decode() for x in self.r.zrange(self._user_key(user_id, "facts"), 0, -1)]
        with self.r.pipeline(transaction=False) as pipe:
            for f in ids:
                pipe.hget(self._fact_key(user_id, f), "version")
            vers = pipe.execute()
        return {f: int(v) for f, v in zip(ids, vers) if v is not None}

    def update(self, user_id, fact_id, text=None, metadata=None, replace_metadata=False, embedding=None,
               expected_version=0, quota=None, window=None, kv_bytes=None, expires_at=None):
        # A full Redis refuses the whole MULTI (redis-py's OutOfMemoryError; UNAVAILABLE REGISTRY_FULL at the API),
        # nothing of it written: an update may grow memory, so it waits for deletes to free space.
        emb = self._checked_update(user_id, fact_id, text, metadata, embedding, window, expires_at)
        key, bytes_key = self._fact_key(user_id, fact_id), self._user_key(user_id, "bytes")
        hist_key = self._history_key(user_id, fact_id)
        kv_key = self._user_key(user_id, "kvbytes")

        def body(pipe):
            cur = self._owned(user_id, fact_id, pipe.hgetall(key))
            if expected_version and cur.version != expected_version:
                raise VersionConflictError(fact_id, expected_version, cur.version)
            new = self._updated(cur, text, metadata, replace_metadata, emb, window, kv_bytes, expires_at)
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
            if new.expires_at != cur.expires_at:
                if new.expires_at == math.inf:
                    pipe.zrem(self._user_key(user_id, "expiry"), fact_id)
                else:
                    pipe.zadd(self._user_key(user_id, "expiry"), {fact_id: new.expires_at})
            if old is not None:
                pipe.rpush(hist_key, old)
                pipe.ltrim(hist_key, -MAX_HISTORY, -1)
            pipe.incrby(bytes_key, grown)
            pipe.incrby(kv_key, grown_kv)
            self._tomb(pipe, Tombstone(user_id, fact_id, cur.version))
            pipe.incr(self._user_key(user_id, "ver"))
            return new

        return self._transaction([key, bytes_key, hist_key, kv_key], body)

    def history(self, user_id, fact_id):
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        with self.r.pipeline(transaction=False) as pipe:
            pipe.hget(self._fact_key(user_id, fact_id), "user_id")
            pipe.lrange(self._history_key(user_id, fact_id), 0, -1)
            owner, rows = pipe.execute()
        if owner is None or owner.decode() != user_id:
            raise UnknownFactError(user_id, fact_id)
        return [FactVersion.from_json(v) for v in rows]

    def expired_facts(self, user_id, now):
        check_id("user_id", user_id)
        return [f.decode() for f in self.r.zrangebyscore(self._user_key(user_id, "expiry"), "-inf", repr(float(now)))]

    def owners_of(self, fact_id):
        """Every bucket's owners set of the fact id (see the class's docstring): on one Redis one SUNION of them
        (about 5 ms); on a cluster, where one command may not span slots, BUCKETS reads, one pipeline per master
        (about 50 ms of redis-py's Python: a cost for a server without authentication, a local demo)."""
        check_id("fact_id", fact_id)
        name = f"owners/{fact_id}"
        r = self.r  # connects at the first call: self.cluster is known after it
        if not self.cluster:
            members = r.sunion([self._bucket_key(b, name) for b in range(BUCKETS)])
        else:
            members = set().union(*self._per_bucket(name, lambda pipe, k: pipe.smembers(k)).values())
        return sorted(u.decode() for u in members)

    def _set_field(self, user_id, fact_id, version, field_name, value) -> bool:
        key = self._fact_key(user_id, fact_id)

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
        key, hist_key = self._fact_key(user_id, fact_id), self._history_key(user_id, fact_id)
        facts_key = self._user_key(user_id, "facts")
        keys = [key, hist_key, facts_key, self._user_key(user_id, "bytes"), self._user_key(user_id, "kvbytes"),
                self._key(user_id, "tombstones"), self._user_key(user_id, "ver"), self._owners_key(user_id, fact_id),
                self._user_key(user_id, "expiry"), *(self._user_key(user_id, k) for k in KV_TIER_KINDS)]
        while True:
            with self.r.pipeline(transaction=False) as pipe:
                pipe.hgetall(key)
                pipe.lrange(hist_key, 0, -1)
                pipe.zscore(facts_key, fact_id)
                h, kept, seq = pipe.execute()
            rec = self._owned(user_id, fact_id, h)
            args = [user_id, fact_id, rec.version, -1 if seq is None else int(seq),
                    fact_bytes(rec) + sum(len(v) for v in kept), rec.kv_bytes, TOMBSTONES_PER_BUCKET]
            if self._delete_fact(keys=keys, args=args):
                return rec

    def delete_user(self, user_id):
        """A Lua script (DELETE_USER, see DELETE_FACT): works on a full Redis too."""
        check_id("user_id", user_id)
        keys = [self._user_key(user_id, "facts"), self._user_key(user_id, "bytes"),
                self._user_key(user_id, "kvbytes"), self._placement_key(user_id), self._key(user_id, "placed"),
                self._key(user_id, "tombstones"),
                self._user_key(user_id, "ver"),  # ver kept: replicas must still see the change
                self._user_key(user_id, "expiry"), self._user_key(user_id, "idem"),
                self._user_key(user_id, "idemexp"), *(self._user_key(user_id, k) for k in KV_TIER_KINDS)]
        return int(self._write_script("delete_user", keys, [user_id, self._fact_key(user_id, ""),
                                                            self._history_key(user_id, ""), TOMBSTONES_PER_BUCKET,
                                                            self._owners_key(user_id, "")]))

    def user_version(self, user_id):
        check_id("user_id", user_id)
        v = self.r.get(self._user_key(user_id, "ver"))
        return int(v) if v is not None else 0

    def user_versions(self, user_ids):
        for u in user_ids:
            check_id("user_id", u)
        if not user_ids:
            return []
        keys = [self._user_key(u, "ver") for u in user_ids]
        r = self.r  # on a cluster the users' keys are in many slots: one MGET per slot, pipelined per master
        vers = r.mget_nonatomic(keys) if self.cluster else r.mget(keys)
        return [int(v) if v is not None else 0 for v in vers]

    # ------------------------------------------------------------------ placements
    def add_placement(self, user_id, replica_id):
        check_id("user_id", user_id)
        with self.r.pipeline(transaction=True) as pipe:
            pipe.sadd(self._placement_key(user_id), replica_id)
            pipe.sadd(self._key(user_id, "placed"), user_id)
            pipe.execute()

    def remove_placement(self, user_id, replica_id):
        check_id("user_id", user_id)
        self._script("remove_placement", [self._placement_key(user_id), self._key(user_id, "placed")],
                     [replica_id, user_id])

    def placement(self, user_id):
        check_id("user_id", user_id)
        return {x.decode() for x in self.r.smembers(self._placement_key(user_id))}

    def placements(self):
        """Every bucket's placed users, then their placements: two pipelined reads."""
        placed = self._per_bucket("placed", lambda pipe, k: pipe.smembers(k))
        users = sorted({u.decode() for members in placed.values() for u in members})
        if not users:
            return {}
        with self.r.pipeline(transaction=False) as pipe:
            for u in users:
                pipe.smembers(self._placement_key(u))
            sets = pipe.execute()
        return {u: {x.decode() for x in s} for u, s in zip(users, sets) if s}

    # ------------------------------------------------------------------ the server
    def ping(self):
        self.r.ping()

    def is_full(self):
        """Within FULL_WITHIN_BYTES of maxmemory (0: no limit, never full); on a cluster, any master."""
        r = self.r
        if self.cluster:
            from redis.cluster import RedisCluster

            got = r.info("memory", target_nodes=RedisCluster.PRIMARIES)
            infos = [got] if "used_memory" in got else list(got.values())
        else:
            infos = [r.info("memory")]
        return any(_full(m) for m in infos)

    def close(self):
        if self._client is not None:
            self._client.close()


def _full(m: dict) -> bool:
    limit = int(m.get("maxmemory", 0))
    # What Redis compares with maxmemory before a write: used memory less its replicas' and AOF buffers.
    used = int(m["used_memory"]) - int(m.get("mem_not_counted_for_evict", 0))
    return limit > 0 and used >= limit - FULL_WITHIN_BYTES


def _streams(read) -> list:
    """XREAD's answer as [(key, entries)] (RESP2 gives a list of pairs, RESP3 a dict); none: []."""
    if not read:
        return []
    return list(read.items()) if isinstance(read, dict) else [(k, e) for k, e in read]


def _call(node, conn, *args):
    """One command on a held connection, answered (parsed as `node` parses it); no retry."""
    conn.send_command(*args)
    return node.parse_response(conn, args[0])


def _node_name(node) -> str:
    kw = node.connection_pool.connection_kwargs
    return f"{kw.get('host')}:{kw.get('port')}" if "host" in kw else str(kw.get("path", "?"))


def _unconfirmed(node, err: BaseException) -> UnconfirmedWriteError:
    return UnconfirmedWriteError(f"the registry's Redis master {_node_name(node)} did not answer a write that was "
                                 f"sent ({type(err).__name__}): it may or may not have been applied")


def _refused_for_topology() -> tuple:
    from redis.exceptions import AskError, ClusterDownError, ReadOnlyError, TryAgainError

    return (AskError, ClusterDownError, ReadOnlyError, TryAgainError)  # MovedError and MasterDownError included
