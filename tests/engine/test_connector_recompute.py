"""What of the memory vLLM computes with the query instead of the connector injecting it (so it attends to the
whole memory): `recompute_tokens` (the memory's last N tokens) and `recompute_facts` (its last r facts, whole;
the longer suffix wins when both are set). vLLM keeps one connector per process, so this is a module of its own;
its engines (one per connector configuration) run one after the other. Helpers come from tests/support/connector_harness.py."""
from __future__ import annotations

import pytest
from support.connector_harness import (
    BLOCK,
    FACT_LENS,
    M,
    assert_same,
    block_diagonal_reference,
    build_tiny_model,
    close_harness,
    layout,
    open_harness,
)

from inferscale_core.connector import injectable_tokens, recompute_tokens_option
from inferscale_core.connector_types import (
    InjectionParams,
    memory_hash,
    recompute_facts_max_k_option,
    recompute_facts_option,
    recomputed_suffix,
)
from inferscale_core.defaults import RECOMPUTE_FACTS, RECOMPUTE_FACTS_MAX_K

RECOMPUTE = 20
# The engines' connector options, by fixture parameter.
CONFIGS = {"tokens20": {"recompute_tokens": RECOMPUTE},
           "facts1": {"recompute_facts": 1, "recompute_facts_max_k": 4},
           "facts2_tokens40": {"recompute_facts": 2, "recompute_tokens": 40}}


# --------------------------------------------------------------------------------------------- no engine


def test_injectable_tokens_leaves_recompute_tokens_to_vllm():
    assert injectable_tokens(prompt_len=200, memory_len=145, recompute_tokens=20) == 125
    assert injectable_tokens(prompt_len=200, memory_len=145, recompute_tokens=145) == 0
    assert injectable_tokens(prompt_len=200, memory_len=145, recompute_tokens=500) == 0
    assert recompute_tokens_option({}) == 0 and recompute_tokens_option({"recompute_tokens": 7}) == 7
    for bad in (-1, 2.5, "3", True):
        with pytest.raises(ValueError, match="recompute_tokens must be an integer >= 0"):
            recompute_tokens_option({"recompute_tokens": bad})


def test_recompute_facts_option_and_suffix():
    assert recompute_facts_option({}) == 0 and recompute_facts_option({"recompute_facts": 3}) == 3
    for bad in (-1, 1.0, "2", False):
        with pytest.raises(ValueError, match=rf"recompute_facts must be an integer >= 0, got {bad!r}"):
            recompute_facts_option({"recompute_facts": bad})
    lens = (45, 23, 31, 17, 29)  # prefix chunk, then the facts (the most relevant last)
    assert recomputed_suffix(lens, 0, 0) == 0
    assert recomputed_suffix(lens, 0, 1) == 29 and recomputed_suffix(lens, 0, 2) == 46
    assert recomputed_suffix(lens, 40, 2) == 46 and recomputed_suffix(lens, 50, 2) == 50  # the longer suffix wins
    assert recomputed_suffix(lens, 0, 4) == 100  # every fact; the prefix chunk stays injected
    assert recomputed_suffix(lens, 0, 5) == recomputed_suffix(lens, 0, 99) == 145  # beyond the facts: everything
    # recompute_facts_max_k: whole facts are recomputed only in memories of at most that many facts (4 here).
    assert recomputed_suffix(lens, 0, 1, 4) == recomputed_suffix(lens, 0, 1, 0) == 29
    assert recomputed_suffix(lens, 0, 1, 3) == 0 and recomputed_suffix(lens, 20, 1, 3) == 20  # tokens still apply
    assert recompute_facts_max_k_option({}) == 0 and recompute_facts_max_k_option({"recompute_facts_max_k": 5}) == 5
    with pytest.raises(ValueError, match="recompute_facts_max_k must be an integer >= 0"):
        recompute_facts_max_k_option({"recompute_facts_max_k": -5})


