"""Chunked RoPE: rotate stored pre-RoPE keys to any positions with the model family's own rotary tables.

The tables come from the family's rotary module in transformers (its init handles default, llama3,
linear, yarn and dynamic scaling), and rotation follows the family's `rotate_half` convention, so a
re-rotated key equals the key the model itself would have produced at that position.
"""
from __future__ import annotations

import importlib

import torch

from .model_spec import ModelSpec


def _family_module(architecture: str):
    return importlib.import_module(f"transformers.models.{architecture}.modeling_{architecture}")


class ChunkedRope:
    def __init__(self, config, device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
        self.spec = ModelSpec.from_config(config)
        module = _family_module(self.spec.architecture)
        rotary_cls = next(v for k, v in vars(module).items() if k.endswith("RotaryEmbedding"))
        self._rotate_half = module.rotate_half
        self.device = torch.device(device)
        self.dtype = dtype or self.spec.dtype
        self._rotary = rotary_cls(config).to(self.device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, rotary_dim] in `self.dtype`, exactly as the model computes them."""
        positions = positions.to(self.device)
        if self.spec.rope_type == "dynamic" and int(positions.max()) >= self.spec.max_position_embeddings:
            raise ValueError(
                f"dynamic RoPE is only static below max_position_embeddings="
                f"{self.spec.max_position_embeddings}; got position {int(positions.max())}")
        probe = torch.empty(0, device=self.device, dtype=self.dtype)
        cos, sin = self._rotary(probe, positions[None, :])
        return cos[0], sin[0]

    def rotate(self, k_pre: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys for pre-RoPE keys `[..., T, H, D]` placed at `positions` `[T]` (new tensor)."""
        if k_pre.shape[-3] != positions.shape[0]:
            raise ValueError(f"{k_pre.shape[-3]} key tokens but {positions.shape[0]} positions")
        cos, sin = self.cos_sin(positions)
        return self.apply(k_pre, cos, sin)

    def apply(self, k_pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `[..., T, H, D]` keys with precomputed `[T, rotary_dim]` tables."""
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        r = self.spec.rotary_dim
        if r == k_pre.shape[-1]:
            return k_pre * cos + self._rotate_half(k_pre) * sin
        rot, rest = k_pre[..., :r], k_pre[..., r:]
        return torch.cat((rot * cos + self._rotate_half(rot) * sin, rest), dim=-1)
