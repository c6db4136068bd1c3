"""The engine replica's logic (services/engine_replica.py ReplicaCore) without vLLM and without Ray: what a request
leaves to the worker (its facts not known resident, loaded by the worker from the cluster tier), its counters, a
miss computed by vLLM with one re-encode queued, updates and deletes reaching every tier, tombstones a replica
that was down applies at start.

Real parts: the encoder (EncoderCore over a FactEncoder on a tiny random Llama with SmolLM2's tokenizer: real
pre-RoPE KV, milliseconds per fact), the registry (EmbeddedRegistry, the one `inferscale serve` uses without
Redis) and the cluster tier (a Mooncake Store on loopback). The engine is `DictEngine`: AsyncInjectingEngine's
interface over a dict, standing in for vLLM and its worker store, which loads a `fetch` request's missing facts
from the cluster tier as the connector's worker does (the injection and the worker's asynchronous load are tested
against real vLLM in test_connector*.py, and through the service in test_kv_tier_service.py). Seconds, not
minutes.
"""
from __future__ import annotations

import asyncio
import dataclasses
import types
from pathlib import Path

import pytest
from support.mooncake_fixture import raw_client

from inferscale_core.connector_types import injectable_tokens
from inferscale_core.types import Mode, kv_id
from inferscale_server.messages import AnswerRequest, FactRef, FactWrite

USER = "alice"
FACTS = {"f1": "Alice has a cat named Tom.", "f2": "Alice moved to Lisbon in 2021.", "f3": "Alice speaks Finnish."}