def test_misspelled_option_is_refused_naming_the_known_ones():
    """One kv_connector_extra_config serves both halves; the worker refuses keys neither half reads (the
    engines below start with recompute_facts, so the worker lets it through)."""
    from types import SimpleNamespace

    from inferscale_core.connector_worker import WorkerSide

    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config keys \['recompute_fact'\]; "
                                         r"known: .*'recompute_facts'"):
        WorkerSide(config, {"recompute_fact": 2})


def test_injection_params_carry_the_chunk_lengths():
    h = memory_hash([1, 2, 3, 4, 5])
    p = InjectionParams("alice", ("prefix", "f1", "f2"), 5, h, (2, 1, 2))
    assert p.to_kv_transfer_params()["inferscale"]["chunk_lens"] == [2, 1, 2]
    assert InjectionParams.from_kv_transfer_params(p.to_kv_transfer_params()) == p
    bare = InjectionParams("alice", ("prefix", "f1", "f2"), 5, h)  # requests written before chunk_lens existed
    assert "chunk_lens" not in bare.to_kv_transfer_params()["inferscale"]
    assert InjectionParams.from_kv_transfer_params(bare.to_kv_transfer_params()).chunk_lens is None
    for bad in ((2, 3), (2, 1, 1), (2, -1, 4), (2, 1.0, 2), (2, True, 2)):
        with pytest.raises(ValueError, match="chunk_lens"):
            InjectionParams("alice", ("prefix", "f1", "f2"), 5, h, bad)
    with pytest.raises(ValueError, match="chunk_lens must be a list"):
        InjectionParams.from_kv_transfer_params({"inferscale": {**bare.to_kv_transfer_params()["inferscale"],
                                                                "chunk_lens": "2,1,2"}})


def test_engine_prepare_gives_the_fact_boundaries(tmp_path):
    """The engine's request preparation sends each chunk's token count: the prefix chunk, then each fact."""
    import torch
    from transformers import AutoTokenizer

    from inferscale_core.models import default_model_path
    from inferscale_core.requests import Query, RequestCore
    from inferscale_core.template import PromptTemplate
    from inferscale_core.types import EncodedFact

    template = PromptTemplate(AutoTokenizer.from_pretrained(default_model_path()))
    n = len(template.prefix_ids)
    prefix = EncodedFact(torch.tensor(template.prefix_ids), torch.zeros(1, n, 1, 1), torch.zeros(1, n, 1, 1))
    core = RequestCore(template, prefix)
    texts = ["Alice has a cat named Tom.", "Alice moved to Lisbon in 2021 to work on boats."]
    p = core.prepare_facts(Query("alice", "Where does Alice live?"), ["f1", "f2"], texts, [1, 1])
    chunks = [template.prefix_ids] + [template.fact_ids(t) for t in texts]
    assert p.params.chunk_lens == tuple(map(len, chunks))
    assert p.prompt_ids[:p.memory_len] == [t for c in chunks for t in c]
    assert core.prepare_facts(Query("alice", "Where?", mode="pi"), ["f1"], texts[:1], [1]).params is None


# --------------------------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def harness(request, model_folder):
    """An engine whose connector has the options CONFIGS[request.param] (tests pick theirs with indirect
    parametrization; pytest runs each engine's tests together and closes it before starting the next)."""
    from inferscale_core.vllm_setup import kv_transfer_config

    h = open_harness(model_folder, kv_transfer_config=kv_transfer_config(CONFIGS[request.param]))
    yield h
    close_harness(h)


def run_counted(h, request):
    """One request's output and the memory tokens vLLM reports loaded through the connector for it."""
    before = h.metrics()["prompt_tokens_external_kv_transfer"]
    (out,) = h.run(request)
    return out, h.metrics()["prompt_tokens_external_kv_transfer"] - before


