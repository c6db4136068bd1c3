"""InferScale core: encode memory facts once as pre-RoPE KV, store and index them, compose with chunked RoPE.

Pipeline: encode (encoder.PreRopeEncoder) -> store (store.FactStore) -> index (index.VectorIndex) ->
compose (compose.compose) -> inject (connector.InferScaleConnector in vLLM, hf_inject for transformers).
"""
from .compose import Composition, compose, serving_order
from .encoder import PreRopeEncoder, capture_pre_rope
from .model_spec import ModelSpec, UnsupportedModelError
from .rope import ChunkedRope
from .template import PromptTemplate
from .types import EncodedFact

__all__ = ["ChunkedRope", "Composition", "EncodedFact", "ModelSpec", "PreRopeEncoder", "PromptTemplate",
           "UnsupportedModelError", "capture_pre_rope", "compose", "serving_order"]
