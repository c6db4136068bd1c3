"""The gateway's threads for work that a caller's own request makes heavy: filter scans over a user's facts, the
parsing of a large body. They run below everything else on the node, and off the engine's cores where it has some.

Why: on a CPU node vLLM's engine runs each layer as OpenMP regions ending in a barrier, one thread per core of its
own, and Ray's replicas (the gateway among them) run at niceness 15 against the engine's 19 (docs/benchmarks/
lab-notes.md, "The engine beside the light work"). A tenant's legal but heavy filter scans (a quarter of a core
under its work budget) then preempted the engine's threads and the encoder's, and every other tenant's answers
and adds waited at their barriers (BENCHMARKS.md, "Noisy neighbour": `filter`, `filter_scan`). In these threads
the same work runs at niceness 19 (Linux keeps a niceness per thread), and, where the engine replica left the
node's first cores to the light work (`engine_cpu_cores` 0 on a CPU node: vllm_env.LIGHT_WORK_CORES), only there.
A thread at 19 still gets its share of a busy core (never starved while it holds the GIL, which a SCHED_IDLE
thread could be); the well-behaved requests' own work, at 15, goes first.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger("inferscale.gateway")
T = TypeVar("T")

CALLER_WORK_NICENESS = 19  # the lowest priority a normal thread can have
# As many as asyncio's default pool would give these calls on a 2-core node (cores + 4): a scan waits on Redis
# between its batches, so a few run at once; more would only queue CPU work behind the same cores.
CALLER_WORK_THREADS = 6


def light_cores(engine_leaves_light_cores: bool, cpus: Sequence[int]) -> list[int] | None:
    """The cores caller work may use on this node: the first LIGHT_WORK_CORES of `cpus` when the engine replica
    keeps off them (and there are others for it), else None (any core: an engine on a GPU, or engines given
    cores of their own with `engine_cpu_cores`, which may include the first)."""
    from inferscale_core.vllm_env import LIGHT_WORK_CORES

    if not engine_leaves_light_cores or len(cpus) <= LIGHT_WORK_CORES:
        return None
    return list(cpus[:LIGHT_WORK_CORES])


class CallerWorkPool:
    """A thread pool whose threads lower their own priority to CALLER_WORK_NICENESS and keep to `cores` (None:
    wherever the process may run). `run(fn, *args)` awaits `fn(*args)` on one of them."""

    def __init__(self, cores: Sequence[int] | None = None, threads: int = CALLER_WORK_THREADS):
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.cores = sorted(cores) if cores is not None else None
        if self.cores is not None and not self.cores:
            raise ValueError("cores must name at least one core, or be None for any")
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="caller-work", initializer=self._lower)

    def _lower(self) -> None:
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(CALLER_WORK_NICENESS, os.getpriority(os.PRIO_PROCESS, tid)))
            if self.cores is not None:
                os.sched_setaffinity(0, self.cores)  # 0: the calling thread (Linux keeps affinity per thread)
        except (OSError, AttributeError) as err:  # not Linux, or a core outside the cpuset: run as the process does
            log.warning("caller-work thread keeps the process's priority and cores (%s)", err)

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