def assert_equals_reference(h, out, chunks, query, n_injected, steps=16):
    """Greedy tokens and logprobs equal transformers with the mask the request stands for: the first
    `n_injected` memory tokens (facts encoded apart) see only their own chunk; what vLLM computes (the
    recomputed memory suffix, the query, the output) sees everything."""
    tokens, ref_lp = block_diagonal_reference(h.model, chunks, query, n_injected, steps=steps)
    assert list(out.outputs[0].token_ids) == tokens[:len(out.outputs[0].token_ids)]
    diff = max(abs(step[t].logprob - float(lp[t])) for step, lp in zip(out.outputs[0].logprobs, ref_lp) for t in step)
    assert diff < 1e-4


def with_boundaries(h, user, fids, chunks, query, max_tokens=16):
    """The injection request for `chunks` (prefix chunk first) carrying the fact boundaries."""
    return h.injected(user, f"prefix-{user}", fids, chunks, query, max_tokens=max_tokens,
                      chunk_lens=tuple(map(len, chunks)))


def inject_and_compare(h, user, chunks, query, n_injected, steps=16):
    """Register `chunks` (facts encoded apart) for `user`, send them with their boundaries, and check that the
    connector loaded exactly `n_injected` tokens (vLLM's own counters) and the output equals the reference in
    which only those tokens were encoded apart. Returns the fact ids."""
    fids = [f"{user}-{i}" for i in range(1, len(chunks))]
    h.register(user, f"prefix-{user}", fids, h.encode_apart(chunks))
    out, loaded = run_counted(h, with_boundaries(h, user, fids, chunks, query, max_tokens=steps))
    assert out.num_cached_tokens == n_injected == loaded
    assert_equals_reference(h, out, chunks, query, n_injected, steps=steps)
    return fids


@pytest.mark.parametrize("harness", ["tokens20"], indirect=True)
def test_last_memory_tokens_are_computed_with_the_query(harness):
    h = harness
    chunks, query = layout(7000)
    fids = ["r1", "r2", "r3", "r4"]
    h.register("recompute", "prefix-recompute", fids, h.encode_apart(chunks))
    out, loaded = run_counted(h, h.injected("recompute", "prefix-recompute", fids, chunks, query))
    n_inj = M - RECOMPUTE
    assert n_inj % BLOCK and out.num_cached_tokens == n_inj == loaded  # the load ends inside a block
    # Facts encoded apart: injected tokens see only their own fact; the recomputed tail sees everything.
    assert_equals_reference(h, out, chunks, query, n_inj)
    # ...and it is not the same computation as injecting the whole memory.
    tokens_all, lp_all = block_diagonal_reference(h.model, chunks, query, M, steps=1)
    assert abs(float(lp_all[0][tokens_all[0]]) - out.outputs[0].logprobs[0][tokens_all[0]].logprob) > 1e-4


@pytest.mark.parametrize("harness", ["facts1"], indirect=True)
def test_last_fact_is_computed_whole_with_the_query(harness):
    h = harness
    chunks, query = layout(7100)
    fids = inject_and_compare(h, "facts1", chunks, query, M - FACT_LENS[-1])  # 116: ends inside a block
    # recompute_facts_max_k=4: a memory of 5 facts recomputes no fact, all of it is injected.
    five, query5 = layout(7150, FACT_LENS + [11])
    inject_and_compare(h, "facts1-five", five, query5, sum(map(len, five)))
    # A request without the fact boundaries (an older client) is not injected at all: vLLM computes the
    # whole memory, which is prompt injection, and the scheduler counts the request as invalid.
    (plain,) = h.run(h.plain([t for c in chunks for t in c] + query))
    invalid = h.metrics().get("requests_invalid", 0)
    # version=2: another cache salt, so the blocks the first request left in the prefix cache are not reused.
    bare, loaded = run_counted(h, h.injected("facts1", "prefix-facts1", fids, chunks, query, version=2))
    assert loaded == 0 and bare.num_cached_tokens == 0
    assert_same(bare, plain)
    assert h.metrics()["requests_invalid"] >= invalid + 1


