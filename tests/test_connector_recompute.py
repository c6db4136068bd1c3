"""`recompute_tokens`: the connector leaves the memory's last N tokens to vLLM, which computes them with the
query (so they attend to the whole memory). Its own engine (vLLM keeps one connector per process), so it is a
module of its own; helpers come from test_connector."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from test_connector import (BLOCK, M, block_diagonal_reference, build_tiny_model, close_harness,  # noqa: E402
                            layout, open_harness)

from inferscale_core.connector import injectable_tokens, recompute_tokens_option  # noqa: E402

RECOMPUTE = 20


def test_injectable_tokens_leaves_recompute_tokens_to_vllm():
    assert injectable_tokens(prompt_len=200, memory_len=145, recompute_tokens=20) == 125
    assert injectable_tokens(prompt_len=200, memory_len=145, recompute_tokens=145) == 0
    assert injectable_tokens(prompt_len=200, memory_len=145, recompute_tokens=500) == 0
    assert recompute_tokens_option({}) == 0 and recompute_tokens_option({"recompute_tokens": 7}) == 7
    for bad in (-1, 2.5, "3", True):
        with pytest.raises(ValueError, match="recompute_tokens must be an integer >= 0"):
            recompute_tokens_option({"recompute_tokens": bad})


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    from inferscale_core.engine import kv_transfer_config

    h = open_harness(build_tiny_model("llama", tmp_path_factory.mktemp("llama")),
                     kv_transfer_config=kv_transfer_config({"recompute_tokens": RECOMPUTE}))
    yield h
    close_harness(h)


def test_last_memory_tokens_are_computed_with_the_query(harness):
    h = harness
    chunks, query = layout(7000)
    fids = ["r1", "r2", "r3", "r4"]
    h.register("recompute", "prefix-recompute", fids, h.encode_apart(chunks))
    before = h.metrics()
    (out,) = h.run(h.injected("recompute", "prefix-recompute", fids, chunks, query))
    after = h.metrics()
    n_inj = M - RECOMPUTE
    assert n_inj % BLOCK and out.num_cached_tokens == n_inj  # the load ends inside a block
    assert after["prompt_tokens_external_kv_transfer"] - before["prompt_tokens_external_kv_transfer"] == n_inj
    # Facts encoded apart: injected tokens see only their own fact; the recomputed tail sees everything.
    tokens, ref_lp = block_diagonal_reference(h.model, chunks, query, n_inj, steps=16)
    assert list(out.outputs[0].token_ids) == tokens
    diff = max(abs(step[t].logprob - float(lp[t])) for step, lp in zip(out.outputs[0].logprobs, ref_lp) for t in step)
    assert diff < 1e-4
    # ...and it is not the same computation as injecting the whole memory.
    tokens_all, lp_all = block_diagonal_reference(h.model, chunks, query, M, steps=1)
    assert abs(float(lp_all[0][tokens_all[0]]) - out.outputs[0].logprobs[0][tokens_all[0]].logprob) > 1e-4
