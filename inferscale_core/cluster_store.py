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
# Of the client's transfer buffer, what one batch's values may take: Mooncake's allocator there needs room of its
# own (a put_batch of 63.5 MiB failed in a 64 MiB buffer, measured here).
BUFFER_SHARE = 0.75
REMOVE_ATTEMPTS = 30  # a remove refused for a lease is tried again after each lease, this often at most
MIN_REMOVE_ATTEMPTS = 3  # ... and this often at least (see ClusterStore._remove)


# The versions of a fact one removal names: the last VERSIONS_NAMED before the one asked for, never all of them (a
# fact updated a million times would mean a million keys). Enough when removals follow every update in order: each
# names the version before it, so every older one was named by an earlier removal (the cluster tier here, the
# engine replica's tombstones in services/engine_replica/deletions.py).
VERSIONS_NAMED = 64

@dataclass
class ClusterRead:
    """What one read of k facts found: each fact (None: a miss) and, per fact, whether it exists unread."""
    facts: list
    unreadable: list


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


def pack(fingerprint: str, user_id: str, kv_id: str, fact: EncodedFact) -> bytes:
    """Header + raw bytes of token ids (int64), pre-RoPE keys and values (the fact's dtype), contiguous."""
    k, v = fact.k_pre.detach().cpu().contiguous(), fact.v.detach().cpu().contiguous()
    head = json.dumps({"format": FORMAT, "fingerprint": fingerprint, "user_id": user_id, "kv_id": kv_id,
                       "dtype": _DTYPE_NAMES[k.dtype], "shape": list(k.shape)}).encode()
    ids = fact.token_ids.detach().cpu().to(torch.int64).contiguous()
    return b"".join((MAGIC, struct.pack("<I", len(head)), head, ids.numpy().tobytes(),
                     k.view(torch.uint8).numpy().tobytes(), v.view(torch.uint8).numpy().tobytes()))


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
    buffer_bytes: int = 64 << 20      # this client's transfer buffer
    protocol: str = "tcp"
    device: str = ""                  # RDMA device names; none for TCP
    lease_s: float = 1.0              # the master's --default_kv_lease_ttl: how long to wait to repeat a remove
    retry_s: float = 2.0              # while the store is down, how often the background probe tries it
    # Copies of each object, each in another segment (Mooncake's replica_num; fewer when fewer segments exist).
    # One copy is lost with its node (a node's segment dies with it: those facts are re-encoded); two keep
    # every fact readable when one node dies, at twice the pool memory (docs/architecture.md, "What survives").
    replicas: int = 2

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
        return cls(**d)


