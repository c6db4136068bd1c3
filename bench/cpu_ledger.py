"""Where the cores went: CPU seconds (user + system) of this process and its descendants, by part, between marks.

bench/service.py marks each cell's end, so a cell's CPU is split by the service's parts (each deployment's
replicas, Serve's proxy and controller, Ray's own daemons, Mooncake, Redis, the load client, this driver). Divided
by the cell's requests it is the CPU each part spends per request: on a machine whose cores are all busy, the
engines get what the other parts leave, so the parts that are not the engine are the service's overhead.

A process is named once, by its command line when first seen (Ray's workers title themselves
`ray::ServeReplica:<app>:<Deployment>`), or, when that names nothing, by its parent (vLLM's `VLLM::EngineCore`
is its engine replica's, or the engine alone's), and keeps that name. The engine core's own share of its part is
kept beside (`vllm_core_marks`): what of an engine replica's CPU is vLLM's engine core, and what is the replica's
process around it (Serve, the books, the answers' pieces). A process that ends between two marks
loses its CPU since the earlier mark (psutil cannot read a dead process); one that starts counts from zero.
"""
from __future__ import annotations

import os
import re

import psutil

VLLM_CORE = "VLLM::EngineCore"  # the title vLLM gives its engine core process
SERVE_REPLICA = re.compile(r"ServeReplica:[^:\s]+:([A-Za-z0-9_]+)")
# (substring of the command line, part), first match wins; the Serve replicas are matched before these.
PARTS = (("ProxyActor", "serve proxy"), ("ServeController", "serve controller"), ("mooncake", "mooncake"),
         ("redis-server", "redis"), ("gcs_server", "ray daemons"), ("raylet", "ray daemons"),
         ("dashboard", "ray daemons"), ("log_monitor", "ray daemons"), ("ray::", "ray workers"),
         ("ray/", "ray daemons"))


def part_of(cmdline: str) -> str:
    """The part a process belongs to, from its command line."""
    m = SERVE_REPLICA.search(cmdline)
    if m:
        return m.group(1)
    return next((part for needle, part in PARTS if needle in cmdline), "other")


class CpuLedger:
    """CPU seconds by part between marks, over this process (`driver`) and every descendant. `named` gives some
    pids a part of their own (e.g. the load client)."""

    def __init__(self, driver: str = "bench driver"):
        self.driver = driver
        self.named: dict[int, str] = {}
        self._parts: dict[int, str] = {}
        self._last: dict[int, float] = {}
        self.marks: list[tuple[str, dict[str, float]]] = []
        self.vllm_core_marks: list[tuple[str, dict[str, float]]] = []  # per mark: part -> its vLLM cores' share
        self._vllm_cores: set[int] = set()

    def _read(self) -> dict[int, float]:
        me = psutil.Process(os.getpid())
        self._parts.setdefault(me.pid, self.driver)
        procs = me.children(recursive=True)
        parents: dict[int, int] = {}
        for proc in procs:
            if proc.pid not in self._parts:
                try:
                    parents[proc.pid] = proc.ppid()
                    cmdline = " ".join(proc.cmdline())
                    part = self.named.get(proc.pid) or part_of(cmdline)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                if VLLM_CORE in cmdline:
                    self._vllm_cores.add(proc.pid)
                if part != "other":
                    self._parts[proc.pid] = part
        for pid in parents:  # the unnamed ones take their parent's part (parents named first, whatever the order)
            chain = [pid]
            while chain[-1] not in self._parts and chain[-1] in parents:
                chain.append(parents[chain[-1]])
            self._parts[pid] = self._parts.get(chain[-1], "other")
        seen: dict[int, float] = {}
        for proc in [me, *procs]:
            if proc.pid in self._parts:
                try:
                    t = proc.cpu_times()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                seen[proc.pid] = t.user + t.system
        return seen

    def part(self, pid: int) -> str | None:
        """The part a process of the tree was charged to (None: not seen yet)."""
        return self._parts.get(pid)

    def start(self) -> None:
        """The baseline of the next mark."""
        self._last = self._read()

    def mark(self, label: str) -> dict[str, float]:
        """CPU seconds by part since the previous mark (or start), recorded under `label`; the next interval
        starts here."""
        now = self._read()
        spent: dict[str, float] = {}
        in_cores: dict[str, float] = {}
        for pid, cpu in now.items():
            delta = cpu - self._last.get(pid, 0.0)
            if delta > 0:
                part = self._parts[pid]
                spent[part] = spent.get(part, 0.0) + delta
                if pid in self._vllm_cores:
                    in_cores[part] = in_cores.get(part, 0.0) + delta
        self._last = now
        out = {k: round(v, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
        self.marks.append((label, out))
        self.vllm_core_marks.append((label, {k: round(v, 3) for k, v in in_cores.items()}))
        return out
