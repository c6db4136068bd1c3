"""A caller's heavy work in the gateway (filter scans, large bodies) runs on threads at the lowest priority, kept
off the engine's cores where the engine left the node's first ones to the light work (services/gateway/
caller_work.py): read back from the threads themselves, and through Mem0's client against a real Redis."""
from __future__ import annotations

import asyncio
import os
import threading
import uuid

import pytest
from support.auth_fixture import token_for, token_gateway
from support.http_thread import HttpThread

from inferscale_core.vllm_env import LIGHT_WORK_CORES, usable_cpus
from inferscale_server.gateway.caller_work import CALLER_WORK_NICENESS, CallerWorkPool, light_cores
from inferscale_server.gateway.http_front import build_http_app
from inferscale_server.limits import Limits
from inferscale_server.registry import RedisRegistry

os.environ.setdefault("MEM0_TELEMETRY", "false")  # read at mem0's import: no usage events posted
pytest.importorskip("mem0")
from mem0 import MemoryClient


def _where() -> tuple[int, set[int]]:
    """The calling thread's niceness and cores."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), os.sched_getaffinity(0)


def test_the_pools_threads_lower_themselves_and_keep_to_their_cores():
    before = _where()
    first = usable_cpus()[:1]
    pinned, anywhere = CallerWorkPool(first, threads=2), CallerWorkPool(None, threads=2)

    async def both():
        return await pinned.run(_where), await anywhere.run(_where)

    (nice_pinned, cores_pinned), (nice_any, cores_any) = asyncio.run(both())
    assert nice_pinned == nice_any == CALLER_WORK_NICENESS
    assert cores_pinned == set(first) and cores_any == before[1]
    assert _where() == before  # the caller's own thread (the event loop's, in a gateway) is untouched
    pinned.shutdown()
    anywhere.shutdown()


def test_light_cores_only_where_the_engine_leaves_them():
    assert light_cores(True, [0, 1, 2, 3]) == [0, 1, 2, 3][:LIGHT_WORK_CORES]
    assert light_cores(False, [0, 1, 2, 3]) is None  # engines given cores of their own, or on a GPU
    assert light_cores(True, [5][:LIGHT_WORK_CORES]) is None  # one core: nothing to keep off
    with pytest.raises(ValueError, match="at least one core"):
        CallerWorkPool([])
    with pytest.raises(ValueError, match="threads must be at least 1"):
        CallerWorkPool(None, threads=0)


class _Watched(CallerWorkPool):
    """Records what ran on the pool, with the niceness and cores of the thread it ran on."""

    def __init__(self, cores):
        super().__init__(cores)
        self.ran: list[tuple[str, int, set[int]]] = []

    async def run(self, fn, *args):
        def watched(*a):
            self.ran.append((getattr(fn, "__name__", "?"), *_where()))
            return fn(*a)
        return await super().run(watched, *args)


def test_a_filtered_listing_through_mem0s_client_is_scanned_on_the_low_threads(redis_url, jwt_secret):
    """Mem0's get_all with a filter, through the real HTTP door: the scan (`_matching`) ran on a caller-work
    thread at the lowest priority on the light cores; the answer is the filter's."""
    registry = RedisRegistry(redis_url, prefix=f"cw{uuid.uuid4().hex[:8]}:")
    core = token_gateway(registry, jwt_secret, Limits())
    cores = usable_cpus()[:1]
    core.caller_work = watched = _Watched(cores)
    server = HttpThread(build_http_app(lambda: core))
    try:
        user = f"u{uuid.uuid4().hex[:8]}"
        client = MemoryClient(api_key=token_for(jwt_secret[1], user), host=server.url)
        for i in range(5):
            client.add(f"fact number {i}", infer=False, metadata={"n": i % 2})
        got = client.get_all(filters={"n": {"in": [1]}})
        assert got["count"] == 2 and sorted(r["memory"] for r in got["results"]) == ["fact number 1",
                                                                                       "fact number 3"]
        scans = [r for r in watched.ran if r[0] == "_matching"]
        assert scans and all(nice == CALLER_WORK_NICENESS and set(c) == set(cores) for _, nice, c in scans)
    finally:
        server.stop()
        registry.close()
