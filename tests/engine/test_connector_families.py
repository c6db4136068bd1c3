"""The vLLM injection exactness checks of test_connector.py (tests/support/connector_harness.py), run for the
other supported families and scalings: tiny random Mistral, Qwen2 and a Llama with llama3 RoPE scaling (test_connector.py covers Llama and Qwen3).
Each family gets its own engine (vLLM keeps one connector per process); per family, the worker's rotary table
is checked against the one the loaded model's attention layers rotate queries with."""
from __future__ import annotations

import pytest
import torch
from support.connector_harness import (
    FACT_LENS,
    build_tiny_model,
    check_facts_encoded_apart_equal_block_diagonal_reference,
    check_joint_memory_equals_prompt_injection_also_in_mixed_batch,
    close_harness,
    open_harness,
)


@pytest.fixture(scope="module", params=["mistral", "qwen2", "llama3"])
def harness(request, tmp_path_factory):
    # hidden 256 = 4 heads x head_dim 64, as in real checkpoints (vLLM's Qwen2 derives head_dim from it).
    h = open_harness(build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), hidden_size=256))
    yield h
    close_harness(h)


def test_worker_rotates_with_the_models_own_rotary_table(harness):
    h = harness
    tables = h.llm.apply_model(lambda model: [layer.self_attn.rotary_emb.cos_sin_cache.clone()
                                              for layer in model.model.layers])
    ours = h.worker.cos_sin_cache
    for table in tables[0]:
        assert ours.dtype == table.dtype and ours.shape[0] <= table.shape[0]
        assert torch.equal(ours, table[:ours.shape[0]].to(ours.device))


def test_joint_memory_injected_equals_prompt_injection(harness):
    check_joint_memory_equals_prompt_injection_also_in_mixed_batch(harness)


def test_facts_encoded_apart_equal_block_diagonal_reference(harness):
    check_facts_encoded_apart_equal_block_diagonal_reference(harness, FACT_LENS)
