"""Where an engine replica sits: its Serve slot and ids (services/routing.py routes users by the slot), the cores
its vLLM binds to when replicas share a node, its node-local disk folder, and the handle Serve's multiplexed
loader keeps for each user held here. Outside Serve (a direct test) every lookup has a one-replica answer."""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from pathlib import Path

from ray import serve

from inferscale_core.vllm_env import cores_beside_light_work, engine_bind_env, engine_cpus, usable_cpus

log = logging.getLogger("inferscale.engine_replica")


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


def bind_engine_cpus(cores_per_engine: int, device: str) -> list[int] | None:
    """Before vLLM starts (its engine core process inherits the environment): bind its compute threads to this
    replica's own cores when replicas share the node (`cores_per_engine` > 0), or, on a CPU node it has to itself
    (0), to every core but the light work's (vllm_env.cores_beside_light_work); None, environment untouched,
    otherwise (a GPU node's engine computes on the GPU)."""

    cpus = usable_cpus()
    if cores_per_engine == 0:
        mine = cores_beside_light_work(cpus) if device == "cpu" else None
    else:
        mine = engine_cpus(cores_per_engine, replica_local_rank(), cpus)
        if mine is None:
            log.warning("engine_cpu_cores=%d: no free run of cores for node-local rank %d on cores %s; this "
                        "replica's vLLM uses all of them, shared", cores_per_engine, replica_local_rank(), cpus)
    if mine is None:
        return None
    os.environ.update(engine_bind_env(mine))
    return mine


def replica_disk_dir(kv_dir: str | None, fingerprint: str) -> str | None:
    """`{kv_dir}/{app}/{deployment}/slot-{local rank}/kv-{fingerprint}`: stable across restarts of the replica in
    that slot, so a restarted replica finds its predecessor's files, and never shared by two live replicas. The
    encoder pool's fingerprint (model, stored dtype, instruction prefix: what a fact's KV depends on) names the
    last folder, so a change of configuration starts an empty tier instead of meeting files it cannot read;
    the other configurations' folders are left as they are (switching back finds them) and named in a warning."""
    if not kv_dir:
        return None
    try:
        ctx = serve.get_replica_context()
        app, dep, slot = ctx.app_name, ctx.deployment, ctx.rank.local_rank
    except Exception:  # noqa: BLE001 - outside Serve (a direct test): one slot
        app, dep, slot = "local", "EngineReplica", 0
    slot_dir = Path(kv_dir).expanduser() / app / dep / f"slot-{slot}"
    path = slot_dir / f"kv-{fingerprint}"
    path.mkdir(parents=True, exist_ok=True)
    stale = sorted(p for p in slot_dir.iterdir() if p != path and p.is_dir())
    if stale:
        log.warning("disk tier %s: %d folder(s) beside it hold facts of another model, dtype or prefix and are not "
                    "read (delete them to free the disk): %s", path, len(stale), ", ".join(map(str, stale)))
    return str(path)


class HeldUser:
    """What the multiplexed loader hands Serve. Serve calls __del__ when it evicts the user (LRU), in a thread;
    Python calls it again when the object dies, hence the flag. `unload(user_id)` runs on the replica's loop."""

    def __init__(self, unload: Callable[[str], Coroutine], user_id: str, loop: asyncio.AbstractEventLoop):
        self.unload, self.user_id, self.loop, self.released = unload, user_id, loop, False

    def __del__(self):
        if self.released:
            return
        self.released = True
        try:  # Serve runs this in a thread: hand the unload to the replica's loop
            asyncio.run_coroutine_threadsafe(self.unload(self.user_id), self.loop)
        except RuntimeError:  # the loop is closed: the replica is going away anyway
            pass
