"""Engine replica deployment: one vLLM engine (AsyncInjectingEngine, InferScaleConnector) per replica process,
plus the KV of the users routed here.

Built from one EngineReplicaConfig (checked when services/app.py makes it) with an injectable engine:
`ReplicaCore` is the replica's logic over its parts (engine, encoder pool handle, registry, cluster tier) without
Serve, unit-tested without vLLM or Ray (tests/test_replica_core.py); `EngineReplica` is the Serve deployment
around it (Serve's multiplexed user loader, routing hooks, health check, metrics export).

Users are multiplexed (`multiplexed_model_id` = user id): Serve routes a user to a replica that already holds
it, and a replica holds at most MAX_USERS users (Serve's LRU). Serve's loader (`_user`) only registers the
user (it runs under one lock per replica, so it must stay short); the user's facts are synced by the request
itself, under that user's own lock, so a cold user with many facts never holds up another user.

Syncing a user reads the registry's list of the user's servable facts, versions and texts (one read of the
version counter when nothing moved since the last sync); it moves no KV. Per request, for the facts it names
(the retrieval's top-k):
  1. facts this replica put or had loaded into its worker store (`ResidentKV`) are used as they are,
  2. with a cluster KV tier (`cluster_store`: Mooncake Store, inferscale_core/cluster_store.py) the request goes
     to vLLM with `fetch` set: the connector's worker reads what its store lacks (its memory and disk tiers, then
     the cluster tier, with a Mooncake client of its own) on a loader thread while vLLM keeps the request outside
     the batch, and writes the blocks when the KV has arrived. No KV passes through this process or the engine
     core's RPC channel. A fact found in no tier (evicted, never written, Mooncake down) is computed by vLLM
     with the query (the connector's failed-load path: slower, never wrong); the worker lists it, and this
     replica (`requeue_missing`, every watch round) queues ONE re-encode, which writes it to the cluster tier,
  3. without a cluster tier the rest is encoded by the encoder pool now, from the registry's text and window,
     and put into the worker store; the put is sent, not awaited, before the request (`_put(ahead=True)`): vLLM's
     engine core runs its input in the order sent, so the put has run when the request is added.
Facts are stored under `kv_id(fact_id, version)` in every tier, so KV is used only for the exact version the
registry names; an update or a delete removes the older versions (from the cluster tier too).

The hot path: the replica keeps, per held user, each servable fact's version and text from its last sync, so
an Answer costs one registry read (the user's version counter) however many facts it names.

Deletes reach every replica that holds the user: the gateway pushes a delete to the replica Serve routes the
user to, and each replica's watch (every WATCH_PERIOD_S) reads the version counters of all its users in one
MGET and drops the KV of facts deleted or moved on (re-encoding waits for the user's next request).

Admission (services/admission.py): a request runs when its tokens fit in the KV cache times a queue factor,
else it is refused at once with RESOURCE_EXHAUSTED, so load reaches vLLM's batch instead of queues in front.

Writes from the gateway arrive as `put_facts(user, ids_versions, encoded)` where `encoded` is the encoder
pool's response that the gateway passed on unresolved: Serve resolves it here, from the object store. With a
cluster tier it holds only token counts (`StoredKV`: the KV is in the cluster tier, read by the first request
that needs it); without one, the EncodedFacts, put into the worker store now. A write is all or nothing: if
the encoder failed on any of its facts, none is stored and the gateway undoes the registry rows.

A fact the encoder cannot encode when a request fetches it (stored by an older version, say) is marked
unservable in the registry for that version and left out of that request and later ones; the user is answered
from the facts that can be served.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from ray import serve

import grpc

from inferscale_core.cluster_store import ClusterConfig, ClusterStore
from inferscale_core.errors import check_id
from inferscale_core.types import Mode, kv_id

from .admission import DEFAULT_QUEUE_FACTOR, Admission, check_queue_factor
from .api import RETRY_AFTER_S, ApiError, wire_mode
from .encoder_pool import EncodeFailure, StoredKV
from .messages import AnswerEnd, AnswerPiece, Choice
from .registry import open_registry
from .routing import IN_FLIGHT, SLOT
from .user_sync import moved_facts, user_changes

log = logging.getLogger("inferscale.engine_replica")
MAX_USERS = int(os.environ.get("INFERSCALE_ENGINE_MAX_USERS", "256"))
WATCH_PERIOD_S = float(os.environ.get("INFERSCALE_ENGINE_WATCH_S", "0.5"))
PUT_CHUNK_TOKENS = 512  # KV tokens per call into the engine core: its step loop waits while a call runs
TOMBSTONE_CURSOR = "tombstones.cursor"  # in the replica's disk folder: how far it applied the registry's tombstones


@dataclass(frozen=True)
class HeldFact:
    """A servable fact of a held user, as the registry had it at the last sync: its version, its text (prompt
    mode needs it) and its window (a re-encode needs it)."""
    version: int
    text: str
    window: tuple[str, ...] = ()


def held_versions(held: dict[str, HeldFact]) -> dict[str, int]:
    return {f: h.version for f, h in held.items()}


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def put_chunks(items: list, token_counts: list[int], max_tokens: int = PUT_CHUNK_TOKENS) -> list[list]:
    """`items` cut, in order, into runs of at most `max_tokens` tokens (an item larger than that alone)."""
    chunks, cur, used = [], [], 0
    for item, n in zip(items, token_counts):
        if cur and used + n > max_tokens:
            chunks.append(cur)
            cur, used = [], 0
        cur.append(item)
        used += n
    if cur:
        chunks.append(cur)
    return chunks


def older_kv_ids(fact_id: str, version: int) -> list[str]:
    """Ids of every earlier version (versions count up from 1, so this is exhaustive)."""
    return [kv_id(fact_id, v) for v in range(1, int(version))]


def default_kv_budget_bytes(node_share: float = 1.0) -> int:
    """KV bytes one engine replica keeps in its worker store: $INFERSCALE_ENGINE_KV_BUDGET_BYTES, else a quarter of
    the machine's memory (the rest is for vLLM's own KV cache, the model, the other deployments) times
    `node_share`, the replica's share of the node when engine replicas split it (`node_share_of`)."""
    from inferscale_core.vllm_env import machine_memory_bytes

    env = os.environ.get("INFERSCALE_ENGINE_KV_BUDGET_BYTES")
    if env:
        return int(env)
    return int(machine_memory_bytes() // 4 * node_share)


def node_share_of(engine_cpu_cores: int) -> float:
    """The share of a CPU node one engine replica takes: 1 by default (one engine replica per node); with
    `engine_cpu_cores` = c of the node's n usable cores, the node holds n // c replicas and each takes that
    fraction of the memory defaults too: at a quarter of the machine each, two replicas' budgets alone would
    be half of it, beside two vLLM KV caches (BENCHMARKS.md: such a node ran out of memory at k=50)."""
    from inferscale_core.vllm_env import usable_cpus

    replicas = len(usable_cpus()) // engine_cpu_cores if engine_cpu_cores else 1
    return 1.0 / max(1, replicas)


class ResidentKV:
    """The facts this replica put into its worker store, least recently used first, and their KV bytes. Over
    `budget_bytes` the least recently used leave (the caller deletes them from the worker store); a fact found
    in the worker store's disk tier, whose size is not known here, counts as the average fact."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the KV budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lru: OrderedDict[tuple[str, str], int] = OrderedDict()
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
            self.bytes += nbytes - self._lru.pop((user_id, kv), 0)
            self._lru[(user_id, kv)] = nbytes
        keep = {(user_id, kv) for kv, _ in items}
        out = []
        for key in list(self._lru):
            if self.bytes <= self.budget_bytes:
                break
            if key not in keep:
                self.bytes -= self._lru.pop(key)
                out.append(key)
        return out

    def discard(self, user_id: str, kvs) -> None:
        for kv in kvs:
            self.bytes -= self._lru.pop((user_id, kv), 0)

    def kvs_of(self, user_id: str) -> list[str]:
        return [kv for u, kv in self._lru if u == user_id]

    def drop_user(self, user_id: str) -> None:
        self.discard(user_id, self.kvs_of(user_id))

    def count(self) -> int:
        return len(self._lru)


def replica_slot() -> int:
    """Serve's rank of this replica in its deployment: a replacement for a dead replica gets its rank, so the
    slot survives restarts (services/routing.py routes users by it); 0 outside Serve."""
    try:
        return int(serve.get_replica_context().rank.rank)
    except Exception:  # noqa: BLE001 - outside Serve (a direct test)
        return 0


def serve_replica_id() -> str | None:
    """Serve's id of this replica (its actor's name ends with it); None outside Serve."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (a direct test)
        return None


