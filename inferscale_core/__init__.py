"""InferScale core: encode memory facts once as pre-RoPE KV, store and index them, compose with chunked RoPE.

Pipeline: encode (encoder.PreRopeEncoder) -> store (store.FactStore) -> index (index.VectorIndex) ->
compose (compose.compose) -> inject (connector.InferScaleConnector in vLLM; bench/hf_inject.py does it for a
transformers model, the reference the tests compare against).

The names below are imported on first use (PEP 562), so that importing a light submodule
(`inferscale_core.errors`, `inferscale_core.vllm_env`) does not import torch.
"""
from importlib import import_module

_EXPORTS = {"Composition": "compose", "compose": "compose", "serving_order": "ordering",
            "PreRopeEncoder": "encoder", "capture_pre_rope": "encoder",
            "ModelSpec": "model_spec", "UnsupportedModelError": "model_spec",
            "ChunkedRope": "rope", "PromptTemplate": "template", "EncodedFact": "types"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
