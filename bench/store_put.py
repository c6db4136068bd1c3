"""What a fact put into a CPU worker store costs inside vLLM's engine core, with its cores idle and busy.

The engine core runs torch with one intra-op thread per core (inferscale_core/vllm_env.py). A put copies the
fact's K and V (FactStore._copy); torch splits a copy of that size over its threads, and while other processes
keep the cores busy (the encoder pool, the replica, other requests) each split waits for a time slice. The
store copies with one thread (inferscale_core.store.host_copy). This compares the two copies, and the store's
whole put with and without its disk tier, on SmolLM2-135M-shaped facts (30 layers, 3 KV heads, dim 64, 25
tokens), alone and beside another torch process computing on every core, at the same priority and niced (a
batch job, or the bench itself beside a service at another priority). Each measurement stops after --cell-s.

    python bench/store_put.py --facts 100
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.eval import serving
from inferscale_core.store import FactStore, host_copy
from inferscale_core.types import EncodedFact

LAYERS, HEADS, DIM, TOKENS = 30, 3, 64, 25


def _torch_neighbour(stop, threads: int, nice: int) -> None:
    """Another torch process on the same cores (the encoder pool, a second engine, a batch job): matmuls on
    every core, at priority `nice`."""
    os.nice(nice)
    torch.set_num_threads(threads)
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def fact(dtype: torch.dtype, seed: int) -> EncodedFact:
    g = torch.Generator().manual_seed(seed)
    return EncodedFact(torch.arange(TOKENS), torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=g).to(dtype),
                       torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=g).to(dtype))


def per_fact_ms(fn, facts: list[EncodedFact], budget_s: float) -> str:
    """Median over the facts of one call's time, in ms; stops after `budget_s` (a starved copy can take seconds)
    and then says over how many facts."""
    times, t_end = [], time.perf_counter() + budget_s
    for i, f in enumerate(facts):
        t = time.perf_counter()
        fn(i, f)
        times.append(time.perf_counter() - t)
        if time.perf_counter() > t_end:
            break
    cell = f"{statistics.median(times) * 1000:.2f}"
    return cell if len(times) == len(facts) else f"{cell} ({len(times)} facts in {budget_s:.0f} s)"


def measure(dtype: torch.dtype, n: int, disk_root: str, budget_s: float) -> dict[str, str]:
    facts = [fact(dtype, i) for i in range(n)]
    torch_copy = lambda _, f: (f.k_pre.to("cpu", copy=True), f.v.to("cpu", copy=True))  # noqa: E731
    one_thread = lambda _, f: (host_copy(f.k_pre), host_copy(f.v))  # noqa: E731
    memory = FactStore(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=dtype)
    disk = FactStore(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=dtype,
                     disk_dir=tempfile.mkdtemp(dir=disk_root))
    return {"torch copy (K+V)": per_fact_ms(torch_copy, facts, budget_s),
            "one-thread copy (K+V)": per_fact_ms(one_thread, facts, budget_s),
            "store put, memory": per_fact_ms(lambda i, f: memory.put("u", f"f{i}", f), facts, budget_s),
            "store put, memory + disk": per_fact_ms(lambda i, f: disk.put("u", f"f{i}", f), facts, budget_s)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--facts", type=int, default=100, help="facts per measurement (the median is reported)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (vLLM: one a core)")
    p.add_argument("--cell-s", type=float, default=20.0, help="time limit of one measurement (default %(default)s)")
    a = p.parse_args(argv)
    if a.facts < 1 or a.threads < 1:
        p.error("--facts and --threads must be >= 1")
    torch.set_num_threads(a.threads)
    m = serving.machine()
    print(f"{m['cpu_model']}, {os.cpu_count()} cores, torch {a.threads} threads; "
          f"lscpu flags: {' '.join(m['cpu_flags'])}; load {os.getloadavg()[0]:.1f} at start")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for nice in (None, 0, 19):  # alone; beside a torch process at the same priority; beside a niced one
            stop = multiprocessing.Event()
            spinners = [multiprocessing.Process(target=_torch_neighbour, args=(stop, a.threads, nice), daemon=True)
                        for _ in range(nice is not None)]
            for s in spinners:
                s.start()
            time.sleep(1.0 if spinners else 0.0)
            try:
                for dtype in (torch.bfloat16, torch.float32):
                    where = "none" if nice is None else f"torch, nice {nice}"
                    rows.append((where, str(dtype).split(".")[1], measure(dtype, a.facts, root, a.cell_s)))
            finally:
                stop.set()
                for s in spinners:
                    s.join(5)
    names = list(rows[0][2])
    print(f"\nms per fact (median of {a.facts}); load {os.getloadavg()[0]:.1f} at end\n")
    print("| neighbour process | dtype | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for where, dtype, r in rows:
        print(f"| {where} | {dtype} | " + " | ".join(r[n] for n in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