def replica_local_rank() -> int:
    """Serve's rank of this replica among the deployment's replicas on its node; 0 outside Serve."""
    try:
        return int(serve.get_replica_context().rank.local_rank)
    except Exception:  # noqa: BLE001 - outside Serve (a direct test)
        return 0


def bind_engine_cpus(cores_per_engine: int) -> list[int] | None:
    """Before vLLM starts (its engine core process inherits the environment): bind its compute threads to this
    replica's own cores when replicas share the node; None, environment untouched, otherwise."""
    from inferscale_core.vllm_env import engine_bind_env, engine_cpus, usable_cpus

    cpus = usable_cpus()
    mine = engine_cpus(cores_per_engine, replica_local_rank(), cpus)
    if mine is None:
        if cores_per_engine:
            log.warning("engine_cpu_cores=%d: no free run of cores for node-local rank %d on cores %s; this "
                        "replica's vLLM uses all of them, shared", cores_per_engine, replica_local_rank(), cpus)
        return None
    os.environ.update(engine_bind_env(mine))
    return mine


def replica_disk_dir(kv_dir: str | None) -> str | None:
    """`{kv_dir}/{app}/{deployment}/slot-{local rank}`: stable across restarts of the replica in that slot,
    so a restarted replica finds its predecessor's files, and never shared by two live replicas."""
    if not kv_dir:
        return None
    try:
        ctx = serve.get_replica_context()
        app, dep, slot = ctx.app_name, ctx.deployment, ctx.rank.local_rank
    except Exception:  # noqa: BLE001 - outside Serve (a direct test): one slot
        app, dep, slot = "local", "EngineReplica", 0
    path = Path(kv_dir).expanduser() / app / dep / f"slot-{slot}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


@contextlib.contextmanager
def _engine_death_is_unavailable():
    """A call that meets a dead vLLM engine is UNAVAILABLE (retryable: check_health has Serve replace this
    replica), not an internal error."""
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        yield
    except EngineDeadError:
        raise ApiError(grpc.StatusCode.UNAVAILABLE, "this engine replica's vLLM engine died; it is being replaced, "
                                                    "retry shortly", retry_after_s=RETRY_AFTER_S) from None


async def start_engine(config: "EngineReplicaConfig", prefix, store_options: dict):
    """The serving engine: vLLM with the injection connector (AsyncInjectingEngine) over the encoder pool's prefix
    chunk, started."""
    from inferscale_core.serving_engine import AsyncInjectingEngine

    from .encoder_pool import dtype_of
    from .metrics import vllm_stat_loggers

    engine = AsyncInjectingEngine(model_path=config.model_path, prefix=prefix, dtype=dtype_of(config.dtype),
                                  block_size=config.block_size, max_model_len=config.max_model_len,
                                  store_options=store_options, stat_loggers=vllm_stat_loggers(),
                                  **config.engine_overrides)
    return await engine.start()


def engine_timings(ans) -> dict[str, float]:
    """vLLM's own per-request hops (its RequestStateStats, engine-core clock): "vllm_queue" queued ->
    scheduled, "prefill" scheduled -> first token (the connector's injection included); "engine_ttft" this
    replica's submit -> first token (the final chunk's ttft_ms)."""
    out = {"engine_ttft": ms(ans.ttft_s or 0.0)}
    st = ans.engine_stats
    if st is not None and st.queued_ts and st.scheduled_ts:
        out["vllm_queue"] = ms(st.scheduled_ts - st.queued_ts)
        if st.first_token_ts:
            out["prefill"] = ms(st.first_token_ts - st.scheduled_ts)
    return out


class _HeldUser:
    """What the multiplexed loader hands Serve. Serve calls __del__ when it evicts the user (LRU); Python
    calls it again when the object dies, hence the flag."""

    def __init__(self, replica: "EngineReplica", user_id: str, loop: asyncio.AbstractEventLoop):
        self.replica, self.user_id, self.loop, self.released = replica, user_id, loop, False

    def __del__(self):
        if self.released:
            return
        self.released = True
        try:  # Serve runs this in a thread: hand the unload to the replica's loop
            asyncio.run_coroutine_threadsafe(self.replica._unload(self.user_id), self.loop)
        except RuntimeError:  # the loop is closed: the replica is going away anyway
            pass


