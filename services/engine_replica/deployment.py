"""`EngineReplica`: the Serve deployment (options in services/app.py). It builds its parts from one
EngineReplicaConfig, holds a ReplicaCore (core.py) over them, and adds what only Serve needs: the multiplexed user
loader, the routing hooks, the health check, metrics export. Every call from the gateway is the core's.

Users are multiplexed (`multiplexed_model_id` = user id): Serve routes a user to a replica that already holds
it, and a replica holds at most MAX_USERS users (Serve's LRU). Serve's loader (`_user`) only registers the
user (it runs under one lock per replica, so it must stay short); the user's facts are synced by the request
itself, under that user's own lock, so a cold user with many facts never holds up another user."""
from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os

import torch
from ray import serve

from inferscale_core.cluster_store import ClusterStore
from inferscale_core.vllm_env import below_light_work

from ..messages import AnswerRequest, FactRef, FactWrite
from ..metrics import EngineMetrics, hide_multiplexed_ids
from ..registry import open_registry
from ..routing import IN_FLIGHT, SLOT
from .config import EngineReplicaConfig
from .core import ReplicaCore
from .deletions import CLUSTER_REMOVES_PENDING
from .engine import start_engine
from .placement import HeldUser, bind_engine_cpus, replica_disk_dir, replica_slot

log = logging.getLogger("inferscale.engine_replica")
MAX_USERS = int(os.environ.get("INFERSCALE_ENGINE_MAX_USERS", "256"))


def import_vllm() -> None:
    """The modules start_engine needs (vLLM's AsyncLLM and engine arguments, transformers' tokenizer), imported
    ahead: run on a thread while the replica waits for the encoder pool."""
    for module in ("transformers", "vllm.engine.arg_utils", "vllm.v1.engine.async_llm"):
        importlib.import_module(module)