class DictEngine:
    """The serving engine's interface (AsyncInjectingEngine: the worker store's put/has/delete, request
    preparation, streaming) over a dict instead of vLLM. Requests are prepared by the real RequestCore. A request
    with `fetch` set has the facts the store lacks read from `cluster` first, as the connector's worker does
    (counted as `fetched_facts`; one found nowhere is listed for take_missing, one listed but unreadable is not);
    a streamed answer reports the memory as injected when every chunk it names is in the store then, else
    prefilled (vLLM's failed-load recompute)."""

    def __init__(self, template, prefix, capacity_tokens: int = 8192, cluster=None):
        from inferscale_core.requests import RequestCore

        self.core = RequestCore(template, prefix)
        self.prefix = prefix
        self.chats: list[bool] = []  # each plain chat's `background`
        self.store = {("__inferscale_shared__", self.core.prefix_id): prefix}
        self.capacity_tokens = capacity_tokens
        self.cluster = cluster
        self.puts = 0  # calls that put KV
        self.asked: list[list[str]] = []  # the kv_ids of each has_encoded call (an RPC into vLLM's step loop)
        self.worker = {"fetched_facts": 0, "fetch_unreadable": 0}
        self.missing: dict[str, set[str]] = {}
        self.absent: dict[str, set[str]] = {}

    def kv_bytes_per_token(self) -> int:
        return self.prefix.nbytes // self.prefix.num_tokens

    async def _fetch(self, user_id, kv_ids) -> bool:
        """The worker's load: True when every fact is in the store afterwards."""
        need = [kv for kv in kv_ids if (user_id, kv) not in self.store]
        if not need:
            return True
        got = await asyncio.to_thread(self.cluster.read, user_id, need)
        for kv, fact, unread in zip(need, got.facts, got.unreadable):
            if fact is not None:
                self.store[(user_id, kv)] = fact
                self.worker["fetched_facts"] += 1
            elif unread:
                self.worker["fetch_unreadable"] += 1
                self.absent.setdefault(user_id, set()).add(kv)
            else:
                self.missing.setdefault(user_id, set()).add(kv)
        return all(fact is not None for fact in got.facts)

    async def prefetch(self, user_id, kv_ids) -> int:
        await self._fetch(user_id, kv_ids)
        return len(kv_ids)

    async def take_missing(self) -> dict[str, dict[str, list[str]]]:
        missing, self.missing = self.missing, {}
        absent, self.absent = self.absent, {}
        return {"missing": {u: sorted(kvs) for u, kvs in missing.items()},
                "absent": {u: sorted(kvs) for u, kvs in absent.items()}}

    def kv_cache_tokens(self) -> int:
        return self.capacity_tokens

    def max_model_len(self) -> int:
        return 4096

    async def put_encoded(self, user_id, items) -> int:
        self.core.encoded_payloads(items)  # the real checks of ids and types
        self.puts += 1
        for kv, fact in items:
            self.store[(user_id, kv)] = fact
        return sum(fact.nbytes for _, fact in items)

    async def send_put(self, user_id, items):
        """Stored at once: the engine core runs a sent put before any request sent after it."""
        reply = asyncio.get_running_loop().create_future()
        try:
            reply.set_result(await self.put_encoded(user_id, items))
        except Exception as err:  # noqa: BLE001 - handed to whoever awaits the reply, as vLLM's call would
            reply.set_exception(err)
        return reply

    async def delete_encoded(self, user_id, kv_ids=None) -> int:
        keys = [k for k in self.store if k[0] == user_id and (kv_ids is None or k[1] in kv_ids)]
        for k in keys:
            del self.store[k]
        return len(keys)

    async def has_encoded(self, user_id, kv_ids) -> list[bool]:
        self.asked.append(list(kv_ids))
        return [(user_id, kv) in self.store for kv in kv_ids]

    async def list_encoded(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for u, kv in self.store:
            if u != "__inferscale_shared__":
                out.setdefault(u, []).append(kv)
        return out

    def kvs(self, user_id) -> set[str]:
        return {kv for u, kv in self.store if u == user_id}

    def prepare_facts(self, q, fact_ids, texts, versions, kv_ids=None):
        return self.core.prepare_facts(q, fact_ids, texts, versions, kv_ids)

    async def stream(self, p, sampling_params=None):
        from inferscale_core.requests import Answer

        if p.params is not None and p.params.fetch:
            await self._fetch(p.query.user_id, list(p.params.kv_ids[1:]))
        injected = p.params is not None and all(
            (owner, kv) in self.store
            for owner, kv in [("__inferscale_shared__", p.params.kv_ids[0])]
            + [(p.query.user_id, kv) for kv in p.params.kv_ids[1:]])
        cached = injectable_tokens(len(p.prompt_ids), p.memory_len) if injected else 0
        yield "ok", None
        yield "", Answer(text="ok", token_ids=[1], fact_ids=p.fact_ids, mode=p.query.mode, k=p.query.k, w=p.query.w,
                         prompt_len=len(p.prompt_ids), memory_len=p.memory_len, num_cached_tokens=cached,
                         retrieve_s=p.retrieve_s, ttft_s=0.001, finish_reason="stop")

    def generate(self, p, sampling_params):
        raise NotImplementedError("DictEngine streams answers only (`stream`); OpenAI chat needs vLLM")

    def chat_prompt(self, messages, user_id) -> dict:
        return self.core.chat_prompt(messages, user_id)

    async def chat(self, prompt, sampling_params=None, background: bool = False) -> tuple[str, int, int]:
        self.chats.append(background)
        return "ok", len(prompt["prompt_token_ids"]), 1

    def sampling_defaults(self) -> dict:
        return {}

    def tokenizer(self):
        return self.core.template.tokenizer

    async def metrics(self) -> dict:
        return {"worker": {"num_facts": len(self.store), **self.worker}}

    async def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def handle(obj):
    """A Serve handle's calling convention (`handle.method.remote(...)`, awaited) over a local object."""
    return types.SimpleNamespace(**{name: types.SimpleNamespace(remote=getattr(obj, name))
                                    for name in ("encode_for", "prefix", "fingerprint")})


@pytest.fixture(scope="module")
def parts(tmp_path_factory, mooncake):
    """The encoder and the cluster tier, shared by the module's tests (each test uses its own users)."""
    from support.tiny_models import save_tiny_model

    from inferscale_core.cluster_store import ClusterConfig, ClusterStore
    from inferscale_core.models import default_model_path
    from inferscale_server.encoder_pool import EncoderCore, FactEncoder

    folder = save_tiny_model("llama", tmp_path_factory.mktemp("tiny"), tokenizer_from=default_model_path())
    fe = FactEncoder(model_path=str(folder), device="cpu")
    cluster = ClusterStore(ClusterConfig.from_dict(mooncake.config), fe.fingerprint)
    assert cluster.wait_available(60)
    raw = raw_client(mooncake.config)
    yield types.SimpleNamespace(fe=fe, cluster=cluster, encoder=EncoderCore(fe, cluster), raw=raw)
    raw.close()
    cluster.close()


def make_core(parts, registry, cluster=True, disk_dir=None, engine=None, **config):
    """A replica over `registry`, with the module's cluster tier (False: none, then an encoder pool without one;
    a ClusterStore: that one, with an encoder pool writing to it)."""
    from inferscale_server.encoder_pool import EncoderCore
    from inferscale_server.engine_replica import EngineReplicaConfig, ReplicaCore

    if cluster is True:
        cluster, encoder = parts.cluster, parts.encoder
    else:
        cluster = cluster or None
        encoder = EncoderCore(parts.fe, cluster)
    engine = engine or DictEngine(parts.fe.template, parts.fe.prefix(), cluster=cluster)
    return ReplicaCore(EngineReplicaConfig(**config), engine, handle(encoder), registry, cluster, disk_dir)


async def started(parts, registry, **kw):
    """make_core, started (tombstones applied): what a replica is once Serve has built it."""
    core = make_core(parts, registry, **kw)
    await core.start()
    return core


def run(coro):
    return asyncio.run(coro)


async def add(parts, registry, core, user: str, facts: dict[str, str], expires: dict[str, float] | None = None) -> list:
    """What the gateway does for AddFacts: registry rows (with `expires`: fact id -> expires_at), the pool's encode
    (written to the cluster tier), the engine replica's put; returns once the replica's background work (the
    write's warm-up) has ended, so tests see one order of events."""
    from inferscale_server.registry.base import NewFact

    expires = expires or {}
    recs = registry.create(user, [NewFact(text=t, fact_id=f, expires_at=expires.get(f, float("inf")))
                                  for f, t in facts.items()])
    encoded = await core.encoder.encode_for.remote(user, [(r.fact_id, r.version, r.text, list(r.window))
                                                          for r in recs])  # the pool the replica calls
    await core.put_facts(user, [FactWrite.of(r) for r in recs], encoded)
    await settled(core)
    return recs


async def settled(core) -> None:
    while core.background.tasks:
        await asyncio.gather(*list(core.background.tasks))


async def gone(parts, user: str, kv: str, timeout_s: float = 20.0) -> bool:
    """Whether the cluster object's bytes go (looked for with a plain Mooncake client). Mooncake skips an object
    whose read lease still runs (the answer that just read it) and ClusterStore removes it again after the lease;
    a look takes a lease too (seen here), so the first one waits for ClusterStore's retry."""
    key = parts.cluster.key(user, kv)
    lease_s = parts.cluster.config.lease_s
    for _ in range(int(timeout_s / (3 * lease_s))):
        await asyncio.sleep(3 * lease_s)
        if parts.raw.is_exist(key) == 0:
            return True
    return False


async def counts(core) -> dict:
    """The replica's counters as `stats` reports them (the worker's loads included, its misses re-queued)."""
    return await core.stats()


async def answer(core, user: str, fact_ids: list[str], mode=Mode.KV):
    """The AnswerEnd of a streamed answer (services/messages.py)."""
    from inferscale_server.messages import AnswerEnd, AnswerPiece

    pieces = [p async for p in core.answer(AnswerRequest(user, "Where does Alice live?", fact_ids, 4, 0.0, mode))]
    assert pieces[0] == AnswerPiece("ok") and isinstance(pieces[-1], AnswerEnd)
    return pieces[-1]


def protocol_mismatches(cls, protocol) -> list[str]:
    """Where `cls` does not implement `protocol`: a member missing, sync where the protocol is async (or the other
    way), or parameters named differently."""
    import inspect

    out = []
    for name, want in vars(protocol).items():
        if name.startswith("_") or not callable(want):
            continue
        have = getattr(cls, name, None)
        if have is None:
            out.append(f"{name}: missing")
            continue
        if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(have):
            out.append(f"{name}: async in one, not the other")
        params = [list(inspect.signature(f).parameters) for f in (want, have)]
        if params[0] != params[1]:
            out.append(f"{name}: parameters {params[1]}, the protocol's {params[0]}")
    return out


def test_the_engine_double_and_vllms_engine_both_implement_the_protocol():
    """ReplicaCore asks its engine only what ServingEngine declares: the test double is checked against it, and
    so is the real engine (AsyncInjectingEngine), so a method added to one and not the other fails here."""
    from inferscale_core.serving_engine import AsyncInjectingEngine
    from inferscale_server.engine_replica import ServingEngine

    assert protocol_mismatches(DictEngine, ServingEngine) == []
    assert protocol_mismatches(AsyncInjectingEngine, ServingEngine) == []
    assert protocol_mismatches(type("Half", (), {"max_model_len": lambda self: 1}), ServingEngine)  # can fail


def test_config_is_checked_once_when_made():
    from inferscale_server.app import ServiceConfig
    from inferscale_server.engine_replica import EngineReplicaConfig

    cfg = ServiceConfig(dtype="bfloat16", cluster_store={"master": "m:1", "metadata": "http://m:2/metadata"},
                        stream_interval=3)
    made = cfg.engine_replica_config("redis://r:6379/0")
    assert (made.dtype, made.registry_url, made.cluster.master) == ("bfloat16", "redis://r:6379/0", "m:1")
    assert made.stream_interval == 3 and ServiceConfig.from_args(cfg.app_args()).stream_interval == 3
    for bad, names in [({"dtype": "fp16"}, "dtype"), ({"block_size": 0}, "block_size"),
                       ({"max_model_len": "4096"}, "max_model_len"), ({"admission_queue_factor": 0.5}, "queue_factor"),
                       ({"cluster_store": {"masterr": "m:1"}}, "masterr"), ({"kv_budget_bytes": -1}, "kv_budget"),
                       ({"store_options": None}, "store_options"), ({"stream_interval": 0}, "stream_interval"),
                       ({"long_prefill_tokens": -1}, "long_prefill_tokens"),
                       ({"long_prefill_tokens": True}, "long_prefill_tokens")]:
        with pytest.raises(ValueError, match=names):
            EngineReplicaConfig(**bad)


def test_a_long_prompt_takes_at_most_its_share_of_a_step_beside_other_requests():
    """The engine replica caps a prompt's tokens per step while other requests run (vLLM's
    long_prefill_token_threshold, which vLLM lifts for a request alone), never above max_model_len (vLLM refuses
    that); an operator's engine_overrides win; 0 turns it off. bench/service.py's engine-alone phase takes the same
    arguments (vllm_engine_args), so its comparison with the service stays like for like."""
    from inferscale_core.background_prefill import SCHEDULER_CLS
    from inferscale_server.app import ServiceConfig
    from inferscale_server.engine_replica import EngineReplicaConfig
    from inferscale_server.engine_replica.config import LONG_PREFILL_TOKENS

    assert 0 < LONG_PREFILL_TOKENS <= 512
    assert EngineReplicaConfig().vllm_engine_args() == {"long_prefill_token_threshold": LONG_PREFILL_TOKENS,
                                                        "scheduler_cls": SCHEDULER_CLS}
    assert ServiceConfig().engine_replica_config(None).vllm_engine_args() == EngineReplicaConfig().vllm_engine_args()
    assert EngineReplicaConfig(max_model_len=128).vllm_engine_args()["long_prefill_token_threshold"] == 128
    assert EngineReplicaConfig(long_prefill_tokens=0).vllm_engine_args()["long_prefill_token_threshold"] == 0
    made = ServiceConfig(engine_overrides={"long_prefill_token_threshold": 64, "max_num_seqs": 8,
                                           "scheduler_cls": None})  # None: vLLM's own scheduler
    assert made.engine_replica_config(None).vllm_engine_args() == {"long_prefill_token_threshold": 64,
                                                                   "max_num_seqs": 8, "scheduler_cls": None}


def test_mem0s_extraction_prompts_go_to_the_engine_as_background_work(parts):
    """The replica's plain chat (Mem0's extraction step) is background work: its long prompt prefills in the steps
    the answers leave (inferscale_core/background_prefill.py; the real scheduler: tests/engine/)."""
    from inferscale_server.registry import open_registry

    async def go():
        core = await started(parts, open_registry(None))
        text = await core.chat(USER, [{"role": "user", "content": "I live in Oslo."}], 16, 0.0, None)
        return text, core.engine.chats
    assert asyncio.run(go()) == ("ok", [True])


def test_engine_replicas_splitting_a_node_split_its_kv_budget(parts, monkeypatch):
    """engine_cpu_cores = c on an n-core node: n // c replicas share the node, so each keeps that share of the
    default resident-KV budget (a quarter of the machine for one replica per node)."""
    from inferscale_core.vllm_env import usable_cpus
    from inferscale_server.engine_replica import default_kv_budget_bytes
    from inferscale_server.registry import open_registry

    monkeypatch.delenv("INFERSCALE_ENGINE_KV_BUDGET_BYTES", raising=False)
    registry, cores = open_registry(None), len(usable_cpus())
    whole = make_core(parts, registry, cluster=False).resident.budget_bytes
    split = make_core(parts, registry, cluster=False, engine_cpu_cores=1).resident.budget_bytes
    assert whole == default_kv_budget_bytes() > 0
    assert split == default_kv_budget_bytes(1 / cores) and (cores == 1 or split < whole)
    given = make_core(parts, registry, cluster=False, engine_cpu_cores=1, kv_budget_bytes=123)
    assert given.resident.budget_bytes == 123  # a budget given is the replica's own, never split


def test_every_deployment_config_is_checked_before_serve_starts():
    """build_app makes each deployment's config: a mistake raises there, with Ray not even started."""
    import ray

    from inferscale_server.app import ServiceConfig, build_app
    from inferscale_server.encoder_pool import EncoderPoolConfig
    from inferscale_server.retrieval import RetrievalConfig

    for bad, names in [({"dtype": "fp16"}, "dtype"), ({"max_model_len": 0}, "max_model_len"),
                       ({"cluster_store": {"x": 1}}, "cluster_store keys")]:
        with pytest.raises(ValueError, match=names):
            build_app(ServiceConfig(**bad))
    for make, names in [(lambda: EncoderPoolConfig(device="gpu"), "device"),
                        (lambda: EncoderPoolConfig(store_dtype="int8"), "dtype"),
                        (lambda: EncoderPoolConfig(max_fact_tokens=0), "max_fact_tokens"),
                        (lambda: RetrievalConfig(device="tpu"), "device")]:
        with pytest.raises(ValueError, match=names):
            make()
    cfg = ServiceConfig(dtype="bfloat16", embedder_path="/m")
    assert cfg.encoder_pool_config().dtype == "bfloat16" and cfg.retrieval_config("redis://r").embedder_path == "/m"
    assert not ray.is_initialized()


def test_tiers_in_order_cluster_then_worker_store_and_no_reencode(parts):
    from inferscale_server.registry import open_registry

    registry = open_registry(None)

    async def go():
        writer = await started(parts, registry)
        recs = await add(parts, registry, writer, USER, FACTS)
        assert all(r.version == 1 for r in recs)
        # With a cluster tier the write moved no KV through the writer: the pool wrote the objects, and the writer's
        # worker (it serves the user) read them in its background (the write's warm-up, ids only crossed).
        assert writer.engine.puts == 0 and writer.counters["facts_warmed"] == 3
        assert writer.engine.kvs(USER) == {kv_id(f, 1) for f in FACTS}
        assert writer.resident.count() == 3  # counted once landed: its requests go without `fetch`
        warmed = await counts(writer)
        assert warmed["facts_from_cluster"] == 3
        final = await answer(writer, USER, ["f3", "f1"])  # its first request reads nothing: injected from memory
        assert final.prefilled_tokens < final.prompt_tokens
        assert (await counts(writer))["facts_from_cluster"] == 3 and writer.engine.puts == 0

        # A replica that never saw the user: the worker loads the k facts a request names from the cluster tier,
        # once; this replica reads and puts nothing (no KV crosses it).
        core = await started(parts, registry)
        final = await answer(core, USER, ["f2", "f1"])
        assert final.fact_ids == ["f2", "f1"]
        c = await counts(core)
        assert c["facts_from_cluster"] == 2 and c["facts_encoded"] == 0 and core.engine.puts == 0
        assert core.engine.kvs(USER) == {kv_id("f1", 1), kv_id("f2", 1)}  # the request's k, not the whole user
        assert final.prefilled_tokens < final.prompt_tokens  # injected
        assert set(final.timings_ms) >= {"user_sync", "kv_fetch", "admission_wait", "engine_ttft", "kv_fetch_lock"}
        assert not {"kv_fetch_read", "kv_fetch_put", "kv_fetch_disk_check"} & set(final.timings_ms)
        assert core.engine.asked == []  # nothing asked of the worker store before the request
        steps = sum(v for key, v in final.timings_ms.items() if key.startswith("kv_fetch_"))
        assert steps <= final.timings_ms["kv_fetch"] + 0.01  # the steps of the fetch, not beside it

        # Again: the worker store has them, nothing is read; a third fact comes from the cluster tier.
        await answer(core, USER, ["f2", "f1", "f3"])
        c = await counts(core)
        assert c["facts_from_cluster"] == 3 and c["facts_encoded"] == 0
        assert core.resident.count() == 3 and core.resident.bytes == sum(
            parts.cluster.get_many(USER, [kv_id(f, 1)])[0].nbytes for f in FACTS)

        # Prompt mode serves the same facts as text: no KV is fetched for it.
        fresh = await started(parts, registry)
        final = await answer(fresh, USER, ["f1"], Mode.PI)
        assert final.prefilled_tokens == final.prompt_tokens and fresh.engine.kvs(USER) == set()
        # The registry knows where the user is held.
        assert {writer.replica_id, core.replica_id, fresh.replica_id} <= registry.placement(USER)

    run(go())


def test_miss_everywhere_is_computed_by_vllm_and_reencoded_once(parts):
    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    user = "bob"

    async def go():
        writer = await started(parts, registry)  # its warm-up holds the facts: another replica serves bob
        await add(parts, registry, writer, user, {"b1": "Bob keeps bees.", "b2": "Bob sails on weekends."})
        core = await started(parts, registry)
        parts.cluster.remove_user(user)  # evicted from the cluster tier (or never written)
        # (the warm-up's read lease may hold them a moment: ClusterStore removes them again after it)
        assert await gone(parts, user, kv_id("b1", 1)) and await gone(parts, user, kv_id("b2", 1))

        # Two requests at once miss both facts: vLLM computes them (nothing injected), ONE re-encode per fact.
        first, second = await asyncio.gather(answer(core, user, ["b1", "b2"]), answer(core, user, ["b2", "b1"]))
        # Answered all the same (whether vLLM computed a fact or the re-encode landed before its load is a race,
        # as in vLLM); the first request found neither fact anywhere.
        assert first.fact_ids == ["b1", "b2"] and second.fact_ids == ["b2", "b1"]
        assert first.prefilled_tokens == first.prompt_tokens
        c = await counts(core)  # the worker's misses re-queued: one re-encode per fact
        assert c["facts_recomputed"] == 2 and c["facts_from_cluster"] == 0
        assert core.resident.count() == 0  # not counted resident: the next request asks the worker to load
        for _ in range(200):  # the background re-encode (milliseconds with the tiny model)
            if core.counters["facts_encoded"] >= 2 and not core.kv.reencoding:
                break
            await asyncio.sleep(0.02)
        assert core.counters["facts_encoded"] == 2  # not 4: a fact already queued is not queued again
        assert core.engine.puts == 0  # written to the cluster tier, not through this replica
        assert all(e is not None for e in parts.cluster.get_many(user, [kv_id("b1", 1), kv_id("b2", 1)]))
        third = await answer(core, user, ["b1", "b2"])
        assert third.prefilled_tokens < third.prompt_tokens  # injected now, loaded by the worker
        assert core.engine.kvs(user) == {kv_id("b1", 1), kv_id("b2", 1)}

    run(go())


class FailingPuts(DictEngine):
    """DictEngine whose next `fail` puts raise, as a worker store over its budget would."""

    fail = 0

    async def put_encoded(self, user_id, items) -> int:
        if self.fail:
            self.fail -= 1
            raise ValueError("the worker store is full")
        return await super().put_encoded(user_id, items)


def test_a_put_sent_ahead_of_its_request_that_fails_is_computed_then_fetched_again(parts):
    """Without a cluster tier the replica encodes a request's missing facts, sends the put and lets the request go
    (AsyncInjectingEngine.send_put); a put that fails is settled in the background: counted, forgotten here, the
    request computes the facts, the next encodes and puts them again."""
    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    user = "fiona"

    async def go():
        writer = await started(parts, registry, cluster=False)
        await add(parts, registry, writer, user, {"p1": "Fiona plays the cello.", "p2": "Fiona lives in Porto."})
        engine = FailingPuts(parts.fe.template, parts.fe.prefix())
        core = await started(parts, registry, engine=engine, cluster=False)  # never saw the user
        engine.fail = 1
        first = await answer(core, user, ["p1", "p2"])
        for _ in range(100):
            if not core.background.tasks:
                break
            await asyncio.sleep(0.01)
        assert first.fact_ids == ["p1", "p2"] and first.prefilled_tokens == first.prompt_tokens  # computed
        assert core.counters["facts_put_failed"] == 2 and core.resident.count() == 0
        second = await answer(core, user, ["p1", "p2"])
        assert second.prefilled_tokens < second.prompt_tokens and core.counters["facts_encoded"] == 4

    run(go())


class SteppedPuts(DictEngine):
    """The engine core's order of work: a sent put waits in its input queue and runs between two steps (`step`),
    every queued one before the next step, as vLLM's core loop drains its input; `events` records each send and
    each step with the puts it ran."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.queued: list[tuple[asyncio.Future, str, list]] = []
        self.events: list[str] = []

    async def send_put(self, user_id, items):
        reply = asyncio.get_running_loop().create_future()
        self.queued.append((reply, user_id, items))
        self.events.append("sent")
        return reply

    async def step(self) -> None:
        ran, self.queued = self.queued, []
        for reply, user_id, items in ran:
            reply.set_result(await self.put_encoded(user_id, items))
        self.events.append(f"step ran {len(ran)}")


def test_a_writes_kv_goes_into_the_engine_core_one_chunk_per_step(parts, monkeypatch):
    """Without a cluster tier a write's KV goes into the engine core through its input queue, which it drains
    between two steps: a write's chunks are sent one after another's reply, so its steps (every user's decoding)
    run between them; sent at once, a 256-fact add (~140 MB of fp32 KV) had the core run them all between two steps
    and stalled every answer 1.1-1.7 s (bench/noisy_neighbour.py `kv_flood`). A request's own missing facts
    (`ahead`) still go at once, before the request."""
    from inferscale_server.engine_replica import kv_path
    from inferscale_server.registry import open_registry
    from inferscale_server.registry.base import NewFact

    monkeypatch.setattr(kv_path, "PUT_CHUNK_TOKENS", 1)  # a chunk per fact
    registry = open_registry(None)

    async def go():
        engine = SteppedPuts(parts.fe.template, parts.fe.prefix())
        core = await started(parts, registry, engine=engine, cluster=False)
        recs = registry.create("gina", [NewFact(text=t, fact_id=f) for f, t in
                                        {"g1": "Gina rows.", "g2": "Gina bakes bread.", "g3": "Gina has a dog."}.items()])
        encoded = await parts.encoder.encode("gina", [(r.text, []) for r in recs])
        engine.events.clear()
        write = asyncio.ensure_future(core.put_facts("gina", [FactWrite.of(r) for r in recs], encoded))
        for _ in range(50):  # bounded: the engine core's steps until the write has landed
            await asyncio.sleep(0.01)
            await engine.step()
            if write.done():
                break
        assert await write == 3 and engine.kvs("gina") == {kv_id(f, 1) for f in ("g1", "g2", "g3")}
        landed = [e for e in engine.events if e != "step ran 0"]
        assert landed == ["sent", "step ran 1"] * 3, engine.events
        engine.events.clear()
        await core.kv.put("gina", [("g1", 2), ("g2", 2)], encoded[:2], ahead=True)
        assert engine.events == ["sent", "sent"]  # ahead of its request: every chunk queued before it
        await engine.step()

    run(go())


def test_without_a_cluster_tier_the_encoder_encodes_now(parts):
    from inferscale_server.registry import open_registry

    registry = open_registry(None)

    async def go():
        writer = await started(parts, registry, cluster=False)
        from inferscale_server.registry.base import NewFact

        recs = registry.create("carol", [NewFact(text="Carol speaks Estonian.", fact_id="c1")])
        # Without a cluster tier the pool answers the EncodedFact itself and the replica puts it now.
        plain = await parts.encoder.encode("carol", [(recs[0].text, [])])
        await writer.put_facts("carol", [FactWrite.of(recs[0])], plain)
        assert writer.engine.kvs("carol") == {kv_id("c1", 1)}
        other = await started(parts, registry, cluster=False)  # never saw carol: encodes during the request
        final = await answer(other, "carol", ["c1"])
        assert other.counters["facts_encoded"] == 1 and other.counters["facts_recomputed"] == 0
        assert final.prefilled_tokens < final.prompt_tokens

    run(go())


def test_a_delete_whose_push_was_lost_is_applied_by_the_next_watch_round(parts):
    """Deletes have one path, the registry's tombstone log: a replica that never got the gateway's push (it was
    routed elsewhere, or the push failed) removes the fact from its books, its worker store and the cluster tier
    at its next watch round; a push only makes it read the log now."""
    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    user = "iris"

    async def go():
        core = await started(parts, registry)
        await add(parts, registry, core, user, {"i1": "Iris keeps bees.", "i2": "Iris sails."})
        await answer(core, user, ["i1", "i2"])
        assert core.engine.kvs(user) == {kv_id("i1", 1), kv_id("i2", 1)}
        registry.delete(user, "i1")  # no push reaches this replica
        await core.watch_once()
        assert core.engine.kvs(user) == {kv_id("i2", 1)} and "i1" not in core.books.held(user)
        assert core.counters["tombstones_applied"] == 1 and await gone(parts, user, kv_id("i1", 1))
        assert await core.forget(user, [FactRef("i1", 1)]) == 0  # a late push finds the log applied
        registry.delete(user, "i2")
        assert await core.forget(user, [FactRef("i2", 1)]) == 1 and core.engine.kvs(user) == set()
        assert (await answer(core, user, ["i1", "i2"])).fact_ids == []

    run(go())


def test_an_expired_fact_is_not_injected(parts):
    """Retrieval leaves expired facts out at its own time; the replica that injects checks again at the request's:
    a fact named by the request that has expired is not injected (KV) nor pasted (prompt mode), also one that
    expired while the user was held, with nothing synced in between."""
    import time

    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    user = "erin"

    async def go():
        core = await started(parts, registry)
        await add(parts, registry, core, user, {"e1": "Erin's trial ends soon.", "e2": "Erin rows.",
                                                "e3": "Erin's old plan ended."},
                  expires={"e1": time.time() + 4, "e3": 1_000.0})
        assert (await answer(core, user, ["e1", "e2", "e3"])).fact_ids == ["e1", "e2"]
        synced = core.books.book.synced[user]
        time.sleep(max(0.0, registry.get(user, "e1").expires_at - time.time()) + 0.05)
        assert (await answer(core, user, ["e1", "e2", "e3"])).fact_ids == ["e2"]
        assert (await answer(core, user, ["e1", "e2", "e3"], Mode.PI)).fact_ids == ["e2"]
        assert core.books.book.synced[user] == synced  # the clock alone: no registry change, no sync
        registry.update(user, "e3", expires_at=float("inf"))  # the expiry cleared: served again
        assert (await answer(core, user, ["e1", "e2", "e3"], Mode.PI)).fact_ids == ["e2", "e3"]

    run(go())


def test_update_and_delete_reach_every_tier(parts):
    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    user = "dave"

    async def go():
        core = await started(parts, registry)
        await add(parts, registry, core, user, {"d1": "Dave runs marathons.", "d2": "Dave has two dogs."})
        await answer(core, user, ["d1", "d2"])
        assert core.engine.kvs(user) == {kv_id("d1", 1), kv_id("d2", 1)}

        # An update: the gateway writes version 2 (the pool removes version 1 from the cluster tier); the next
        # request's sync drops version 1 from the worker store and serves version 2.
        rec = registry.update(user, "d1", text="Dave runs ultramarathons.")
        encoded = await parts.encoder.encode_for(user, [("d1", rec.version, rec.text, [])])
        await core.put_facts(user, [FactWrite.of(rec)], encoded)
        await answer(core, user, ["d1"])
        assert core.engine.kvs(user) == {kv_id("d1", 2), kv_id("d2", 1)}
        assert await gone(parts, user, kv_id("d1", 1))

        # A delete: forget removes every version from the worker store and the cluster tier.
        registry.delete(user, "d2")
        await core.forget(user, [FactRef("d2", 1)])
        assert core.engine.kvs(user) == {kv_id("d1", 2)}
        assert await gone(parts, user, kv_id("d2", 1))
        final = await answer(core, user, ["d1", "d2"])  # retrieval may still name it: left out
        assert final.fact_ids == ["d1"]

    run(go())


def test_a_replica_that_was_down_applies_the_tombstones_at_start(parts, tmp_path):
    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    user = "erin"

    async def go():
        core = await started(parts, registry, disk_dir=str(tmp_path))
        await add(parts, registry, core, user, {"e1": "Erin grows tomatoes.", "e2": "Erin plays the cello."})
        await answer(core, user, ["e1", "e2"])
        engine = core.engine  # the worker store with its disk tier outlives the replica (the slot's folder)
        assert engine.kvs(user) == {kv_id("e1", 1), kv_id("e2", 1)}

        # The replica is down; meanwhile e1 is deleted and the user's other facts are updated.
        registry.delete(user, "e1")
        registry.update(user, "e2", text="Erin plays the viola.")
        # Started: the tombstones after the cursor its predecessor saved are applied.
        restarted = await started(parts, registry, disk_dir=str(tmp_path), engine=engine)
        assert restarted.counters["tombstones_applied"] == 2
        assert engine.kvs(user) == set()  # e1 deleted, e2's version 1 replaced
        assert await gone(parts, user, kv_id("e1", 1))

        # DeleteUser while down: every object and stored fact of the user is gone after the next start.
        await add(parts, registry, restarted, "frank", {"g1": "Frank lives in Oslo."})
        await answer(restarted, "frank", ["g1"])
        registry.delete_user("frank")
        await started(parts, registry, disk_dir=str(tmp_path), engine=engine)  # a restart applies it
        assert engine.kvs("frank") == set() and await gone(parts, "frank", kv_id("g1", 1))

    run(go())


def test_a_replica_whose_tombstones_were_trimmed_unread_reconciles_at_start(parts, tmp_path, monkeypatch):
    """Issue 31: the log keeps TOMBSTONES_KEPT entries; a replica down for more deletes than that cannot learn
    them from the log. At start it sees its cursor was trimmed past (tombstones_missed) and checks what it holds
    against the registry: a deleted user's and a deleted fact's KV go (worker store and cluster tier), an updated
    fact's old version goes, a fact still current stays."""
    from inferscale_server.registry import embedded, open_registry
    from inferscale_server.registry.base import NewFact

    monkeypatch.setattr(embedded, "TOMBSTONES_KEPT", 3)
    registry = open_registry(None)

    async def go():
        core = await started(parts, registry, disk_dir=str(tmp_path))
        await add(parts, registry, core, "gina", {"h1": "Gina rows at dawn.", "h2": "Gina keeps a parrot.",
                                                   "h3": "Gina reads Portuguese poetry."})
        await add(parts, registry, core, "hugo", {"i1": "Hugo repairs clocks."})
        await answer(core, "gina", ["h1", "h2", "h3"])
        await answer(core, "hugo", ["i1"])
        engine = core.engine
        cursor = core.deletions._cursor
        # Down; meanwhile more tombstones than the log keeps: the first ones are trimmed before anyone read them.
        registry.delete("gina", "h1")
        registry.update("gina", "h2", text="Gina keeps two parrots.")
        registry.delete_user("hugo")
        for i in range(3):
            registry.create("ivy", [NewFact(f"Ivy's note {i}", fact_id=f"n{i}")])
            registry.delete("ivy", f"n{i}")
        assert registry.tombstones_missed(cursor)
        restarted = await started(parts, registry, disk_dir=str(tmp_path), engine=engine)
        assert restarted.counters["kv_reconciled"] == 3  # h1@v1, h2@v1 and hugo's i1@v1
        assert engine.kvs("gina") == {kv_id("h3", 1)} and engine.kvs("hugo") == set()
        assert await gone(parts, "gina", kv_id("h1", 1)) and await gone(parts, "hugo", kv_id("i1", 1))
        assert not registry.tombstones_missed(restarted.deletions._cursor)
        # a start from a cursor the log still holds does not reconcile
        again = await started(parts, registry, disk_dir=str(tmp_path), engine=engine)
        assert again.counters["kv_reconciled"] == 0

    run(go())


def test_the_worker_store_is_asked_only_about_facts_its_disk_tier_may_hold(parts, tmp_path):
    """Without a cluster tier a request's cold facts are encoded by the replica: it asks the worker store (a call
    into the engine core's step loop) which of them it holds only for those its disk tier listed at start or kept
    for a user the replica unloaded. With a cluster tier it never asks: the worker looks in its own tiers, disk
    included, before the cluster tier."""
    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    user = "hana"
    facts = {"h1": "Hana repairs clocks.", "h2": "Hana lives in Kyoto.", "h3": "Hana has two cats.",
             "h4": "Hana swims at dawn."}

    for folder in ("local", "clustered"):
        (tmp_path / folder).mkdir()

    async def go():
        core = await started(parts, registry, disk_dir=str(tmp_path / "local"), cluster=False)
        await add(parts, registry, core, user, facts)
        engine = core.engine  # the worker store with its disk tier outlives the replica (the slot's folder)
        await engine.delete_encoded(user, [kv_id("h3", 1), kv_id("h4", 1)])  # the disk tier's budget dropped them
        assert engine.asked == [] and engine.kvs(user) == {kv_id("h1", 1), kv_id("h2", 1)}

        # Restarted over the same disk tier: asked once, about the listed facts the request names, not about h3.
        restarted = await started(parts, registry, disk_dir=str(tmp_path / "local"), engine=engine, cluster=False)
        restarted.books.maybe_on_disk[user].add(kv_id("h3", 1))  # listed at start, dropped since
        final = await answer(restarted, user, ["h3", "h2", "h1"])
        assert engine.asked == [[kv_id("h3", 1), kv_id("h2", 1), kv_id("h1", 1)]]
        assert restarted.counters["facts_from_disk"] == 2 and restarted.counters["facts_encoded"] == 1
        assert "kv_fetch_disk_check" in final.timings_ms and final.prefilled_tokens < final.prompt_tokens
        final = await answer(restarted, user, ["h4", "h1"])  # h1 counted now, h4 never listed: no call
        assert len(engine.asked) == 1 and "kv_fetch_disk_check" not in final.timings_ms
        assert restarted.counters["facts_encoded"] == 2

        # Unloaded (Serve's LRU): the disk tier keeps its facts. Meanwhile its budget drops one (h3). A reload
        # asks about the facts it kept; the one gone is encoded again, not assumed present.
        await restarted.unload(user)
        await engine.delete_encoded(user, [kv_id("h3", 1)])
        final = await answer(restarted, user, ["h3", "h1"])
        assert sorted(engine.asked[-1]) == [kv_id("h1", 1), kv_id("h3", 1)]
        assert restarted.counters["facts_from_disk"] == 3 and restarted.counters["facts_encoded"] == 3
        assert engine.kvs(user) >= {kv_id("h1", 1), kv_id("h3", 1)} and final.prefilled_tokens < final.prompt_tokens

        # DeleteUser forgets what the disk tier had of the user: nothing left to ask about.
        registry.delete_user(user)
        await restarted.forget_user(user)
        assert user not in restarted.books.maybe_on_disk and engine.kvs(user) == set()

        # With a cluster tier: never asked; what the worker store kept is not read again.
        other = "hugo"
        clustered = await started(parts, registry, disk_dir=str(tmp_path / "clustered"))
        await add(parts, registry, clustered, other, {"u1": "Hugo bakes bread.", "u2": "Hugo rows."})
        await answer(clustered, other, ["u1", "u2"])
        again = await started(parts, registry, disk_dir=str(tmp_path / "clustered"), engine=clustered.engine)
        await answer(again, other, ["u2", "u1"])
        # asked once, by the write's warm-up (whether its reads had landed), never by a request
        assert clustered.engine.asked == [[kv_id("u1", 1), kv_id("u2", 1)]]
        assert (await counts(again))["facts_from_cluster"] == 2  # once, in all

    run(go())


def test_an_object_on_a_dead_segment_is_computed_not_reencoded_until_the_master_drops_it(parts):
    """A node dies with its Mooncake segment: until the master drops that segment (client_ttl) its objects are
    listed but cannot be read. A request then computes those facts (vLLM) and queues no re-encode; once the master
    has dropped the segment, the objects that were only there are misses and are re-encoded, once."""
    import signal
    import time

    from inferscale_core.cluster_store import ClusterConfig, ClusterStore
    from inferscale_server.local_mooncake import local_mooncake
    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    user, ttl_s = "gina", 5
    facts = {f"g{i}": f"Gina's fact number {i} is about {w}." for i, w in enumerate(
        "bees boats cats dogs eels figs goats hats inks jars kites lamps moss nuts oars pears".split())}
    ids = list(facts)

    async def go(mc, store):
        core = await started(parts, registry, cluster=store)
        await add(parts, registry, core, user, facts)
        # One copy per object, spread over the two segments (placement is Mooncake's).
        mc.extra_segments[0].send_signal(signal.SIGKILL)
        mc.extra_segments[0].wait()
        killed = time.monotonic()
        reader = await started(parts, registry, cluster=store)  # never saw the user: reads the cluster tier
        first = await answer(reader, user, ids)
        assert time.monotonic() - killed < ttl_s, "too slow to see the dead segment's window"
        c = await counts(reader)
        assert c["facts_unreadable"] >= 1 and c["facts_from_cluster"] + c["facts_unreadable"] == len(ids), c
        assert c["facts_encoded"] == 0 and not reader.kv.reencoding, c  # computed for this request, not re-encoded
        assert reader.resident.count() == c["facts_from_cluster"]  # the unreadable ones are not counted resident
        assert first.prefilled_tokens == first.prompt_tokens  # vLLM computed the memory
        for _ in range(int(4 * ttl_s / 0.25)):  # until the master drops the dead segment
            gone = await asyncio.to_thread(store.read, user, [kv_id(f, 1) for f in ids])
            if not any(gone.unreadable):
                break
            await asyncio.sleep(0.25)
        lost = [f for f, fact in zip(ids, gone.facts) if fact is None]
        assert not any(gone.unreadable) and 1 <= len(lost) < len(ids), gone.unreadable
        later = await started(parts, registry, cluster=store)
        await answer(later, user, ids)
        await later.kv.requeue_missing()  # what the watch does every round
        for _ in range(200):  # the background re-encode of what was only on the dead segment
            if later.counters["facts_encoded"] >= len(lost) and not later.kv.reencoding:
                break
            await asyncio.sleep(0.02)
        c = await counts(later)
        assert c["facts_encoded"] == len(lost) and c["facts_unreadable"] == 0
        assert c["facts_from_cluster"] == len(ids) - len(lost)
        assert all(f is not None for f in store.get_many(user, [kv_id(f, 1) for f in ids]))  # written again

    with local_mooncake(segment_bytes=64 << 20, client_ttl_s=ttl_s) as mc:
        mc.add_segment(64 << 20)
        store = ClusterStore(ClusterConfig.from_dict({**mc.config, "replicas": 1}), parts.fe.fingerprint)
        try:
            assert store.wait_available(60)
            run(go(mc, store))
        finally:
            store.close()


def test_load_user_has_the_worker_load_every_fact_from_the_cluster_tier(parts):
    """Warming a replica (admin's load_user) with a cluster tier: the worker reads every fact of the user itself
    (ids only cross), and the replica counts them resident once they landed, so the next request asks for no
    load."""
    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    user = "ivan"

    async def go():
        writer = await started(parts, registry)
        await add(parts, registry, writer, user, {"i1": "Ivan keeps goats.", "i2": "Ivan lives in Tartu."})
        core = await started(parts, registry)
        assert await core.load_user(user) == core.replica_id
        await settled(core)  # counted resident once the worker store holds them
        assert core.engine.kvs(user) == {kv_id("i1", 1), kv_id("i2", 1)} and core.engine.puts == 0
        assert core.resident.count() == 2
        final = await answer(core, user, ["i1", "i2"])
        assert final.prefilled_tokens < final.prompt_tokens and (await counts(core))["facts_from_cluster"] == 2

    run(go())


def test_the_disk_tier_folder_is_keyed_by_the_encoders_fingerprint(tmp_path, caplog):
    """A change of model, dtype or prefix (another fingerprint) starts an empty folder instead of files the store
    cannot read, and names the other configurations' folders; switching back finds the first one again."""
    from inferscale_server.engine_replica.placement import replica_disk_dir

    assert replica_disk_dir(None, "a" * 16) is None
    first = replica_disk_dir(str(tmp_path), "a" * 16)
    assert first.endswith("slot-0/kv-" + "a" * 16)
    (Path(first) / "marker").write_text("facts of the first configuration")
    with caplog.at_level("WARNING", logger="inferscale.engine_replica"):
        second = replica_disk_dir(str(tmp_path), "b" * 16)
    assert second != first and not any(Path(second).iterdir())
    assert first in caplog.text and "another model, dtype or prefix" in caplog.text
    assert replica_disk_dir(str(tmp_path), "a" * 16) == first and (Path(first) / "marker").is_file()


def test_a_tombstone_that_cannot_be_applied_is_skipped_not_a_wedge(parts):
    """A tombstone naming the reserved owner of the shared prefix (forged: every door refuses that id) or an
    invalid id is logged, counted and passed; the shared prefix stays, and the deletes behind it still apply, this
    round and the next (the cursor moved past it)."""
    from inferscale_core.types import SHARED_USER_ID
    from inferscale_server.registry import open_registry
    from inferscale_server.registry.base import Tombstone

    registry = open_registry(None)
    user = "jude"

    async def go():
        core = await started(parts, registry)
        await add(parts, registry, core, user, {"j1": "Jude rows.", "j2": "Jude bakes."})
        await answer(core, user, ["j1", "j2"])
        prefix_key = (SHARED_USER_ID, core.engine.core.prefix_id)
        registry._tomb(Tombstone(SHARED_USER_ID))          # DeleteUser of the shared prefix's owner
        registry._tomb(Tombstone("bad\nuser", "x", 1, gone=True))
        registry.delete(user, "j1")
        await core.watch_once()
        assert core.counters["tombstones_skipped"] == 2 and core.counters["tombstones_applied"] == 1
        assert prefix_key in core.engine.store and core.engine.kvs(user) == {kv_id("j2", 1)}
        registry.delete(user, "j2")
        await core.watch_once()
        assert core.counters["tombstones_skipped"] == 2 and core.engine.kvs(user) == set()
        assert (await answer(core, "kim", [])).fact_ids == []  # requests still work: the prefix is there

    run(go())


def test_a_tombstone_names_at_most_the_last_versions_of_a_fact(parts):
    """A fact updated many times: each tombstone makes the replica remove at most VERSIONS_NAMED versions (not every
    version up to its own), and the held version still goes, since tombstones are applied in order."""
    from inferscale_core.cluster_store import VERSIONS_NAMED
    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    user = "lee"

    async def go():
        core = await started(parts, registry)
        await add(parts, registry, core, user, {"l1": "Lee sings.", "l2": "Lee skis."})
        await answer(core, user, ["l1", "l2"])
        sent, real = [], core.engine.delete_encoded

        async def spy(user_id, kv_ids=None):
            sent.append(list(kv_ids or []))
            return await real(user_id, kv_ids)

        core.engine.delete_encoded = spy
        for i in range(VERSIONS_NAMED + 36):  # 100 updates, then the delete: 101 tombstones
            registry.update(user, "l1", text=f"Lee sings, take {i}.")
        registry.delete(user, "l1")
        await core.watch_once()
        assert core.counters["tombstones_applied"] == VERSIONS_NAMED + 37
        assert max(map(len, sent)) == VERSIONS_NAMED and kv_id("l1", 1) in sent[0]
        assert core.engine.kvs(user) == {kv_id("l2", 1)}

    run(go())


def test_a_tenant_over_its_cluster_share_loses_its_own_least_used_kv_and_others_answers_still_read_theirs(parts):
    """The pool with a share (services/kv_tier_share.py): tenant A adds far more facts than its cap holds; B's facts
    stay in the cluster tier and B's answers on a fresh replica read them from there (counters, injected). A's
    least recently used go: a fact A's request read from the tier (touched) outlives A's older unread ones, and
    A's removed facts are answered all the same (computed, then re-encoded once, again within A's share)."""
    from inferscale_server.encoder_pool import EncoderCore
    from inferscale_server.engine_replica import EngineReplicaConfig, ReplicaCore
    from inferscale_server.kv_tier_share import TierShare
    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    a, b = "flooder", "quiet"
    size = parts.fe.encode([("Fact number 0 of the flood.", [])])[0].nbytes
    cap = 4 * size + size // 2  # four facts (the longer numbers take a token more)
    share = TierShare(registry, parts.cluster, cap)
    encoder = EncoderCore(parts.fe, parts.cluster, share=share)

    def core():
        return ReplicaCore(EngineReplicaConfig(), DictEngine(parts.fe.template, parts.fe.prefix(),
                                                             cluster=parts.cluster),
                           handle(encoder), registry, parts.cluster, None)

    def there(user, fact_ids):
        return parts.raw.batch_is_exist([parts.cluster.key(user, kv_id(f, 1)) for f in fact_ids])

    async def go():
        writer = await core().start()
        await add(parts, registry, writer, b, {"q1": "Quinn likes tea.", "q2": "Quinn has a dog."})
        await add(parts, registry, writer, a, {f"x{i}": f"Fact number {i} of the flood." for i in range(4)})
        reader = await core().start()
        await answer(reader, a, ["x0"])  # A reads x0 from the tier: now its most recently used
        await asyncio.gather(*reader.background.tasks)
        await add(parts, registry, writer, a, {"x4": "Fact number 4 of the flood."})
        assert await gone(parts, a, kv_id("x1", 1)) and there(a, ["x0", "x2", "x3", "x4"]) == [1] * 4  # not x0
        for i in range(5, 20):  # the flood: 20 facts, 5 caps
            await add(parts, registry, writer, a, {f"x{i}": f"Fact number {i} of the flood."})
        assert registry.kv_tier_bytes(a) <= cap and share.counters["share_removed"] >= 16
        assert all([await gone(parts, a, kv_id(f"x{i}", 1)) for i in range(4)])
        assert there(a, ["x17", "x18", "x19"]) == [1, 1, 1] and there(b, ["q1", "q2"]) == [1, 1]
        fresh = await core().start()
        final = await answer(fresh, b, ["q1", "q2"])
        c = await counts(fresh)
        assert c["facts_from_cluster"] == 2 and c["facts_recomputed"] == 0 and final.prefilled_tokens < final.prompt_tokens
        again = await answer(fresh, a, ["x1"])  # removed: computed (still answered), then re-encoded once
        assert again.fact_ids == ["x1"] and again.prefilled_tokens == again.prompt_tokens
        assert (await counts(fresh))["facts_recomputed"] == 1

    run(go())


def test_reads_from_the_cluster_tier_are_booked_only_where_each_user_has_a_share(parts, mooncake):
    """Marking the facts a request reads from the cluster tier used (`kv_tier_touch`, a registry call per cold
    request) serves only the per-user share's order; a tier configured without one (pool_bytes 0, no
    max_bytes_per_user) makes no such call. The module's tier has a share (the fixture's pool: its segment)."""
    from inferscale_core.cluster_store import ClusterStore
    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    touched: list[str] = []
    real_touch = registry.kv_tier_touch

    def touch(user_id, fact_ids):
        touched.append(user_id)
        return real_touch(user_id, fact_ids)

    registry.kv_tier_touch = touch
    unshared = ClusterStore(dataclasses.replace(parts.cluster.config, pool_bytes=0), parts.fe.fingerprint)
    assert unshared.config.user_cap() is None and parts.cluster.config.user_cap() is not None

    async def cold_read(cluster, user: str) -> None:
        writer = await started(parts, registry, cluster=cluster)
        await add(parts, registry, writer, user, {f"{user}1": f"{user} rows a boat.", f"{user}2": f"{user} keeps bees."})
        reader = await started(parts, registry, cluster=cluster)
        await answer(reader, user, [f"{user}1", f"{user}2"])
        await asyncio.gather(*reader.background.tasks)
        assert (await counts(reader))["facts_from_cluster"] == 2  # read from the tier, cold

    try:
        assert unshared.wait_available(60)
        run(cold_read(unshared, "nora"))
        assert touched == []
        run(cold_read(parts.cluster, "sam"))  # the same path with a share: booked
        assert touched == ["sam"]
    finally:
        unshared.close()


def test_a_write_warms_the_replica_unless_warm_at_write_is_off(parts):
    """cluster_store.warm_at_write false (a bulk import of users who will not ask soon): a write moves nothing into
    the replica's worker store, and the first answer reads the facts it names, and only those."""
    from inferscale_core.cluster_store import ClusterStore
    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    cold = ClusterStore(dataclasses.replace(parts.cluster.config, warm_at_write=False), parts.fe.fingerprint)

    async def go():
        core = await started(parts, registry, cluster=cold)
        await add(parts, registry, core, "walt", {"w1": "Walt grows figs.", "w2": "Walt flies kites.",
                                                  "w3": "Walt reads Tolstoy."})
        assert core.engine.kvs("walt") == set() and core.counters["facts_warmed"] == 0
        final = await answer(core, "walt", ["w2", "w1"])
        assert final.prefilled_tokens < final.prompt_tokens and (await counts(core))["facts_from_cluster"] == 2

    try:
        assert cold.wait_available(60)
        run(go())
    finally:
        cold.close()


def test_facts_written_are_held_at_once_so_the_next_request_reads_no_record_again(parts):
    """put_facts carries each new fact as the registry stored it (FactWrite: text, window, expiry) and the replica
    holds it from the write: the user's next request lists the versions (its sync) and reads no record again, nor
    writes the placement again (the write placed the user); before, that request read every record of the user.
    A fact changed since is read, alone; an expiry that came with the write still holds."""
    import time

    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    user = "fay"

    async def go():
        core = await started(parts, registry)
        recs = await add(parts, registry, core, user, {"fay1": "Fay keeps bees.", "fay2": "Fay sails on Sundays."},
                         expires={"fay2": time.time() + 3600})
        assert {f: (h.version, h.text, h.window, h.expires_at) for f, h in core.books.held(user).items()} == {
            r.fact_id: (r.version, r.text, tuple(r.window), r.expires_at) for r in recs}
        read, placed = [], []
        find_many, add_placement = registry.find_many, registry.add_placement
        registry.find_many = lambda u, ids: read.append(sorted(ids)) or find_many(u, ids)
        registry.add_placement = lambda u, r: placed.append(u) or add_placement(u, r)
        assert (await answer(core, user, ["fay1", "fay2"])).fact_ids == ["fay1", "fay2"]
        assert read == [] and placed == []
        assert core.books.book.synced[user] == registry.user_version(user)
        registry.update(user, "fay1", text="Fay keeps two hives.")  # not pushed here: the sync finds it
        assert (await answer(core, user, ["fay1"], Mode.PI)).fact_ids == ["fay1"]
        assert read == [["fay1"]] and core.books.held(user)["fay1"].text == "Fay keeps two hives."

    run(go())


def test_an_erased_user_is_not_placed_again_by_later_requests(parts):
    """DeleteUser removes the user's placement (the registry's hint of which replicas hold its KV) with its facts.
    A request for the user afterwards (a client still asking, a retry, a retrieval that still names a fact) finds
    nothing to hold and writes no placement again, so nothing in the registry names an erased user; a user with
    facts is placed as before, by the replica that stores them and by one that syncs them."""
    from inferscale_server.registry import open_registry

    registry = open_registry(None)
    user = "erin"

    async def go():
        core = await started(parts, registry)
        await add(parts, registry, core, user, {"erin1": "Erin paints lighthouses.", "erin2": "Erin has a kayak."})
        assert registry.placement(user) == {core.replica_id}  # put_facts places it
        await answer(core, user, ["erin1"])
        registry.delete_user(user)
        await core.forget_user(user)
        assert user not in registry.placements()
        final = await answer(core, user, ["erin1", "erin2"])  # named by a stale retrieval: not held, not served
        assert final.fact_ids == []
        await answer(await started(parts, registry), user, [])  # a replica that never held the user
        assert user not in registry.placements() and registry.placement(user) == set()
        await add(parts, registry, core, user, {"erin3": "Erin moved to Bergen."})  # back, with a fact
        reader = await started(parts, registry)
        await answer(reader, user, ["erin3"])
        assert registry.placement(user) == {core.replica_id, reader.replica_id}

    run(go())
