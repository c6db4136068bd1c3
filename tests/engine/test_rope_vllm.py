"""The rotary table the connector rotates injected keys with (`connector_worker.rotary_table`, built from
transformers' rotary class) is vLLM's own: equal, bit for bit, to the `cos_sin_cache` of vLLM's `get_rope(...)`
that rotates the queries, for every supported family and scaling type, in fp32 and bf16; and vLLM's rotary op
with that table rotates keys as transformers does. (tests/engine/test_connector_families.py checks, in a running
engine, that the table is the one the loaded model's attention layers hold.)"""
from __future__ import annotations

import pytest
import torch
from support.tiny_models import tiny_config

from inferscale_core.connector_worker import rotary_table
from inferscale_core.model_spec import ModelSpec
from inferscale_core.rope import ChunkedRope

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MAX_POSITIONS = 4096


@pytest.fixture(scope="module")
def vllm_context():
    """get_rope builds vLLM CustomOps, which read the current vLLM config."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def vllm_table(cfg, spec: ModelSpec, dtype: torch.dtype) -> torch.Tensor:
    """What vLLM 0.32's Llama, Mistral, Qwen2 and Qwen3 attention layers build (head_dim, max_position =
    config.max_position_embeddings, the config's rope_parameters, neox style, the model dtype)."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    return get_rope(spec.head_dim, max_position=cfg.max_position_embeddings, rope_parameters=cfg.rope_parameters,
                    is_neox_style=True, dtype=dtype).cos_sin_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_serving_table_equals_vllms_get_rope(vllm_context, family, rope, dtype):
    cfg = tiny_config(family, rope_parameters=dict(ROPES[rope]), hidden_size=256, head_dim=64,
                      max_position_embeddings=MAX_POSITIONS)
    spec = ModelSpec.from_config(cfg)
    assert spec.rope_type == rope
    ours = rotary_table(cfg, spec, MAX_POSITIONS, torch.device("cpu"), dtype)
    theirs = vllm_table(cfg, spec, dtype)
    assert ours.dtype == theirs.dtype == dtype
    # vLLM's table may be longer (linear: max_position x factor); every position the connector can write is
    # covered and equal.
    assert ours.shape[0] == MAX_POSITIONS <= theirs.shape[0] and ours.shape[1] == theirs.shape[1] == spec.rotary_dim
    assert torch.equal(ours, theirs[:MAX_POSITIONS])


@pytest.mark.parametrize("rope", list(ROPES))
def test_vllm_rotary_op_with_the_table_rotates_like_transformers(vllm_context, rope):
    from vllm import _custom_ops as ops

    cfg = tiny_config("llama", rope_parameters=dict(ROPES[rope]), head_dim=64, max_position_embeddings=MAX_POSITIONS)
    spec = ModelSpec.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, MAX_POSITIONS, (50,), generator=g)
    k_pre = torch.randn(50, spec.num_kv_heads, spec.head_dim, generator=g)
    expected = ChunkedRope(cfg, dtype=torch.float32).rotate(k_pre, positions)
    got = k_pre.clone()  # the op rotates in place
    ops.rotary_embedding(positions, got.view(50, -1), None, spec.head_dim,
                         rotary_table(cfg, spec, MAX_POSITIONS, torch.device("cpu"), torch.float32), True)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