class EngineReplica:
    """`build_engine`: how the engine is made (default `start_engine`: vLLM with the connector)."""

    # An async __init__ (mypy allows only None): Serve awaits it before the replica takes requests.
    async def __init__(self, encoder, config: EngineReplicaConfig, build_engine=None):  # type: ignore[misc]
        from inferscale_core.defaults import serving_store_options
        from inferscale_core.store import default_disk_budget_bytes

        hide_multiplexed_ids()  # before the first @serve.multiplexed call: user ids never become labels
        # vLLM's modules load while the encoder pool answers (at an app's start the pool is starting too: 5-30 s
        # here), not after: importing them is ~8 s of one core on the reference 2-core node.
        vllm_loaded = asyncio.get_running_loop().run_in_executor(None, import_vllm) if build_engine is None else None
        # The encoder pool's fingerprint (the pool defines how facts are encoded) keys both KV tiers below.
        fingerprint = await encoder.fingerprint.remote()
        disk_dir = replica_disk_dir(config.kv_dir, fingerprint)
        options = serving_store_options(config.store_options)
        if disk_dir:
            options["disk_dir"] = disk_dir
            if options.get("disk_budget_bytes") is None:  # the disk tier's budget: from the machine by default
                options["disk_budget_bytes"] = default_disk_budget_bytes(disk_dir)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        engine_cpus = bind_engine_cpus(config.engine_cpu_cores, device)
        # Below the node's light work, before vLLM's engine core is spawned (it inherits the niceness).
        niceness = below_light_work(device)
        # The cluster KV tier: the connector's worker reads it (a client of its own); this process only removes
        # from it.
        cluster_config = config.cluster
        if cluster_config:
            options["cluster_store"] = dataclasses.asdict(cluster_config)
            options["kv_fingerprint"] = fingerprint
        # The instruction prefix is encoded by the pool that encodes the facts: one encoder, one layout.
        prefix = await encoder.prefix.remote()
        if vllm_loaded is not None:
            await vllm_loaded
        self.engine = await (build_engine or start_engine)(config, prefix, options)
        # Removes the cluster tier could not take while it was away are kept in the slot's disk folder: the
        # tombstone cursor moves past them, and a replica restarted meanwhile in this slot still does them.
        pending = os.path.join(disk_dir, CLUSTER_REMOVES_PENDING) if disk_dir else None
        cluster = ClusterStore(cluster_config, fingerprint, pending_file=pending) if cluster_config else None
        if cluster is not None:
            cluster.start()
        self.core = ReplicaCore(config, self.engine, encoder, open_registry(config.registry_url), cluster, disk_dir,
                                EngineMetrics(), options.get("disk_budget_bytes"), hold=self._user)
        self.core.engine_cpus, self.core.engine_niceness = engine_cpus, niceness
        await self.core.start()
        loop = asyncio.get_running_loop()
        self._exporter = loop.create_task(self._export_engine_metrics())
        self._watcher = loop.create_task(self.core.watch())

    # ------------------------------------------------------------------------------ Serve's hooks
    def record_replica_metadata(self) -> dict:
        """Serve's hook (once, at start): this replica's stable slot for services/routing.py."""
        return {SLOT: replica_slot()}

    def record_routing_stats(self) -> dict:
        """Serve's hook (every request_routing_stats_period_s): the slot again (in case Serve re-ranked) and the
        requests in flight here, from every router (services/routing.py moves users off a busy home)."""
        return {SLOT: replica_slot(), IN_FLIGHT: self.core.admission.in_flight}

    @serve.multiplexed(max_num_models_per_replica=MAX_USERS)
    async def _user(self, user_id: str) -> HeldUser:
        """Serve's loader, run under ONE lock for the whole replica: it only registers the user. Its facts are
        synced by the core, under the user's own lock."""
        await self.core.register_user(user_id)
        return HeldUser(self.core.unload, user_id, asyncio.get_running_loop())

    async def check_health(self) -> None:
        """Serve's replica health check (every health_check_period_s): a replica whose vLLM engine died (its
        engine-core process is gone) raises here, so Serve replaces it and its users move to a live one."""
        await self.engine.check_health()  # raises EngineDeadError once vLLM has seen its engine core die

    # ------------------------------------------------------------------------------ called by the gateway
    async def put_facts(self, user_id: str, facts: list[FactWrite], encoded: list) -> int:
        return await self.core.put_facts(user_id, facts, encoded)

    async def forget(self, user_id: str, facts: list[FactRef]) -> int:
        return await self.core.forget(user_id, facts)

    async def forget_user(self, user_id: str) -> int:
        return await self.core.forget_user(user_id)

    async def answer(self, req: AnswerRequest):
        async for piece in self.core.answer(req):
            yield piece

    async def chat(self, user_id: str, messages: list[dict], max_tokens: int = 256, temperature: float = 0.0,
                   structured: dict | None = None) -> str:
        return await self.core.chat(user_id, messages, max_tokens, temperature, structured)

    async def chat_room(self, user_id: str, messages: list[dict]) -> int:
        return await self.core.chat_room(user_id, messages)

    async def load_user(self, user_id: str) -> str:
        return await self.core.load_user(user_id)

    async def holds(self, user_id: str, facts: list[tuple[str, int]], with_replica: bool = False):
        return await self.core.holds(user_id, facts, with_replica)

    async def stats(self) -> dict:
        return await self.core.stats()

    async def health(self) -> str:
        return await self.core.health()

    async def _export_engine_metrics(self, period_s: float = 5.0) -> None:
        """Copies the engine's counters (injected tokens, store hits and resident bytes per tier) into the
        replica's Prometheus metrics."""
        while True:
            try:
                self.core.metrics.engine_snapshot(await self.engine.metrics())
            except Exception as e:  # noqa: BLE001 - a dead engine is check_health's business
                log.debug("engine metrics unavailable: %s", e)
            await asyncio.sleep(period_s)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
