"""The cluster KV tier: encoded facts in Mooncake Store, readable by every engine replica of every node.

One immutable object per fact version. Its key is `isf/{fingerprint}/{user hash}/{fact hash}@v{version}`:
  - `fingerprint` (`kv_fingerprint`) names the model (its config and weight files), the dtype the KV is stored
    in and the encoding rule (the instruction prefix facts are encoded behind), so a release with another
    model, dtype or prefix never reads this one's KV: its keys differ, a read is a miss;
  - the version comes from the registry, so a later write of an older version never replaces a newer one
    (another key), and a reader asks for exactly the version the registry names.
The value is self-describing: a JSON header (the key's parts, dtype, shape) followed by the raw bytes of the
token ids, pre-RoPE keys and values (`pack` / `unpack`). A value whose header does not match the key asked
for is a miss, never KV for other text.

Reads and writes are zero-copy on Mooncake's side, through host memory of ours registered with the client once
and reused (`RegisteredBuffer`). A write packs each object once, straight from the fact's tensors, into the write
buffer, and `batch_put_from` sends it from there (`put_batch` took a Python bytes object per fact, built by three
copies and a join, and staged every batch once more in the client's transfer buffer). A read asks the master for the
objects' byte sizes (`batch_get_replica_desc`: the master keeps each object's size with it, so one call sizes a read
without knowing the fact's token count or stored dtype), and `batch_get_into` lands them in the read buffer (pinned
when the reader copies them to a CUDA device). The tensors unpacked from it are views that the caller's `keep`
copies where it keeps them (one copy in all; `get_batch` copied each object into a Python bytes object first).

Every call fails soft: Mooncake down, slow or full is a miss (counted and logged), never an exception; the
caller then computes or re-encodes. Removes of objects whose read lease still runs (Mooncake refuses them with
-706) are repeated once the lease is over.

Mooncake objects live in the memory segments that clients contribute (`segment_bytes`): an engine pod's
segment, or a standalone `mooncake_client` (what the chart and the tests run). The master evicts objects when
the segments are full (its eviction watermark): an evicted fact is a miss, re-encoded once. Each object is
written `replicas` times, to different segments, so losing one node's segment loses no fact.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import struct
import threading
import time
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch

from .types import EncodedFact

# Mooncake's metadata mode without a metadata server: clients exchange segment descriptors in a handshake.
P2P_METADATA = "P2PHANDSHAKE"

log = logging.getLogger("inferscale.cluster_store")
FORMAT = "inferscale-kv-v1"
MAGIC = b"ISKV1\n"
KEY_ROOT = "isf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_LEASE_REFUSED = -706  # Mooncake: OBJECT_HAS_LEASE (a read's lease still runs)
_LEASE_EXPIRED = -707  # Mooncake: LEASE_EXPIRED (a read's transfer ended after its lease; measured)
# What each of our registered buffers (the write buffer, the read buffer) may take, as a share of the client's
# `buffer_bytes`: one round of objects at most, so no object larger is written. Both bounds are the same number: an
# object the writer stores always fits a reader's buffer. (3/4 comes from put_batch, which staged a batch in the
# client's transfer buffer, whose allocator needs room of its own: 63.5 MiB failed in 64 MiB, measured here; kept so
# that `buffer_bytes` still means what it meant for the largest fact stored.)
BUFFER_SHARE = 0.75
# A read round's objects must all land within one read lease (the master's --default_kv_lease_ttl, counted by the
# client from its replica query to the end of the round's transfer): Mooncake fails EVERY object of a round that ends
# later (LEASE_EXPIRED), whatever landed. On a loaded 2-core machine one 48 MB round of fp32 SmolLM2 facts took longer
# than `inferscale serve`'s 0.5 s lease (bench/service.py at 25 users, 2026-11-29: the whole request's memory was
# then recomputed). So the objects whose lease ran out are read again, in rounds half as large while a round held more
# than one object, then READ_PASSES_AT_ONE more passes of one object a round; the reader keeps the smaller rounds for
# its next reads and doubles them back after each read that needed no smaller round. An object that failed for
# another reason is not read again by this read (unreadable now, read again by a later one): a copy on a dead node's
# segment fails with -800 (measured), and its round waits ~1 s for the peer, so the live objects beside it expire and
# are read again in rounds without it. Every retry happens within READ_RETRY_LEASES leases of the read's start (at
# least READ_RETRY_MIN_S): whatever is still unread then is unreadable for this read, so a read is bounded in time.
READ_PASSES_AT_ONE = 2
READ_RETRY_LEASES = 4
READ_RETRY_MIN_S = 2.0
REMOVE_ATTEMPTS = 30  # a remove refused for a lease is tried again after each lease, this often at most
MIN_REMOVE_ATTEMPTS = 3  # ... and this often at least (see ClusterStore._remove)


# The versions of a fact one removal names: the last VERSIONS_NAMED before the one asked for, never all of them (a
# fact updated a million times would mean a million keys). Enough when removals follow every update in order: each
# names the version before it, so every older one was named by an earlier removal (the cluster tier here, the
# engine replica's tombstones in services/engine_replica/deletions.py).
VERSIONS_NAMED = 64

@dataclass
class ClusterRead:
    """What one read of k facts found: per fact what `keep` made of it (by default the fact; None: a miss) and
    whether it exists unread."""
    facts: list
    unreadable: list


def private_copy(kv_id: str, fact: EncodedFact) -> EncodedFact:
    """The default `keep` of ClusterStore.read: the fact in memory of its own, out of the read buffer."""
    return EncodedFact(fact.token_ids.clone(), fact.k_pre.clone(), fact.v.clone())


class RegisteredBuffer:
    """Host memory registered with one Mooncake client, where `batch_put_from` reads the objects of a write round or
    `batch_get_into` lands those of a read round: allocated at the first round, grown when a round needs more (at
    least doubled, in whole GRAIN_BYTES, never past `limit`: registering is a call into the transfer engine, paid
    once, not per round; a round of k facts of another user differs by a few header bytes and must not register
    again), reused by every later round. Not thread-safe: the ClusterStore uses it under its transfer lock.

    `pinned`: page-locked memory (torch's pin_memory), for a reader whose facts go on to a CUDA device: the copy out
    of it is then a DMA, where pageable memory is first staged by the driver through a pinned buffer of its own."""

    GRAIN_BYTES = 1 << 20

    def __init__(self, limit: int, pinned: bool = False):
        self.limit = limit
        self.pinned = pinned
        self.memory: torch.Tensor | None = None
        self.registrations = 0  # how often memory was allocated and registered

    def reserve(self, client, nbytes: int) -> torch.Tensor:
        """The registered memory, at least `nbytes` long."""
        if nbytes > self.limit:
            raise ValueError(f"a round of {nbytes} bytes is over the registered buffer's limit ({self.limit} bytes)")
        if self.memory is None or self.memory.numel() < nbytes:
            wanted = max(nbytes, 2 * (0 if self.memory is None else self.memory.numel()))
            size = max(nbytes, min(self.limit, -(-wanted // self.GRAIN_BYTES) * self.GRAIN_BYTES))
            self.release(client)  # the old memory first: both may not fit at once
            memory = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
            rc = client.register_buffer(memory.data_ptr(), size)
            if rc != 0:
                raise RuntimeError(f"register_buffer of {size} bytes returned {rc}")
            self.memory = memory
            self.registrations += 1
        return self.memory

    def release(self, client) -> None:
        if self.memory is not None:
            memory, self.memory = self.memory, None
            client.unregister_buffer(memory.data_ptr())


def _h(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def kv_fingerprint(model_dir: str | Path, dtype: torch.dtype, prefix_ids: list[int] | tuple[int, ...]) -> str:
    """What a fact's KV depends on besides its own text and window: the model (config.json and the names and
    sizes of its weight files: content, not the folder's path, so every node agrees), the stored dtype and
    the token ids of the instruction prefix it is encoded behind (empty when facts are encoded alone)."""
    d = hashlib.sha256(FORMAT.encode())
    folder = Path(model_dir)
    config = folder / "config.json"
    d.update(config.read_bytes() if config.is_file() else str(folder).encode())
    for w in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        d.update(f"{w.name}:{w.stat().st_size}".encode())
    d.update(_DTYPE_NAMES[dtype].encode())
    d.update(json.dumps([int(t) for t in prefix_ids]).encode())
    return d.hexdigest()[:16]


def object_header(fingerprint: str, user_id: str, kv_id: str, fact: EncodedFact) -> bytes:
    """What precedes an object's raw bytes: MAGIC, the JSON header's length (uint32, little-endian), the header."""
    head = json.dumps({"format": FORMAT, "fingerprint": fingerprint, "user_id": user_id, "kv_id": kv_id,
                       "dtype": _DTYPE_NAMES[fact.k_pre.dtype], "shape": list(fact.k_pre.shape)}).encode()
    return MAGIC + struct.pack("<I", len(head)) + head


def packed_size(header: bytes, fact: EncodedFact) -> int:
    """The byte size of the object `header` begins: the header, token ids as int64, keys and values."""
    return len(header) + 8 * fact.token_ids.numel() + fact.k_pre.nbytes + fact.v.nbytes


def pack_into(out: torch.Tensor, header: bytes, fact: EncodedFact) -> None:
    """Writes the object into `out` (uint8 on the CPU, exactly `packed_size` long): `header`, then the raw bytes of
    the token ids (int64), pre-RoPE keys and values (the fact's dtype), contiguous; each tensor copied once, from
    wherever it lives (a device tensor straight to `out`)."""
    flat = out.numpy()
    flat[:len(header)] = memoryview(header)
    at = len(header)
    for t in (fact.token_ids.detach().to(torch.int64), fact.k_pre.detach(), fact.v.detach()):
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        if raw.device.type == "cpu":  # one thread (numpy's memcpy), as store.host_copy, and for its reason
            flat[at:at + raw.numel()] = raw.numpy()
        else:
            out[at:at + raw.numel()].copy_(raw)
        at += raw.numel()
    if at != out.numel():
        raise ValueError(f"a KV object of {at} bytes packed into {out.numel()} bytes")


def pack(fingerprint: str, user_id: str, kv_id: str, fact: EncodedFact) -> bytes:
    """The object as bytes: header + raw bytes of token ids (int64), pre-RoPE keys and values (the fact's dtype),
    contiguous. ClusterStore writes the same bytes from its registered buffer (`pack_into`)."""
    header = object_header(fingerprint, user_id, kv_id, fact)
    out = torch.empty(packed_size(header, fact), dtype=torch.uint8)
    pack_into(out, header, fact)
    return out.numpy().tobytes()


def unpack(data: bytes | memoryview) -> tuple[dict, EncodedFact]:
    """(header, EncodedFact) from `pack`'s bytes; ValueError for anything else. No copy: the tensors are views of
    `data` (read-only; the worker store copies what it keeps)."""
    data = memoryview(data)
    if bytes(data[:len(MAGIC)]) != MAGIC:
        raise ValueError("not an InferScale KV object")
    (n,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    head = json.loads(bytes(data[start:start + n]))
    if head.get("format") != FORMAT or head.get("dtype") not in _DTYPES:
        raise ValueError(f"unsupported KV object (format {head.get('format')!r}, dtype {head.get('dtype')!r})")
    layers, tokens, heads, dim = (int(x) for x in head["shape"])
    dtype = _DTYPES[head["dtype"]]
    size = layers * tokens * heads * dim * torch.empty((), dtype=dtype).element_size()
    body = start + n
    if len(data) != body + 8 * tokens + 2 * size:
        raise ValueError(f"KV object of {len(data)} bytes does not match its header {head}")
    with warnings.catch_warnings():  # a read-only buffer: the tensors are views of it, never written to
        warnings.simplefilter("ignore", UserWarning)
        raw = (torch.frombuffer(data, dtype=torch.uint8, offset=body) if len(data) > body
               else torch.empty(0, dtype=torch.uint8))
    ids = raw[:8 * tokens].view(torch.int64)
    k = raw[8 * tokens:8 * tokens + size].view(dtype).view(layers, tokens, heads, dim)
    v = raw[8 * tokens + size:].view(dtype).view(layers, tokens, heads, dim)
    return head, EncodedFact(token_ids=ids, k_pre=k, v=v)


class _ReadFailed(Exception):
    """A Mooncake call of a read failed: the store counts as down (a failure of the caller's `keep` is not this)."""


def _mooncake(what: str, call, *args):
    """`call(*args)`, a Mooncake call of a read; its failure raised as _ReadFailed."""
    try:
        return call(*args)
    except Exception as e:  # any failure of the client is the store failing (re-raised as one)
        raise _ReadFailed(f"{what}: {e}") from e


@dataclass(frozen=True)
class ClusterConfig:
    """Where the Mooncake Store is and what this process contributes to it."""
    master: str                       # mooncake_master's RPC address, host:port
    # Where transfer engines find each other's segments: P2P_METADATA (each client answers for its own segment
    # on its handshake port, so the master runs no HTTP metadata server, one unauthenticated listener fewer),
    # or a metadata server's URL (http://host:port/metadata) for a master started with one.
    metadata: str = P2P_METADATA
    # This client's address as other clients reach it: the pod IP ($POD_IP, set by the chart) or loopback.
    local_host: str = field(default_factory=lambda: os.environ.get("POD_IP", "127.0.0.1"))
    segment_bytes: int = 0            # memory this process adds to the pool (0: a client only)
    buffer_bytes: int = 64 << 20      # this client's transfer buffer; 3/4 of it bounds its write and read buffers
    protocol: str = "tcp"
    device: str = ""                  # RDMA device names; none for TCP
    lease_s: float = 1.0              # the master's --default_kv_lease_ttl: how long to wait to repeat a remove
    retry_s: float = 2.0              # while the store is down, how often the background probe tries it
    # Copies of each object, each in another segment (Mooncake's replica_num; fewer when fewer segments exist).
    # One copy is lost with its node (a node's segment dies with it: those facts are re-encoded); two keep
    # every fact readable when one node dies, at twice the pool memory (docs/architecture.md, "What survives").
    replicas: int = 2
    # Every segment's memory together (the chart: its worker groups' minReplicas pods, the smallest cluster it
    # runs); 0: not known. Each user's KV in the tier is bounded by pool_bytes / (replicas x tenants): the encoder
    # pool removes that user's own least recently used objects before it writes past it (services/kv_tier_share.py),
    # so one tenant's flood never makes the master's LRU (one over every user) evict the others' KV.
    pool_bytes: int = 0
    # Users whose KV the pool is sized to hold at once: each may take 1/tenants of the distinct KV the pool holds
    # (16: a flood of one user takes at most ~6% of it; more active users than this share the master's LRU).
    tenants: int = 16
    # Each user's KV in the tier, in bytes, instead of the fair share above; null with pool_bytes 0: no bound.
    max_bytes_per_user: int | None = None
    # Whether a write warms the user's engine replica: its connector's worker reads the facts just written into its
    # memory in the background, behind the requests' loads, so the user's first request finds them there (docs/
    # architecture.md "Warm at write"). false: the first request that names a fact reads it (a bulk import of
    # users who will not ask soon spends no reads).
    warm_at_write: bool = True

    def user_cap(self) -> int | None:
        """The bytes of KV one user may hold in the tier: max_bytes_per_user, else the user's fair share of the
        distinct KV the pool holds, pool_bytes / (replicas x tenants) (every object is stored `replicas` times);
        None without either (no per-user bound)."""
        if self.max_bytes_per_user is not None:
            return self.max_bytes_per_user
        return self.pool_bytes // (self.replicas * self.tenants) if self.pool_bytes else None

    @classmethod
    def from_dict(cls, d: dict | None) -> "ClusterConfig | None":
        """None (no cluster tier) for an empty dict; unknown keys are refused with their names."""
        if not d:
            return None
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown cluster_store keys {sorted(unknown)}; known: {sorted(known)}")
        if not isinstance(d.get("master"), str) or not d["master"]:
            raise ValueError("cluster_store.master must be set (mooncake_master's RPC address, e.g. 127.0.0.1:50051)")
        if "metadata" in d and (not isinstance(d["metadata"], str) or not d["metadata"]):
            raise ValueError(f"cluster_store.metadata must be {P2P_METADATA!r} (the default) or a metadata "
                             f"server's URL, got {d['metadata']!r}")
        replicas = d.get("replicas", 2)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"cluster_store.replicas must be an integer >= 1 (copies of each object), got {replicas!r}")
        if not isinstance(d.get("warm_at_write", True), bool):
            raise ValueError(f"cluster_store.warm_at_write must be true or false, got {d['warm_at_write']!r}")
        for name, low, what in (("pool_bytes", 0, "every segment's memory together; 0: not known"),
                                ("tenants", 1, "users whose KV the pool is sized to hold at once"),
                                ("max_bytes_per_user", 1, "a user's KV in the tier; null: the fair share")):
            value = d.get(name)
            if name in d and not (name == "max_bytes_per_user" and value is None) and (
                    isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"cluster_store.{name} must be an integer >= {low} ({what}), got {value!r}")
        return cls(**d)


class ClusterStore:
    """Facts of one fingerprint in Mooncake Store (see the module docstring). Thread-safe."""

    def __init__(self, config: ClusterConfig, fingerprint: str, pending_file: str | os.PathLike | None = None,
                 reads_to: str | torch.device = "cpu"):
        """`pending_file`: where removes that arrived while the store was away are kept until they are done, so
        that a process restarted meanwhile still does them (an engine replica's disk folder; its tombstone cursor
        has moved past them). Read at start, and those removes are done when the store answers.

        `reads_to`: the device the reader copies the facts it reads to (the connector worker's). A CUDA device pins
        the read buffer; any other leaves it ordinary memory (a CPU-only torch cannot pin)."""
        if not re.fullmatch(r"[0-9a-f]{8,64}", fingerprint):
            raise ValueError(f"fingerprint must be lowercase hex, got {fingerprint!r}")
        device = torch.device(reads_to)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"reads_to is {device}, but torch sees no CUDA device here: the read buffer cannot be "
                             f"pinned for it")
        self.config, self.fingerprint = config, fingerprint
        self._client = None
        self._up = False           # the last call (or probe) got an answer
        self._probe: threading.Thread | None = None
        self._closed = False
        self._pending_file = Path(pending_file) if pending_file is not None else None
        self._pending_removes: set[str] = self._read_pending()
        self._lock = threading.Lock()
        # One round at a time in the write buffer (packed, then sent by Mooncake before the next round packs over it)
        # or in the read buffer (landed, unpacked and kept before the next round may land over it).
        self._transfer = threading.Lock()
        self.write_buffer = RegisteredBuffer(int(config.buffer_bytes * BUFFER_SHARE))
        self.read_buffer = RegisteredBuffer(int(config.buffer_bytes * BUFFER_SHARE), pinned=device.type == "cuda")
        # Bytes one read round takes at most (READ_PASSES_AT_ONE's comment): the read buffer's limit until a round
        # outlives its lease. Shared by the loader threads; a lost update only costs one more or one fewer halving.
        self.read_round_bytes = self.read_buffer.limit
        self.counters = {"hits": 0, "misses": 0, "puts": 0, "put_failures": 0, "errors": 0, "removed": 0,
                         "read_rounds_halved": 0}

    # ------------------------------------------------------------------ keys
    def key(self, user_id: str, kv_id: str) -> str:
        """The object key of one fact version (`kv_id` is the worker store's `fact@vN`)."""
        fact_id, _, version = kv_id.rpartition("@")
        return f"{KEY_ROOT}/{self.fingerprint}/{_h(user_id)}/{_h(fact_id)}@{version}"

    @staticmethod
    def _fact_pattern(user_id: str, fact_id: str, versions: range | None = None) -> str:
        """Every fingerprint's objects of a fact (all versions, or those in `versions`)."""
        tail = "v[0-9]+" if versions is None else "v(" + "|".join(str(v) for v in versions) + ")"
        return f"^{KEY_ROOT}/[0-9a-f]+/{_h(user_id)}/{_h(fact_id)}@{tail}$"

    @staticmethod
    def _user_pattern(user_id: str) -> str:
        return f"^{KEY_ROOT}/[0-9a-f]+/{_h(user_id)}/"

    # ------------------------------------------------------------------ connection
    # Mooncake's calls block for seconds when the master is away (setup ~90 s of retries holding the GIL, a get
    # ~4 s, a put ~8 s, measured here), so a request never waits on them: connecting happens in a background
    # thread that first checks the master's port, and after a failed call the store counts as down (every call
    # a miss at once) until that thread's probe succeeds again.
    def _store(self):
        """The Mooncake client when it is connected and up; else None (and a background reconnect runs)."""
        with self._lock:
            if self._client is not None and self._up:
                return self._client
            if self._probe is None:
                self._probe = threading.Thread(target=self._reconnect, name="cluster-kv-probe", daemon=True)
                self._probe.start()
            return None

    def _reconnect(self) -> None:
        """Background: set up the client (first time) or probe it (after a failure) until the store answers."""
        first = True
        while not self._closed:
            if not first:
                time.sleep(self.config.retry_s)
            first = False
            try:
                # Mooncake's calls hold the GIL while they retry (the whole process stops): ask the master's
                # port first, with a short timeout, and call Mooncake only when it answers.
                host, _, port = self.config.master.rpartition(":")
                with socket.create_connection((host, int(port)), timeout=1.0):
                    pass
                if self._client is None:
                    from mooncake.store import MooncakeDistributedStore

                    c = self.config
                    client = MooncakeDistributedStore()
                    rc = client.setup(c.local_host, c.metadata, int(c.segment_bytes), int(c.buffer_bytes),
                                      c.protocol, c.device, c.master)
                    if rc != 0:
                        raise RuntimeError(f"setup returned {rc}")
                    self._client = client
                else:
                    rc = self._client.is_exist(f"{KEY_ROOT}/probe")
                    if rc < 0:
                        raise RuntimeError(f"is_exist returned {rc}")
            except Exception as e:  # noqa: BLE001 - tried again after retry_s
                self.counters["errors"] += 1
                log.warning("cluster KV tier unavailable (Mooncake master %s): %s", self.config.master, e)
                continue
            with self._lock:
                self._up, self._probe = True, None
                pending = set(self._pending_removes)
            log.info("cluster KV tier: connected to Mooncake master %s", self.config.master)
            for pattern in pending:  # deletes that arrived while the store was away (or before a restart)
                self._remove(pattern)
            with self._lock:  # done (or, where the store went away again, added back by _remove_now)
                if self._up:
                    self._pending_removes -= pending
                self._save_pending()
            return
        with self._lock:
            self._probe = None

    def _failed(self, what: str, err) -> None:
        """A call failed: down (misses at once) until the background probe gets an answer again."""
        self.counters["errors"] += 1
        log.warning("cluster KV tier: %s failed (%s); treating the store as down until it answers", what, err)
        with self._lock:
            self._up = False
            if self._probe is None:
                self._probe = threading.Thread(target=self._reconnect, name="cluster-kv-probe", daemon=True)
                self._probe.start()

    @property
    def available(self) -> bool:
        return self._store() is not None

    def wait_available(self, timeout_s: float) -> bool:
        """Blocks until the store is up (start-up and tests; never in a request)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.available:
                return True
            time.sleep(0.05)
        return self.available

    # ------------------------------------------------------------------ objects
    def put_many(self, user_id: str, items: list[tuple[str, EncodedFact]]) -> list[bool]:
        """Writes `(kv_id, fact)` objects; per item whether it is stored. An existing key is left as it is
        (objects are immutable: the same kv_id is the same KV).

        Each round of objects is packed into the registered write buffer, each object once and straight from the
        fact's tensors, and Mooncake sends them from there (`batch_put_from`), answering per object. An object
        refused (the master away, the segments full) is reported not stored, those Mooncake stored are reported
        stored, and the store counts as down, as after any failed call (the later rounds are not tried). A fact
        larger than the write buffer's limit is not stored, the others are."""
        if not items:
            return []
        client = self._store()
        if client is None:
            self.counters["put_failures"] += len(items)
            return [False] * len(items)
        keys = [self.key(user_id, kv) for kv, _ in items]
        stored = [False] * len(items)
        written = 0
        try:
            exists = client.batch_is_exist(keys)
            todo = [i for i, e in enumerate(exists) if e != 1]
            for i in set(range(len(items))) - set(todo):
                stored[i] = True
            heads = {i: object_header(self.fingerprint, user_id, *items[i]) for i in todo}
            sizes = {i: packed_size(heads[i], items[i][1]) for i in todo}
            limit = self.write_buffer.limit
            for i in [i for i in todo if sizes[i] > limit]:  # never fits a round (nor a reader's buffer)
                log.warning("cluster KV tier: a fact of %d bytes is over the write buffer (3/4 of buffer_bytes %d); "
                            "not stored", sizes[i], self.config.buffer_bytes)
            for batch in self._batches([i for i in todo if sizes[i] <= limit], sizes.__getitem__, limit):
                with self._transfer:
                    codes = self._put_round(client, [keys[i] for i in batch], [items[i][1] for i in batch],
                                            [heads[i] for i in batch], [sizes[i] for i in batch])
                for i, rc in zip(batch, codes):
                    stored[i] = rc == 0
                written += sum(rc == 0 for rc in codes)
                refused = [rc for rc in codes if rc != 0]
                if refused or len(codes) != len(batch):
                    raise RuntimeError(f"batch_put_from refused {len(refused)} of {len(batch)} objects "
                                       f"(codes {sorted(set(refused))})")
        except Exception as e:  # noqa: BLE001 - reported per item; the caller keeps the KV elsewhere
            self._failed(f"put of {len(items)} facts", e)
        self.counters["puts"] += written
        self.counters["put_failures"] += stored.count(False)
        return stored

    def _put_round(self, client, keys: list[str], facts: list[EncodedFact], heads: list[bytes],
                   sizes: list[int]) -> list[int]:
        """Packs the objects one after another into the write buffer and has Mooncake send them from there; its
        answer per object (0: stored). Under the transfer lock."""
        memory = self.write_buffer.reserve(client, sum(sizes))
        addresses, at = [], 0
        for fact, head, n in zip(facts, heads, sizes):
            pack_into(memory[at:at + n], head, fact)
            addresses.append(memory.data_ptr() + at)
            at += n
        return list(client.batch_put_from(keys, addresses, sizes, self._replicate()))

    def _batches(self, todo: list[int], size, limit: int) -> list[list[int]]:
        """`todo` cut, in order, into rounds whose objects fit `limit` bytes together (a registered buffer's)."""
        batches: list[list[int]] = []
        cur: list[int] = []
        used = 0
        for i in todo:
            if cur and used + size(i) > limit:
                batches.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += size(i)
        return batches + ([cur] if cur else [])

    def _replicate(self):
        from mooncake.store import ReplicateConfig

        rc = ReplicateConfig()
        rc.replica_num = int(self.config.replicas)
        return rc

    def get_many(self, user_id: str, kv_ids: list[str]) -> list[EncodedFact | None]:
        """The facts, None for each miss (absent, evicted, another fingerprint's, or the store is away)."""
        return self.read(user_id, kv_ids).facts

    def read(self, user_id: str, kv_ids: list[str],
             keep: Callable[[str, EncodedFact], object] = private_copy) -> "ClusterRead":
        """The facts (None for each miss) and, for each miss, whether the object exists all the same: a copy on a
        segment whose node just died is listed until the master drops that segment, and cannot be read.

        Each fact read is passed to `keep(kv_id, fact)` inside its read round, as views of the read buffer that are
        valid only during the call (`keep` copies what it keeps: the worker store puts it, in its dtype, where it
        belongs); `facts` holds what `keep` returned (None counts as a miss). An exception from `keep` is the
        caller's and ends the read."""
        if not kv_ids:
            return ClusterRead([], [])
        client = self._store()
        if client is None:
            self.counters["misses"] += len(kv_ids)
            return ClusterRead([None] * len(kv_ids), [False] * len(kv_ids))
        keys = [self.key(user_id, kv) for kv in kv_ids]
        out: list = [None] * len(kv_ids)
        exists: dict[int, int] = {}  # what the master says of each object not read
        try:
            sizes = _mooncake("batch_get_replica_desc", self._sizes, client, keys)
            # Larger than any object put_many stores: not ours (a foreign writer, a bug); a miss, never read.
            todo = [i for i, n in sizes.items() if n <= self.read_buffer.limit]
            for i in sizes.keys() - set(todo):
                log.warning("cluster KV tier: the object for %s is %d bytes, over the read buffer (%d); ignored",
                            kv_ids[i], sizes[i], self.read_buffer.limit)
            # Not listed (or no complete copy in memory), or its read failed: a miss or a failure, and only then one
            # more call tells which (a hit costs two calls: the sizes, then the read).
            exists.update(self._exist(client, keys, [i for i in range(len(keys)) if i not in sizes]))
            round_bytes, shrunk, passes_at_one = self.read_round_bytes, False, 0
            retry_until = time.monotonic() + max(READ_RETRY_MIN_S, READ_RETRY_LEASES * self.config.lease_s)
            while todo:
                batches = self._batches(todo, sizes.__getitem__, round_bytes)
                codes: dict[int, int] = {}
                for batch in batches:
                    codes.update(self._read_round(client, user_id, kv_ids, keys, sizes, batch, keep, out))
                exists.update(self._exist(client, keys, list(codes)))
                # Listed but not read because its lease ran out: read again (READ_PASSES_AT_ONE's comment), in
                # smaller rounds when its round held more than one object; anything else is unreadable this time.
                again = [i for i, rc in codes.items() if rc == _LEASE_EXPIRED and exists[i] == 1]
                if not again or time.monotonic() >= retry_until:
                    break
                if max(len(b) for b in batches) > 1:
                    # Half the largest round actually read, not half the budget: a budget twice the data halved
                    # once would read the same one round again.
                    largest_round = max(sum(sizes[i] for i in b) for b in batches)
                    round_bytes, shrunk = max(1, min(round_bytes, largest_round) // 2), True
                    self.counters["read_rounds_halved"] += 1
                elif len(again) == len(todo):
                    passes_at_one += 1
                    if passes_at_one > READ_PASSES_AT_ONE:
                        break
                todo = again
            self.read_round_bytes = round_bytes if shrunk else min(self.read_buffer.limit, 2 * round_bytes)
        except _ReadFailed as e:  # what was kept is the caller's already: returned, the rest are misses
            self._count_read(out)
            self._failed(f"get of {len(kv_ids)} facts", e)
            return ClusterRead(out, [False] * len(kv_ids))
        self._count_read(out)
        # Listed, not read; an object read but wrong (or refused by `keep`) is a plain miss.
        return ClusterRead(out, [out[i] is None and exists.get(i) == 1 for i in range(len(kv_ids))])

    @staticmethod
    def _exist(client, keys: list[str], indexes: list[int]) -> dict[int, int]:
        """By index, whether the master lists the object (1) or not (0); _ReadFailed when it does not answer."""
        if not indexes:
            return {}
        asked = _mooncake("batch_is_exist", client.batch_is_exist, [keys[i] for i in indexes])
        if min(asked) < 0:
            raise _ReadFailed(f"batch_is_exist answered {min(asked)}: the master did not answer")
        return dict(zip(indexes, asked))

    def _count_read(self, out: list) -> None:
        hits = sum(f is not None for f in out)
        self.counters["hits"] += hits
        self.counters["misses"] += len(out) - hits

    @staticmethod
    def _sizes(client, keys: list[str]) -> dict[int, int]:
        """By index, the byte size of each object listed with a complete copy in memory: the master keeps it with
        the object, and one call answers for all keys (`get_size` would be one call per key). A master that does
        not answer lists nothing (measured: an empty answer at once), which the existence check then tells."""
        from mooncake.store import ReplicaStatus

        found = client.batch_get_replica_desc(keys)
        sizes = {}
        for i, key in enumerate(keys):
            for replica in found.get(key, ()):
                if replica.is_memory_replica() and replica.status == ReplicaStatus.COMPLETE:
                    sizes[i] = int(replica.get_memory_descriptor().buffer_descriptor.size)
                    break
        return sizes

    def _read_round(self, client, user_id: str, kv_ids: list[str], keys: list[str], sizes: dict[int, int],
                    batch: list[int], keep, out: list) -> dict[int, int]:
        """Lands the objects of `batch` in the read buffer, unpacks each and hands it to `keep` (into `out`);
        returns the indexes whose read failed, with Mooncake's code for each. A failed Mooncake call raises
        _ReadFailed; what `keep` raises passes through."""
        offsets, total = [], 0
        for i in batch:
            offsets.append(total)
            total += sizes[i]
        with self._transfer:
            memory = _mooncake("register_buffer", self.read_buffer.reserve, client, total)
            got = _mooncake("batch_get_into", client.batch_get_into, [keys[i] for i in batch],
                            [memory.data_ptr() + o for o in offsets], [sizes[i] for i in batch])
            view = memoryview(memory.numpy())
            failed = {}
            for i, at, n in zip(batch, offsets, got):
                if n < 0:  # removed meanwhile (-704), its lease over (-707), its copy out of reach: asked about after
                    failed[i] = n
                    continue
                fact = self._checked(view[at:at + n], user_id, kv_ids[i])
                if fact is not None:
                    out[i] = keep(kv_ids[i], fact)
            return failed

    def _checked(self, data: memoryview, user_id: str, kv_id: str) -> EncodedFact | None:
        """The fact in `data` when it is this key's object (header: fingerprint, user, kv_id); else None."""
        try:
            head, fact = unpack(data)
        except (ValueError, KeyError) as err:
            log.warning("cluster KV tier: unreadable object for a fact: %s", err)
            return None
        if (head.get("fingerprint"), head.get("user_id"), head.get("kv_id")) != (self.fingerprint, user_id, kv_id):
            log.warning("cluster KV tier: object for %s holds another fact's KV; ignored", kv_id)
            return None
        return fact

    def remove_versions(self, user_id: str, fact_id: str, below: int | None = None) -> None:
        """Removes, under every fingerprint, the fact's versions below `below` (every version when None)."""
        versions = None if below is None else range(max(1, below - VERSIONS_NAMED), below)
        if versions is not None and not versions:
            return
        self._remove(self._fact_pattern(user_id, fact_id, versions))

    def remove_kvs(self, user_id: str, kv_ids: list[str]) -> None:
        """Removes these fact versions' objects of this fingerprint only (a user's share of the tier: the pool's
        own writes, not another release's), in one remove."""
        if kv_ids:
            names = "|".join(re.escape(self.key(user_id, kv).rpartition("/")[2]) for kv in kv_ids)
            self._remove(f"^{KEY_ROOT}/{self.fingerprint}/{_h(user_id)}/({names})$")

    def remove_user(self, user_id: str) -> None:
        """Removes every object of the user, under every fingerprint."""
        self._remove(self._user_pattern(user_id))

    def _remove(self, pattern: str, attempt: int = 0) -> None:
        """Now, then again after each read lease: MIN_REMOVE_ATTEMPTS times, then until an attempt finds nothing
        (REMOVE_ATTEMPTS at most). Mooncake skips objects whose lease runs (a read in progress) and answers -706,
        the count of the others, or 0 when the leased ones were all it found (measured): so 0 ends the retries
        only after a read that started between two attempts has had a lease to end."""
        n = self._remove_now(pattern)
        if (attempt + 1 < MIN_REMOVE_ATTEMPTS or n != 0) and attempt + 1 < REMOVE_ATTEMPTS and not self._closed:
            timer = threading.Timer(self.config.lease_s + 0.2, self._remove, args=(pattern, attempt + 1))
            timer.daemon = True
            timer.start()

    def _remove_now(self, pattern: str) -> int:
        """Mooncake's answer: objects removed, or _LEASE_REFUSED."""
        client = self._store()
        if client is None:  # done when the store is back: a delete is never lost
            self._add_pending(pattern)
            return 0
        try:
            n = client.remove_by_regex(pattern)
            if n < 0 and n != _LEASE_REFUSED:
                raise RuntimeError(f"remove_by_regex returned {n}")
        except Exception as e:  # noqa: BLE001
            self._add_pending(pattern)
            self._failed("remove", e)
            return 0
        self.counters["removed"] += max(n, 0)
        return n

    # ------------------------------------------------------------------ removes kept until done
    def pending_removes(self) -> set[str]:
        with self._lock:
            return set(self._pending_removes)

    def _add_pending(self, pattern: str) -> None:
        with self._lock:
            if pattern not in self._pending_removes:
                self._pending_removes.add(pattern)
                self._save_pending()

    def _read_pending(self) -> set[str]:
        if self._pending_file is None or not self._pending_file.is_file():
            return set()
        patterns = {line for line in self._pending_file.read_text().splitlines() if line}
        if patterns:
            log.info("cluster KV tier: %d removes left from before a restart; done when the store answers",
                     len(patterns))
        return patterns

    def _save_pending(self) -> None:
        """The pending removes on disk (under self._lock), replaced whole: a crash leaves the old list or the new."""
        if self._pending_file is None:
            return
        tmp = self._pending_file.with_name(self._pending_file.name + ".tmp")
        tmp.write_text("".join(f"{p}\n" for p in sorted(self._pending_removes)))
        os.replace(tmp, self._pending_file)

    def start(self) -> None:
        """Connects in the background now (rather than at the first call), so removes left from before a restart
        are done as soon as the store answers."""
        self._store()

    def close(self) -> None:
        self._closed = True
        with self._lock, self._transfer:
            if self._client is not None:
                try:
                    self.read_buffer.release(self._client)
                    self.write_buffer.release(self._client)
                    self._client.close()
                finally:
                    self._client = None