class ClusterStore:
    """Facts of one fingerprint in Mooncake Store (see the module docstring). Thread-safe."""

    def __init__(self, config: ClusterConfig, fingerprint: str):
        if not re.fullmatch(r"[0-9a-f]{8,64}", fingerprint):
            raise ValueError(f"fingerprint must be lowercase hex, got {fingerprint!r}")
        self.config, self.fingerprint = config, fingerprint
        self._client = None
        self._up = False           # the last call (or probe) got an answer
        self._probe: threading.Thread | None = None
        self._closed = False
        self._pending_removes: set[str] = set()
        self._lock = threading.Lock()
        self._transfer = threading.Lock()  # one batch at a time in the client's transfer buffer (BUFFER_SHARE)
        self.counters = {"hits": 0, "misses": 0, "puts": 0, "put_failures": 0, "errors": 0, "removed": 0}

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
                pending, self._pending_removes = self._pending_removes, set()
            log.info("cluster KV tier: connected to Mooncake master %s", self.config.master)
            for pattern in pending:  # deletes that arrived while the store was away
                self._remove(pattern)
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
        (objects are immutable: the same kv_id is the same KV)."""
        if not items:
            return []
        client = self._store()
        if client is None:
            self.counters["put_failures"] += len(items)
            return [False] * len(items)
        keys = [self.key(user_id, kv) for kv, _ in items]
        try:
            exists = client.batch_is_exist(keys)
            todo = [i for i, e in enumerate(exists) if e != 1]
            ok = [True] * len(items)
            values = {i: pack(self.fingerprint, user_id, items[i][0], items[i][1]) for i in todo}
            for i in [i for i in todo if len(values[i]) > self.config.buffer_bytes * BUFFER_SHARE]:  # never fits
                log.warning("cluster KV tier: a fact of %d bytes is over the transfer buffer (buffer_bytes %d); "
                            "not stored", len(values[i]), self.config.buffer_bytes)
                ok[i] = False
            for batch in self._batches([i for i in todo if ok[i]], lambda i: len(values[i])):
                with self._transfer:
                    rc = client.put_batch([keys[i] for i in batch], [values[i] for i in batch], self._replicate())
                if rc != 0:
                    raise RuntimeError(f"put_batch returned {rc}")
            self.counters["puts"] += sum(ok[i] for i in todo)
            self.counters["put_failures"] += ok.count(False)
            return ok
        except Exception as e:  # noqa: BLE001 - reported per item; the caller keeps the KV elsewhere
            self.counters["put_failures"] += len(items)
            self._failed(f"put of {len(items)} facts", e)
            return [False] * len(items)

    def _batches(self, todo: list[int], size) -> list[list[int]]:
        """`todo` cut, in order, into batches whose values fit the client's transfer buffer together (Mooncake
        stages a batch's values in it: a put_batch over it fails whole, a get_batch reads only what fits)."""
        batches: list[list[int]] = []
        cur: list[int] = []
        used = 0
        for i in todo:
            if cur and used + size(i) > self.config.buffer_bytes * BUFFER_SHARE:
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

    def read(self, user_id: str, kv_ids: list[str]) -> "ClusterRead":
        """The facts (None for each miss) and, for each miss, whether the object exists all the same: a copy on a
        segment whose node just died is listed until the master drops that segment, and cannot be read."""
        if not kv_ids:
            return ClusterRead([], [])
        client = self._store()
        if client is None:
            self.counters["misses"] += len(kv_ids)
            return ClusterRead([None] * len(kv_ids), [False] * len(kv_ids))
        keys = [self.key(user_id, kv) for kv in kv_ids]
        exists = [1] * len(kv_ids)  # what a read shows; an empty value is asked about below
        try:
            with self._transfer:
                values = client.get_batch(keys)
            # An empty value is a miss or a failure: only then one more call tells which (a hit costs one call).
            empty = [i for i, v in enumerate(values) if not v]
            asked = client.batch_is_exist([keys[i] for i in empty]) if empty else []
            if asked and min(asked) < 0:
                raise RuntimeError("the master did not answer")
            for i, e in zip(empty, asked):
                exists[i] = e
            # Present but not read: they did not fit the client's transfer buffer (buffer_bytes) with the others;
            # read again, in further rounds, as long as each round reads some.
            again = [i for i, e in zip(empty, asked) if e == 1]
            while again:
                with self._transfer:
                    got = client.get_batch([keys[i] for i in again])
                for i, v in zip(again, got):
                    if v:
                        values[i] = v
                if not any(got):  # nothing read (a copy on a dead node until the master drops it): misses
                    break
                again = [i for i, v in zip(again, got) if not v]
        except Exception as e:  # noqa: BLE001
            self.counters["misses"] += len(kv_ids)
            self._failed(f"get of {len(kv_ids)} facts", e)
            return ClusterRead([None] * len(kv_ids), [False] * len(kv_ids))
        out, unreadable = [], []
        for kv, data, exist in zip(kv_ids, values, exists):
            fact = None
            if data:
                try:
                    head, fact = unpack(data)
                    if (head["fingerprint"], head["user_id"], head["kv_id"]) != (self.fingerprint, user_id, kv):
                        log.warning("cluster KV tier: object for %s holds another fact's KV; ignored", kv)
                        fact = None
                except (ValueError, KeyError) as err:
                    log.warning("cluster KV tier: unreadable object for a fact: %s", err)
                    fact = None
            self.counters["hits" if fact is not None else "misses"] += 1
            out.append(fact)
            unreadable.append(not data and exist == 1)  # listed, not read; a read but wrong object is a plain miss
        return ClusterRead(out, unreadable)

    def remove_versions(self, user_id: str, fact_id: str, below: int | None = None) -> None:
        """Removes, under every fingerprint, the fact's versions below `below` (every version when None)."""
        versions = None if below is None else range(max(1, below - VERSIONS_NAMED), below)
        if versions is not None and not versions:
            return
        self._remove(self._fact_pattern(user_id, fact_id, versions))

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
            with self._lock:
                self._pending_removes.add(pattern)
            return 0
        try:
            n = client.remove_by_regex(pattern)
            if n < 0 and n != _LEASE_REFUSED:
                raise RuntimeError(f"remove_by_regex returned {n}")
        except Exception as e:  # noqa: BLE001
            with self._lock:
                self._pending_removes.add(pattern)
            self._failed("remove", e)
            return 0
        self.counters["removed"] += max(n, 0)
        return n

    def close(self) -> None:
        self._closed = True
        with self._lock:
            if self._client is not None:
                try:
                    self._client.close()
                finally:
                    self._client = None