@dataclass(frozen=True)
class EngineReplicaConfig:
    """Everything one engine replica is built from, checked once, here (as Ray Serve LLM's LLMConfig is for its
    build_llm_deployment): a config mistake fails `build_app`, before Serve starts anything.
    services/app.py:ServiceConfig.engine_replica_config() makes it from the service's config."""

    registry_url: str | None = None  # None: an in-process registry (one replica, tests)
    model_path: str | None = None  # None: the packaged SmolLM2-135M-Instruct
    dtype: str = "float32"
    block_size: int = 32
    # Tokens of the longest prompt + answer; None: the model's own context (max_position_embeddings: 8,192 for
    # SmolLM2, so a memory of k=200 facts fits). vLLM's KV cache must hold at least one such sequence.
    max_model_len: int | None = None
    kv_dir: str | None = None  # the worker store's disk tier (node-local); None: none
    store_options: dict = field(default_factory=dict)  # the worker store's byte budgets
    engine_overrides: dict = field(default_factory=dict)  # extra vLLM engine args
    admission_queue_factor: float = DEFAULT_QUEUE_FACTOR
    cluster_store: dict = field(default_factory=dict)  # ClusterConfig fields; empty: no cluster tier
    kv_budget_bytes: int | None = None  # ResidentKV's budget; None: default_kv_budget_bytes(its node share)
    # On a CPU node: the cores this replica's vLLM binds its compute threads to, a run of this many taken by the
    # replica's node-local rank, so engine replicas sharing a node never share a core (inferscale_core/vllm_env.py
    # engine_cpus). 0: every core of the node (one engine replica per node).
    engine_cpu_cores: int = 0

    def __post_init__(self):
        from .encoder_pool import dtype_of, positive_int

        dtype_of(self.dtype)  # names the dtypes there are
        positive_int("block_size", self.block_size)
        if self.max_model_len is not None:
            positive_int("max_model_len", self.max_model_len)
        for name in ("store_options", "engine_overrides", "cluster_store"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a dict, got {type(getattr(self, name)).__name__}")
        check_queue_factor(self.admission_queue_factor)
        if isinstance(self.engine_cpu_cores, bool) or not isinstance(self.engine_cpu_cores, int) \
                or self.engine_cpu_cores < 0:
            raise ValueError(f"engine_cpu_cores must be an int >= 0 (0: every core), got {self.engine_cpu_cores!r}")
        if self.kv_budget_bytes is not None and (isinstance(self.kv_budget_bytes, bool) or
                                                 not isinstance(self.kv_budget_bytes, int) or self.kv_budget_bytes < 0):
            raise ValueError(f"kv_budget_bytes must be an int >= 0 (or None), got {self.kv_budget_bytes!r}")
        self.cluster  # noqa: B018 - ClusterConfig checks its own fields

    @property
    def cluster(self) -> ClusterConfig | None:
        return ClusterConfig.from_dict(self.cluster_store or None)


class ReplicaCore:
    """The engine replica without Serve: user books, the KV tiers in request order, re-encodes, deletes and
    tombstones, answers. Built from its parts (an engine with AsyncInjectingEngine's interface, the encoder pool's
    handle, a registry, the cluster tier), so tests run it with an engine that is not vLLM and without Ray
    (tests/test_replica_core.py); EngineReplica below is the Serve deployment around it."""

    engine_cpus: list[int] | None = None  # the cores its vLLM is bound to, when not every core (bind_engine_cpus)

    def __init__(self, config: EngineReplicaConfig, engine, encoder, registry, cluster: ClusterStore | None = None,
                 disk_dir: str | None = None, metrics=None, disk_budget_bytes: int | None = None):
        """`engine`: started; `encoder`: the encoder pool's handle (`encoder.encode_for.remote(...)` awaited);
        `disk_budget_bytes`: the worker store's disk tier budget, if it has one."""
        from .metrics import EngineMetrics

        self.config = config
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self.engine, self.encoder, self.registry, self.cluster = engine, encoder, registry, cluster
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.disk_dir = disk_dir
        self.max_model_len = engine.max_model_len()  # as vLLM resolved it (the model's own when not given)
        self.admission = Admission(engine.kv_cache_tokens(), config.admission_queue_factor)
        log.info("engine replica %s: KV cache of %d tokens, admitting up to %d tokens in flight", self.replica_id,
                 self.admission.capacity_tokens, self.admission.limit_tokens)
        if self.cluster is not None:
            self.cluster.available  # noqa: B018 - starts connecting in the background
        self._held: dict[str, dict[str, HeldFact]] = {}  # user -> fact_id -> servable fact (registry, last sync)
        # What this replica put into its worker store, within its disk tier's budget (files are written through),
        # so that budget collects facts of users this replica no longer holds before the ones it counts on.
        budget = config.kv_budget_bytes if config.kv_budget_bytes is not None else \
            default_kv_budget_bytes(node_share_of(config.engine_cpu_cores))
        self.resident = ResidentKV(min(budget, disk_budget_bytes or 1 << 62))
        self._reencoding: set[tuple[str, str]] = set()  # (user, kv_id) with a re-encode under way
        # kv_ids the worker store may hold that `resident` does not count: its disk tier's files at start and what
        # a disk tier keeps of users this replica unloaded. A request asks the engine core about these only (one
        # RPC into its step loop); any other fact not in `resident` is known to be absent.
        self._maybe_on_disk: dict[str, set[str]] = {}
        self._synced: dict[str, int] = {}   # user -> registry user_version last synced
        self._pruned: dict[str, int] = {}   # user -> user_version the watch last dropped moved facts for
        self._user_locks: dict[str, asyncio.Lock] = {}
        self._loaded: set[str] = set()  # users _hold registered (outside Serve)
        # facts_from_cluster and facts_unreadable (cluster-tier objects that exist but could not be read: computed)
        # are the worker's own counts (it reads the cluster tier); `stats` reports them beside these.
        self.counters = {"facts_from_disk": 0, "facts_encoded": 0, "facts_recomputed": 0,
                         "facts_pushed": 0, "users_loaded": 0, "users_evicted": 0, "facts_unservable": 0,
                         "facts_dropped_by_watch": 0, "facts_evicted": 0, "facts_stale_pushes": 0,
                         "tombstones_applied": 0, "facts_put_failed": 0}
        self._bytes_per_token: int | None = None  # the worker store's KV bytes per token (asked once)
        self._tomb_cursor: str | None = None
        self._tasks: set[asyncio.Task] = set()  # background work (re-encodes, puts settling)

    async def start(self) -> "ReplicaCore":
        """Tombstones (registry deletes and updates) are applied from where this slot's last replica stopped (its
        cursor is on the disk tier, next to the files it covers), before any request; without a saved cursor
        (no disk tier, a new slot) from the log's end: this replica holds nothing older."""
        self._tomb_cursor = self._saved_tomb_cursor() or (
            await asyncio.to_thread(self.registry.tombstones_after, None))[1]
        await asyncio.to_thread(self._save_tomb_cursor)
        await self._apply_tombstones()
        if self.disk_dir:
            self._maybe_on_disk = {u: set(kvs) for u, kvs in (await self.engine.list_encoded()).items()}
        return self

    # ------------------------------------------------------------------------------ user placement
    async def register_user(self, user_id: str) -> None:
        """Records in the registry that this replica holds the user."""
        await asyncio.to_thread(self.registry.add_placement, user_id, self.replica_id)
        self.counters["users_loaded"] += 1

    async def _hold(self, user_id: str) -> None:
        """Holds the user here before serving it, once (the Serve deployment: through Serve's multiplexed loader,
        which unloads least recently used users)."""
        if user_id not in self._loaded:
            self._loaded.add(user_id)
            await self.register_user(user_id)

    def _lock(self, user_id: str) -> asyncio.Lock:
        return self._user_locks.setdefault(user_id, asyncio.Lock())

    async def _sync(self, user_id: str) -> dict[str, HeldFact]:
        """The registry's servable facts of the user at their versions (texts and windows), no KV; drops the
        KV of facts deleted or moved on. One registry read (the version counter) when nothing moved."""
        async with self._lock(user_id):
            held = self._held.setdefault(user_id, {})
            changes = await asyncio.to_thread(user_changes, self.registry, user_id, self._synced.get(user_id),
                                              held_versions(held))
            if changes is None:
                return held
            await self._drop(user_id, held, changes.gone)
            for r in changes.fresh:  # a version known to be bad is left out
                if not r.unservable_reason:
                    held[r.fact_id] = HeldFact(r.version, r.text, tuple(r.window))
            self._synced[user_id] = changes.version
            self._pruned.pop(user_id, None)
            # A user's placement is dropped with its facts (DeleteUser): say again that this replica holds it.
            await asyncio.to_thread(self.registry.add_placement, user_id, self.replica_id)
            return held

    async def _fetch_kv(self, user_id: str, facts: list[tuple[str, HeldFact]]) -> tuple[dict[str, float], list[str]]:
        """Makes these facts' KV reachable for the request. Facts this replica knows the worker store holds are
        used as they are. With a cluster tier the others are left to the worker, which reads them itself when
        the request arrives (returned: the kv_ids it will load; the request is sent with `fetch`); without one
        they are encoded now and put into the worker store (after a look at its disk tier). Returns the time of
        each step taken, in ms (`kv_fetch_*` hops of the answer's timings), and the kv_ids left to the worker."""
        steps: dict[str, float] = {}
        t = time.perf_counter()

        def step(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            steps[name] = ms(now - t)
            t = now

        async with self._lock(user_id):
            step("kv_fetch_lock")
            self.resident.touch(user_id, [kv_id(f, h.version) for f, h in facts])
            todo = [(f, h) for f, h in facts if not self.resident.has(user_id, kv_id(f, h.version))]
            if not todo:
                return steps, []
            if self.cluster is not None:
                # The worker looks in its own tiers (memory, disk) and then the cluster tier: nothing to ask it
                # or move from here.
                kvs = [kv_id(f, h.version) for f, h in todo]
                self._maybe_on_disk.get(user_id, set()).difference_update(kvs)
                return steps, kvs
            maybe = self._maybe_on_disk.get(user_id, set())
            ask = [kv_id(f, h.version) for f, h in todo if kv_id(f, h.version) in maybe]
            if ask:  # the disk tier may have them: the worker store says which it still holds
                present = set(kv for kv, ok in zip(ask, await self.engine.has_encoded(user_id, ask)) if ok)
                maybe.difference_update(ask)  # counted in `resident` now, or known to be gone
                await self._evict(self.resident.add(user_id, [(kv, None) for kv in ask if kv in present]))
                self.counters["facts_from_disk"] += len(present)
                step("kv_fetch_disk_check")
                todo = [(f, h) for f, h in todo if kv_id(f, h.version) not in present]
                if not todo:
                    return steps, []
            await self._encode_and_put(user_id, todo)
            step("kv_fetch_encode")
            return steps, []

    def _book_fetched(self, user_id: str, params, kvs: list[str]) -> None:
        """Counts the facts the worker loads for this request as resident (their bytes from their token counts),
        so later requests use them as they are; the least recently used leave the worker store in the
        background. A fact the load finds nowhere leaves the books again (`requeue_missing`)."""
        if not kvs or params is None:
            return
        if self._bytes_per_token is None:
            self._bytes_per_token = self.engine.kv_bytes_per_token()
        tokens = dict(zip(params.kv_ids, params.chunk_lens or ()))
        self._book(user_id, [(kv, tokens[kv] * self._bytes_per_token if kv in tokens else None) for kv in kvs])

    def _book(self, user_id: str, items: list[tuple[str, int | None]]) -> None:
        """Counts `(kv_id, bytes or None)` the worker loads as resident; what the budget pushes out leaves the
        worker store in the background."""
        evicted = self.resident.add(user_id, items)
        if evicted:
            self._background(self._evict(evicted))

    async def requeue_missing(self) -> int:
        """Facts the worker's loads found in no tier (evicted from the cluster tier, never written, Mooncake away)
        leave the books, and ONE re-encode of each still-held version is queued (it writes the cluster tier; the
        next request that names the fact loads it). Facts it found absent from its store but maybe elsewhere (a
        copy on a dead node's segment, until the master drops it) only leave the books: the next request asks
        the worker to load them again. Runs every watch round and before `stats`; returns how many were missing."""
        lacking = await self.engine.take_missing()
        for user_id, kvs in lacking.get("absent", {}).items():
            self.resident.discard(user_id, kvs)
        n = 0
        for user_id, kvs in lacking.get("missing", {}).items():
            self.resident.discard(user_id, kvs)
            n += len(kvs)
            held = self._held.get(user_id, {})
            todo = []
            for kv in kvs:
                f = kv.rpartition("@v")[0]
                h = held.get(f)
                if h is not None and kv_id(f, h.version) == kv:  # the version still held, not an older one
                    todo.append((f, h))
            self._queue_reencode(user_id, todo)
        self.counters["facts_recomputed"] += n
        return n

    def _queue_reencode(self, user_id: str, facts: list[tuple[str, HeldFact]]) -> None:
        """One background re-encode per fact version, however many requests miss it meanwhile."""
        fresh = [(f, h) for f, h in facts if (user_id, kv_id(f, h.version)) not in self._reencoding]
        if not fresh:
            return
        self._reencoding.update((user_id, kv_id(f, h.version)) for f, h in fresh)

        async def run():
            try:
                async with self._lock(user_id):
                    held = self._held.get(user_id, {})
                    current = [(f, h) for f, h in fresh if held.get(f) == h]  # not moved on meanwhile
                    if current:
                        await self._encode_and_put(user_id, current)
            except Exception:  # noqa: BLE001 - the next request that needs the fact queues it again
                log.exception("re-encoding %d facts of a user failed", len(fresh))
            finally:
                self._reencoding.difference_update((user_id, kv_id(f, h.version)) for f, h in fresh)

        self._background(run())

    async def _encode_and_put(self, user_id: str, facts: list[tuple[str, HeldFact]]) -> None:
        """Encodes facts from the registry's text and window. With a cluster tier the pool writes them there
        (StoredKV) and the worker loads them when a request names them; without one they are put into the worker
        store. Call under the user's lock."""
        encoded = await self.encoder.encode_for.remote(
            user_id, [(f, h.version, h.text, list(h.window)) for f, h in facts])
        fresh = await self._current(user_id, [(f, h.version) for f, h in facts])
        facts, encoded = [fh for fh, ok in zip(facts, fresh) if ok], [e for e, ok in zip(encoded, fresh) if ok]
        good = []
        for (f, h), e in zip(facts, encoded):
            if isinstance(e, EncodeFailure) and e.transient:  # the encoder failed, not the fact: not served this
                # time (vLLM computes it); it is not held, so the next request that names it tries again
                log.warning("fact %s v%d of a user failed to encode for now: %s", f, h.version, e.reason)
            elif isinstance(e, EncodeFailure):  # only a deterministic failure is for good
                log.warning("fact %s v%d of a user cannot be encoded: %s", f, h.version, e.reason)
                await asyncio.to_thread(self.registry.set_unservable, user_id, f, h.version, e.reason)
                self._held.get(user_id, {}).pop(f, None)
                self.counters["facts_unservable"] += 1
            elif isinstance(e, StoredKV):
                pass  # in the cluster tier: the worker loads it for the next request that names it
            else:
                good.append((f, h.version, e))
        if good:
            await self._put(user_id, [(f, v) for f, v, _ in good], [e for _, _, e in good], ahead=True)
        self.counters["facts_encoded"] += sum(not isinstance(e, EncodeFailure) for e in encoded)

    async def _current(self, user_id: str, facts: list[tuple[str, int]]) -> list[bool]:
        """Whether each (fact, version) is still the registry's; for one that is not, the cluster object its
        encode just wrote (after the newer version's write removed the older ones: two updates racing, or a
        re-encode racing an update) is removed, and the caller never stores it: a put never replaces, or
        outlives, a newer version. One registry read."""
        current = await asyncio.to_thread(self.registry.find_many, user_id, [f for f, _ in facts])
        fresh = [f in current and current[f].version == v for f, v in facts]
        for (f, v), ok in zip(facts, fresh):
            if not ok and self.cluster is not None:
                await asyncio.to_thread(self.cluster.remove_versions, user_id, f, v + 1)
        return fresh

    async def _drop(self, user_id: str, held: dict[str, HeldFact], fact_ids: list[str]) -> int:
        """Drops these held facts (deleted, or at another version now) from the books and the worker store."""
        if fact_ids:
            ids = [kv_id(f, held[f].version) for f in fact_ids]
            await self.engine.delete_encoded(user_id, ids)
            self.resident.discard(user_id, ids)
            for f in fact_ids:
                del held[f]
        return len(fact_ids)

    async def _put(self, user_id: str, facts: list[tuple[str, int]], encoded: list, ahead: bool = False) -> None:
        """`facts`: (fact_id, version) of each EncodedFact. Chunked: each call into the engine core holds up its
        step loop (every user's decoding) for as long as it runs. Older versions leave the worker store.

        `ahead`: a request that needs these facts is sent next. Returns once the puts are sent
        (AsyncInjectingEngine.send_put: the engine core runs them before it adds that request), not answered,
        which saves the request a step of the engine's loop; their replies, the older versions' delete and the
        byte budget's evictions are settled in the background. A put that fails there is logged and counted
        (`facts_put_failed`), its facts forgotten here: the request computes them (vLLM's failed-load path), the
        next one that names them fetches them again."""
        if len(facts) != len(encoded):
            raise ValueError(f"{len(facts)} fact ids but {len(encoded)} encoded facts")
        items = [(kv_id(f, v), enc) for (f, v), enc in zip(facts, encoded)]
        replies = [await self.engine.send_put(user_id, chunk)
                   for chunk in put_chunks(items, [enc.num_tokens for enc in encoded])]
        old = [i for f, v in facts for i in older_kv_ids(f, v)]
        self.resident.discard(user_id, old)
        evicted = self.resident.add(user_id, [(i, enc.nbytes) for i, enc in items])

        async def settle() -> None:
            try:
                for reply in replies:
                    await reply
            except BaseException:
                self.resident.discard(user_id, [i for i, _ in items])
                with contextlib.suppress(Exception):  # the facts the books let go for these still leave the store
                    await self._evict(evicted)
                raise
            if old:
                await self.engine.delete_encoded(user_id, old)
            await self._evict(evicted)

        if not ahead:
            return await settle()

        async def settle_in_background() -> None:
            try:
                await settle()
            except Exception:  # noqa: BLE001 - the request computes what is missing; nothing to answer to
                self.counters["facts_put_failed"] += len(items)
                log.exception("putting %d facts of a user into the worker store failed", len(items))

        self._background(settle_in_background())

    def _background(self, work) -> None:
        """Runs `work` as a task this replica keeps a reference to until it ends (asyncio keeps only a weak one)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _evict(self, keys: list[tuple[str, str]]) -> None:
        """Deletes from the worker store (memory and disk) the facts the byte budget pushed out; a later request
        that names one reads it again (cluster tier or encoder)."""
        by_user: dict[str, list[str]] = {}
        for u, kv in keys:
            by_user.setdefault(u, []).append(kv)
        for u, kvs in by_user.items():
            await self.engine.delete_encoded(u, kvs)
        self.counters["facts_evicted"] += len(keys)

    async def _unload(self, user_id: str) -> None:
        """LRU eviction. With a disk tier the worker store keeps the facts (its byte budgets decide what stays
        in memory) and a reload finds them there; without one they are dropped and re-encoded on reload."""
        async with self._lock(user_id):
            # The disk tier keeps them: a reload asks the worker store, whose budgets may have dropped some since.
            kept = (self._maybe_on_disk.get(user_id, set()).union(self.resident.kvs_of(user_id))
                    if self.disk_dir else set())
            if not self.disk_dir:
                await self.engine.delete_encoded(user_id, None)
            self._forget_books(user_id)
            if kept:
                self._maybe_on_disk[user_id] = kept
        self._loaded.discard(user_id)
        self.counters["users_evicted"] += 1
        await asyncio.to_thread(self.registry.remove_placement, user_id, self.replica_id)

    def _forget_books(self, user_id: str) -> None:
        for books in (self._held, self._synced, self._pruned, self._maybe_on_disk):
            books.pop(user_id, None)
        self.resident.drop_user(user_id)

    # ------------------------------------------------------------------------------ the watch
    async def _watch(self) -> None:
        """Every WATCH_PERIOD_S: the version counters of the users held here, in one read; a user whose counter
        moved loses the KV of its deleted or changed facts now, not at its next request (which re-syncs)."""
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            try:
                await self._watch_once()
            except Exception as e:  # noqa: BLE001 - Redis away for a moment: the next round tries again
                log.warning("watch of held users failed: %s", e)

    async def _watch_once(self) -> None:
        try:
            await self.requeue_missing()
        except Exception as e:  # noqa: BLE001 - the engine is check_health's business; the next round asks again
            log.warning("asking the worker for facts it found nowhere failed: %s", e)
        await self._apply_tombstones()
        users = list(self._synced)
        if not users:
            return
        versions = await asyncio.to_thread(self.registry.user_versions, users)
        for user_id, version in zip(users, versions):
            if self._synced.get(user_id, version) != version and self._pruned.get(user_id) != version:
                await self._prune(user_id, version)

    async def _prune(self, user_id: str, version: int) -> None:
        async with self._lock(user_id):
            held = self._held.get(user_id)
            if held is None or self._synced.get(user_id) == version:  # unloaded or re-synced meanwhile
                return
            wanted = await asyncio.to_thread(self.registry.fact_versions, user_id)
            self.counters["facts_dropped_by_watch"] += await self._drop(
                user_id, held, moved_facts(held_versions(held), wanted))
            self._pruned[user_id] = version

    # ------------------------------------------------------------------------------ tombstones
    def _saved_tomb_cursor(self) -> str | None:
        path = Path(self.disk_dir) / TOMBSTONE_CURSOR if self.disk_dir else None
        return path.read_text().strip() or None if path is not None and path.is_file() else None

    def _save_tomb_cursor(self) -> None:
        if self.disk_dir:
            path = Path(self.disk_dir) / TOMBSTONE_CURSOR
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(self._tomb_cursor)
            os.replace(tmp, path)

    async def _apply_tombstones(self) -> int:
        """Removes what the registry's tombstones written since this replica's cursor name, from this replica's
        tiers (memory, disk: held users, users it evicted, users it held before a restart) and, for deletes,
        from the cluster tier (every replica does: one that was down at the time may be the only one left)."""
        applied = 0
        while True:
            tombs, cursor = await asyncio.to_thread(self.registry.tombstones_after, self._tomb_cursor)
            for t in tombs:
                await self._bury(t)
            self._tomb_cursor = cursor
            if not tombs:
                break
            applied += len(tombs)
            await asyncio.to_thread(self._save_tomb_cursor)
        self.counters["tombstones_applied"] += applied
        return applied

    async def _bury(self, t) -> None:
        async with self._lock(t.user_id):
            if not t.fact_id:  # DeleteUser
                self._forget_books(t.user_id)
                await self.engine.delete_encoded(t.user_id, None)
                if self.cluster is not None:
                    await asyncio.to_thread(self.cluster.remove_user, t.user_id)
                return
            ids = [kv_id(t.fact_id, v) for v in range(1, t.upto + 1)]
            held = self._held.get(t.user_id, {})
            if t.fact_id in held and held[t.fact_id].version <= t.upto:  # the next request re-syncs the user
                del held[t.fact_id]
                self._synced.pop(t.user_id, None)
            self.resident.discard(t.user_id, ids)
            await self.engine.delete_encoded(t.user_id, ids)
            if t.gone and self.cluster is not None:  # an update's older versions: the encoder pool removes them
                await asyncio.to_thread(self.cluster.remove_versions, t.user_id, t.fact_id)

    # ------------------------------------------------------------------------------ called by the gateway
    async def put_facts(self, user_id: str, facts: list[tuple[str, int, str]], encoded: list) -> int:
        """`facts`: (fact_id, version, text) of each new fact. `encoded` arrives resolved from the object store
        (the encoder's response, passed on unresolved): StoredKV (in the cluster tier: nothing to move now) or
        EncodedFact (put into the worker store). All or nothing: if the encoder failed on any fact, nothing is
        stored and the error names it."""
        with self.metrics.request("put_facts"), _engine_death_is_unavailable():
            facts = [(f, int(v), str(t)) for f, v, t in facts]
            for i, enc in enumerate(encoded):
                if isinstance(enc, EncodeFailure):
                    raise ApiError(grpc.StatusCode.UNAVAILABLE if enc.transient else grpc.StatusCode.INVALID_ARGUMENT,
                                   f"facts[{i}] could not be encoded: {enc.reason}; nothing was stored"
                                   + ("; retry shortly" if enc.transient else ""), field=f"facts[{i}].text",
                                   retry_after_s=RETRY_AFTER_S if enc.transient else None)
            async with self._lock(user_id):
                self._held.setdefault(user_id, {})  # held here from now on; its books fill at the next sync
                fresh = await self._current(user_id, [(f, v) for f, v, _ in facts])
                local = [((f, v), e) for (f, v, _), e, ok in zip(facts, encoded, fresh)
                         if ok and not isinstance(e, StoredKV)]
                if local:
                    await self._put(user_id, [fv for fv, _ in local], [e for _, e in local])
                self.counters["facts_stale_pushes"] += fresh.count(False)
            self.counters["facts_pushed"] += len(encoded)
            await self._hold(user_id)  # registers the user here (Serve routes its requests to this replica)
            return len(encoded)

    async def forget(self, user_id: str, facts: list[tuple[str, int]]) -> int:
        """Deleted facts `(fact_id, last version)`: every version of each leaves the worker store (and disk)
        and the cluster tier."""
        with self.metrics.request("forget"):
            async with self._lock(user_id):
                ids = [i for f, v in facts for i in (*older_kv_ids(f, v), kv_id(f, v))]
                held = self._held.get(user_id, {})
                for f, _ in facts:
                    held.pop(f, None)
                self.resident.discard(user_id, ids)
                if self.cluster is not None:
                    for f, _ in facts:
                        await asyncio.to_thread(self.cluster.remove_versions, user_id, f)
                return await self.engine.delete_encoded(user_id, ids)

    async def forget_user(self, user_id: str) -> int:
        with self.metrics.request("forget_user"):
            async with self._lock(user_id):
                self._forget_books(user_id)
                if self.cluster is not None:
                    await asyncio.to_thread(self.cluster.remove_user, user_id)
                return await self.engine.delete_encoded(user_id, None)

    async def answer(self, user_id: str, query: str, fact_ids: list[str], max_tokens: int, temperature: float,
                     mode: Mode, conversation: list[dict] | None = None, openai: dict | None = None):
        """Streams AnswerPiece messages, then one AnswerEnd with TTFT, the injected fact ids and `timings_ms`
        (this replica's hops; services/messages.py). `conversation`: system messages and earlier turns, after the
        memory in the chat template. Refused with RESOURCE_EXHAUSTED (EngineAtCapacity) when the KV cache is full.
        `openai`: an OpenAI chat request's parts (services/openai_params.py): "sampling" (its sampling fields,
        which replace max_tokens and temperature), "messages" (its turns, the question at "question_index") and
        "tools"; pieces then carry the choice "index" and OpenAI "logprobs", and the final one "choices"."""
        from vllm import SamplingParams

        from inferscale_core.requests import Query

        t_in = time.perf_counter()
        with self.metrics.request("answer"), _engine_death_is_unavailable():
            mode = Mode(mode)  # ValueError naming the value for anything else
            await self._hold(user_id)
            held = await self._sync(user_id)  # one read of the version counter when nothing moved
            t_synced = time.perf_counter()
            # Retrieval may name a fact deleted since, or one that cannot be served: it is not held, skipped.
            # Both modes serve the same facts (an A/B of injection).
            facts = [(f, held[f]) for f in fact_ids if f in held]
            fetch_steps, fetched = {}, []
            if mode == Mode.KV:
                fetch_steps, fetched = await self._fetch_kv(user_id, facts)
                # A fact the encoder just found it cannot encode (stored by an older version) is no longer held:
                # left out, as the sync used to leave it out before the request.
                facts = [(f, h) for f, h in facts if held.get(f) == h]
            hops = {"user_sync": ms(t_synced - t_in), "kv_fetch": ms(time.perf_counter() - t_synced), **fetch_steps}
            if openai is not None:
                turns, at = openai.get("messages") or [], openai.get("question_index", 0)
                conversation, after, tools = turns[:at], turns[at + 1:], openai.get("tools") or ()
            else:
                after, tools = (), ()
            q = Query(user_id, query, k=max(1, len(facts)), mode=mode,
                      conversation=tuple(conversation or ()), tools=tuple(tools), after=tuple(after))
            try:
                # Tokenizing (up to 100 messages of 16,000 characters, sized by the gateway) runs in a worker
                # thread: this replica's other streams keep going.
                p = await asyncio.to_thread(self.engine.prepare_facts, q, [f for f, _ in facts],
                                            [h.text for _, h in facts], [h.version for _, h in facts],
                                            [kv_id(f, h.version) for f, h in facts])
            except ValueError as e:  # the chat template refused the conversation
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            if fetched and p.params is not None:  # the worker loads these itself, asynchronously
                p.params = dataclasses.replace(p.params, fetch=True)
                self._book_fetched(user_id, p.params, fetched)
            if len(p.prompt_ids) >= self.max_model_len:
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"the prompt is {len(p.prompt_ids)} tokens (memory, conversation and query); the "
                               f"model's context is {self.max_model_len} tokens: send fewer or shorter messages")
            if openai is not None:
                async for piece in self._answer_openai(p, openai, mode, t_in, hops):
                    yield piece
                return
            sp = SamplingParams(temperature=temperature, max_tokens=max_tokens)
            with self.admission.admit(min(len(p.prompt_ids) + max_tokens, self.max_model_len)):
                t_submit = time.perf_counter()
                async for text, ans in self.engine.stream(p, sp):
                    if ans is None:
                        yield AnswerPiece(text)
                        continue
                    if ans.ttft_s is not None:
                        self.metrics.ttft.observe(ans.ttft_s, tags={"mode": wire_mode(mode)})
                    yield AnswerEnd(fact_ids=list(ans.fact_ids), ttft_ms=(ans.ttft_s or 0.0) * 1000,
                                    prompt_tokens=ans.prompt_len,
                                    prefilled_tokens=ans.prompt_len - ans.num_cached_tokens,
                                    completion_tokens=len(ans.token_ids),
                                    finish_reason=ans.finish_reason or "stop",
                                    timings_ms={**hops, "admission_wait": ms(t_submit - t_in), **engine_timings(ans)})

    async def _answer_openai(self, p, openai: dict, mode: Mode, t_in: float, hops: dict[str, float]):
        """An OpenAI chat request's answer: vLLM's SamplingParams from the request (n choices, logprobs, stop,
        structured outputs, forced tool calls), streamed by choice."""
        from .openai_params import logprobs_content, request, tool_calls

        defaults = self.engine.engine.model_config.get_diff_sampling_param()  # the model's generation_config
        req = request(openai.get("sampling") or {}, len(p.prompt_ids), self.max_model_len, defaults)
        sp, n = req.sampling, req.sampling.n
        tokenizer = self.engine.core.template.tokenizer
        texts, counts, finish = [""] * n, [0] * n, [None] * n
        with self.admission.admit(min(len(p.prompt_ids) + n * sp.max_tokens, n * self.max_model_len)):
            t_submit = time.perf_counter()
            ttft, final = None, None
            try:
                async for out in self.engine.engine.generate(p.prompt(), p.sampling(sp), request_id=uuid.uuid4().hex):
                    final = out
                    for c in out.outputs:
                        if ttft is None and c.token_ids:
                            ttft = time.perf_counter() - t_submit
                        logprobs = (logprobs_content(c.token_ids, c.logprobs, req.top_logprobs, tokenizer)
                                    if req.top_logprobs is not None and c.logprobs else None)
                        texts[c.index] += c.text
                        counts[c.index] += len(c.token_ids)
                        finish[c.index] = c.finish_reason or finish[c.index]
                        if c.text or logprobs is not None:
                            yield AnswerPiece(c.text, c.index, logprobs)
            except ValueError as e:  # vLLM's input checks (e.g. more logprobs than the engine's max_logprobs)
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(e).splitlines()[0][:500]) from None
        if ttft is not None:
            self.metrics.ttft.observe(ttft, tags={"mode": wire_mode(mode)})
        choices = []
        for i in range(n):
            reason = finish[i] or "stop"
            calls = tool_calls(texts[i], req.tool_choice) if req.tool_choice is not None else None
            if calls is not None and req.tool_choice == "required":
                reason = "tool_calls"
            choices.append(Choice(i, reason, counts[i], calls))
        stats = SimpleNamespace(ttft_s=ttft, engine_stats=getattr(final, "metrics", None))  # engine_timings' view
        yield AnswerEnd(fact_ids=list(p.fact_ids), ttft_ms=(ttft or 0.0) * 1000, prompt_tokens=len(p.prompt_ids),
                        prefilled_tokens=len(p.prompt_ids) - ((final.num_cached_tokens or 0) if final else 0),
                        completion_tokens=sum(counts), finish_reason=choices[0].finish_reason, choices=choices,
                        max_tokens=sp.max_tokens,
                        timings_ms={**hops, "admission_wait": ms(t_submit - t_in), **engine_timings(stats)})

    async def chat(self, messages: list[dict], max_tokens: int = 256, temperature: float = 0.0,
                   structured: dict | None = None) -> str:
        """Plain chat generation with the serving model, no memory (Mem0's extraction step). `structured`:
        the fields of vLLM's StructuredOutputsParams (json_object, json, regex, ...). Admitted like answers:
        it shares the KV cache with them."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        with _engine_death_is_unavailable():
            sp = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                structured_outputs=StructuredOutputsParams(**structured) if structured else None)
            prompt_len = len((await asyncio.to_thread(self.engine.core.chat_prompt, messages))["prompt_token_ids"])
            with self.admission.admit(min(prompt_len + max_tokens, self.max_model_len)):
                text, _, _ = await self.engine.chat(messages, sp)
            return text

    async def chat_room(self, messages: list[dict]) -> int:
        """Tokens left in the context after these messages (negative when they do not fit)."""
        return self.max_model_len - len((await asyncio.to_thread(self.engine.core.chat_prompt, messages))["prompt_token_ids"])

    async def load_user(self, user_id: str) -> str:
        """Loads the user onto THIS replica (whichever one Serve routed the call to; admin and tests: put a user
        on several replicas, warm a replica), every fact's KV fetched into its worker store (requests fetch only
        their k). Returns this replica's id."""
        await self._hold(check_id("user_id", user_id))
        held = await self._sync(user_id)
        _, fetched = await self._fetch_kv(user_id, list(held.items()))
        if fetched:  # the worker reads them from the cluster tier in the background (ids only cross)
            await self.engine.prefetch(user_id, fetched)
            self._book(user_id, [(kv, None) for kv in fetched])
        return self.replica_id

    async def holds(self, user_id: str, facts: list[tuple[str, int]], with_replica: bool = False):
        """Whether the worker store holds each `(fact_id, version)`: the KV side of a fact, for checks.
        `with_replica`: {"replica_id": this replica, "holds": [...]} (a check across several replicas)."""
        held = await self.engine.has_encoded(user_id, [kv_id(f, v) for f, v in facts])
        return {"replica_id": self.replica_id, "holds": held} if with_replica else held

    # ------------------------------------------------------------------------------ observability
    async def stats(self) -> dict:
        """This replica's counters, the users it holds, and the engine's (vLLM + worker store) metrics; the facts
        the worker found nowhere are re-queued first, so `facts_recomputed` counts them."""
        await self.requeue_missing()
        engine = await self.engine.metrics()
        worker = engine.get("worker") or {}
        loads = {"facts_from_cluster": int(worker.get("fetched_facts", 0)),
                 "facts_unreadable": int(worker.get("fetch_unreadable", 0))}
        return {"replica_id": self.replica_id, "pid": os.getpid(), "disk_dir": self.disk_dir, "slot": replica_slot(),
                "serve_replica_id": serve_replica_id(), "engine_cpus": self.engine_cpus,
                "users": sorted(self._held), **self.counters, **loads, "admission": self.admission.stats(),
                "cluster": dict(self.cluster.counters) if self.cluster is not None else None,
                "resident": {"facts": self.resident.count(), "bytes": self.resident.bytes,
                             "budget_bytes": self.resident.budget_bytes},
                "engine": engine}

    async def health(self) -> str:
        await self.engine.has_encoded("__health__", ["probe"])  # a round trip to the engine's worker
        await asyncio.to_thread(self.registry.ping)
        return "ok"


class EngineReplica(ReplicaCore):
    """The Serve deployment (options in services/app.py): builds its parts from one EngineReplicaConfig, and adds
    what only Serve needs: the multiplexed user loader, the routing hooks, the health check, metrics export.
    `build_engine`: how the engine is made (default `start_engine`: vLLM with the connector)."""

    async def __init__(self, encoder, config: EngineReplicaConfig, build_engine=None):
        from inferscale_core.defaults import serving_store_options
        from inferscale_core.store import default_disk_budget_bytes

        from .metrics import EngineMetrics, hide_multiplexed_ids

        hide_multiplexed_ids()  # before the first @serve.multiplexed call: user ids never become labels
        disk_dir = replica_disk_dir(config.kv_dir)
        options = serving_store_options(config.store_options)
        if disk_dir:
            options["disk_dir"] = disk_dir
            if options.get("disk_budget_bytes") is None:  # the disk tier's budget: from the machine by default
                options["disk_budget_bytes"] = default_disk_budget_bytes(disk_dir)
        self.engine_cpus = bind_engine_cpus(config.engine_cpu_cores)
        # The cluster KV tier, under the encoder pool's fingerprint (the pool defines how facts are encoded): the
        # connector's worker reads it (a client of its own); this process only removes from it.
        cluster_config = config.cluster
        fingerprint = await encoder.fingerprint.remote() if cluster_config else None
        if cluster_config:
            options["cluster_store"] = dataclasses.asdict(cluster_config)
            options["kv_fingerprint"] = fingerprint
        # The instruction prefix is encoded by the pool that encodes the facts: one encoder, one layout.
        engine = await (build_engine or start_engine)(config, await encoder.prefix.remote(), options)
        cluster = ClusterStore(cluster_config, fingerprint) if cluster_config else None
        super().__init__(config, engine, encoder, open_registry(config.registry_url), cluster, disk_dir,
                         EngineMetrics(), options.get("disk_budget_bytes"))
        await self.start()
        loop = asyncio.get_running_loop()
        self._exporter = loop.create_task(self._export_engine_metrics())
        self._watcher = loop.create_task(self._watch())

    def record_replica_metadata(self) -> dict:
        """Serve's hook (once, at start): this replica's stable slot for services/routing.py."""
        return {SLOT: replica_slot()}

    def record_routing_stats(self) -> dict:
        """Serve's hook (every request_routing_stats_period_s): the slot again (in case Serve re-ranked) and the
        requests in flight here, from every router (services/routing.py moves users off a busy home)."""
        return {SLOT: replica_slot(), IN_FLIGHT: self.admission.in_flight}

    @serve.multiplexed(max_num_models_per_replica=MAX_USERS)
    async def _user(self, user_id: str) -> _HeldUser:
        """Serve's loader, run under ONE lock for the whole replica: it only registers the user. Its facts are
        synced by `_sync`, under the user's own lock."""
        await self.register_user(user_id)
        return _HeldUser(self, user_id, asyncio.get_running_loop())

    async def _hold(self, user_id: str) -> None:
        await self._user(user_id)

    async def check_health(self) -> None:
        """Serve's replica health check (every health_check_period_s): a replica whose vLLM engine died (its
        engine-core process is gone) raises here, so Serve replaces it and its users move to a live one."""
        engine = self.engine.engine
        if engine is None:
            raise RuntimeError("the vLLM engine of this replica is not running")
        await engine.check_health()  # raises EngineDeadError once vLLM has seen its engine core die

    async def _export_engine_metrics(self, period_s: float = 5.0) -> None:
        """Copies the engine's counters (injected tokens, store hits and resident bytes per tier) into the
        replica's Prometheus metrics."""
        while True:
            try:
                self.metrics.engine_snapshot(await self.engine.metrics())
            except Exception as e:  # noqa: BLE001 - a dead engine is check_health's business
                log.debug("engine metrics unavailable: %s", e)
            await asyncio.sleep(period_s)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
