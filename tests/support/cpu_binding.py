"""Which cores an engine replica's threads are bound to, read from the kernel (/proc via sched_getaffinity), not
from what the replica reports."""
from __future__ import annotations

import os


def tree_threads(proc) -> list[int]:
    """The thread ids of `proc` and of every process under it (a replica's vLLM engine core included)."""
    return [t.id for p in [proc, *proc.children(recursive=True)] for t in p.threads()]


def bound_cpus(pid: int) -> set[int]:
    """The cores of every thread in a replica's process tree (its vLLM engine core included) that is bound to
    fewer than all the usable cores: what the OpenMP binding actually did."""
    import psutil

    from inferscale_core.vllm_env import usable_cpus

    every, out = set(usable_cpus()), set()
    for tid in tree_threads(psutil.Process(pid)):
        try:
            cpus = os.sched_getaffinity(tid)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            continue
        if cpus != every:
            out |= cpus
    return out