@pytest.mark.parametrize("harness", ["facts2_tokens40"], indirect=True)
def test_last_two_facts_or_the_longer_token_suffix(harness):
    h = harness
    # The last two facts (17 + 29 tokens) are longer than recompute_tokens=40: they are recomputed whole.
    chunks, query = layout(7200)
    inject_and_compare(h, "facts2", chunks, query, M - sum(FACT_LENS[-2:]))  # 99
    # Last two facts of 9 + 5 tokens: the 40-token suffix is longer and wins (it cuts into the third-last fact).
    short, query_s = layout(7300, [23, 31, 9, 5])
    inject_and_compare(h, "facts2-short", short, query_s, sum(map(len, short)) - 40, steps=4)


@pytest.mark.parametrize("harness", ["facts2_tokens40"], indirect=True)
def test_more_facts_recomputed_than_the_memory_has_is_prompt_injection(harness):
    """r=2 with a single fact: the whole memory, prefix chunk included, is computed by vLLM; nothing is
    injected and the output is prompt injection's."""
    h = harness
    chunks, query = layout(7400, [19])
    h.register("facts2-one", "prefix-facts2-one", ["u1"], h.encode_apart(chunks))
    (plain,) = h.run(h.plain([t for c in chunks for t in c] + query))
    out, loaded = run_counted(h, with_boundaries(h, "facts2-one", ["u1"], chunks, query))
    assert loaded == 0 and out.num_cached_tokens == 0
    assert_same(out, plain)


def test_locomo_records_recompute_facts_and_merges_only_equal_runs(tmp_path):
    """bench/locomo.py takes --recompute-facts into its settings, and --merge refuses runs made with another
    value (a run written before the option existed counts as 0)."""
    import json

    from support.locomo_runner import load_locomo_runner

    locomo = load_locomo_runner()  # bench/locomo.py
    assert locomo.parse_args(["--recompute-facts", "2"]).recompute_facts == 2
    shipped = locomo.parse_args([])  # no flags: the shipped default (inferscale_core/defaults.py)
    assert (shipped.recompute_facts, shipped.recompute_facts_max_k) == (RECOMPUTE_FACTS, RECOMPUTE_FACTS_MAX_K)
    assert locomo.parse_args(["--recompute-facts-max-k", "0"]).recompute_facts_max_k == 0
    config = {"recompute_tokens": 32}
    for name, extra in (("old", {}), ("r0", {"recompute_facts": 0}), ("r2", {"recompute_facts": 2})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "locomo_results.json").write_text(json.dumps({"config": {**config, **extra}}))
    with pytest.raises(ValueError, match=r"other settings than .*\['recompute_facts'\]"):
        locomo.merge_runs([tmp_path / "r0", tmp_path / "r2"], tmp_path / "merged")
    with pytest.raises(ValueError, match=r"other settings than .*\['recompute_facts'\]"):
        locomo.merge_runs([tmp_path / "old", tmp_path / "r2"], tmp_path / "merged")

    # --serving-order (issue 21, item 3): the shipped order unless asked, a bad name refused, runs of the two
    # orders never merged (a run written before the option counts as the shipped "relevance").
    assert locomo.parse_args([]).serving_order == "relevance"
    assert locomo.parse_args(["--serving-order", "stored"]).serving_order == "stored"
    with pytest.raises(SystemExit):
        locomo.parse_args(["--serving-order", "newest"])
    (tmp_path / "stored").mkdir()
    (tmp_path / "stored" / "locomo_results.json").write_text(json.dumps({"config": {**config, "serving_order": "stored"}}))
    with pytest.raises(ValueError, match=r"other settings than .*\['serving_order'\]"):
        locomo.merge_runs([tmp_path / "old", tmp_path / "stored"], tmp_path / "merged")
