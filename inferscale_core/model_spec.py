"""What the KV pipeline needs to know about a model, read from its Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Families whose attention is q/k/v projections + RoPE on keys + standard KV cache. Qwen3 adds a
# per-head RMSNorm on keys before RoPE (`k_norm`), which the encoder captures too.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
KEY_NORM_ARCHITECTURES = ("qwen3",)
# Families whose vLLM 0.32 implementation computes head_dim = hidden_size // num_attention_heads whatever the
# config's head_dim says (every released Qwen2 checkpoint has them equal).
DERIVED_HEAD_DIM_ARCHITECTURES = ("qwen2",)
# Scaling types whose rotary tables do not depend on the sequence being processed. "dynamic" qualifies
# only while every position stays under the original context length (then it equals "default").
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "dynamic")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # < head_dim for partial rotary
    rope_type: str
    rope_theta: float
    max_position_embeddings: int
    has_k_norm: bool
    dtype: torch.dtype

    @classmethod
    def from_config(cls, config) -> "ModelSpec":
        arch = getattr(config, "model_type", None)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {arch!r} is not supported; InferScale supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if arch in DERIVED_HEAD_DIM_ARCHITECTURES and head_dim != config.hidden_size // config.num_attention_heads:
            # transformers would run such a config; vLLM would build another model from the same weights.
            raise UnsupportedModelError(
                f"{arch} with head_dim {head_dim} != hidden_size / num_attention_heads "
                f"({config.hidden_size} / {config.num_attention_heads}): vLLM's {arch} derives the head size "
                "from hidden_size and ignores head_dim")
        rope = rope_parameters(config)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        return cls(
            architecture=arch,
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rotary_dim=int(head_dim * factor),
            rope_type=rope_type,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            max_position_embeddings=config.max_position_embeddings,
            has_k_norm=arch in KEY_NORM_ARCHITECTURES,
            dtype=dtype,
        )

    def kv_bytes(self, num_tokens: int, dtype: torch.dtype | None = None) -> int:
        """2·L·c·h·d·b: bytes of K and V for `num_tokens` tokens."""
        b = torch.empty((), dtype=dtype or self.dtype).element_size()
        return 2 * self.num_layers * num_tokens * self.num_kv_heads * self.head_dim * b


def rope_parameters(config) -> dict:
    """Rotary settings whatever the transformers version calls them (`rope_parameters` or `rope_scaling`)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params
