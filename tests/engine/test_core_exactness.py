"""The paper's mechanism is exact: pre-RoPE capture + chunked RoPE + composition reproduce the model's own
computation (fp32, CPU, real forward passes; tiny models have random weights)."""
import pytest
import torch
from support.tiny_models import FAMILIES, tiny_model

from bench.hf_inject import block_diagonal_mask, greedy_prompt, greedy_with_injection, query_logits
from inferscale_core.compose import compose
from inferscale_core.encoder import (
    STEP_TOKENS,
    WHOLE_TOKENS,
    PreRopeEncoder,
    attention_balance,
    capture_pre_rope,
    step_tokens,
    step_work,
)
from inferscale_core.rope import ChunkedRope
from inferscale_core.template import PromptTemplate

FACTS = ["Caroline moved to Sweden four years ago with her family.",
         "Melanie painted a sunrise over a lake last summer.",
         "Caroline is researching adoption agencies because she wants to have kids."]
QUESTION = "Where did Caroline move from?"


@pytest.fixture(scope="module", params=FAMILIES + ("smollm2",))
def model_and_tok(request, smollm2):
    _, tok = smollm2  # tiny models share SmolLM2's tokenizer (same vocabulary size)
    if request.param == "smollm2":
        return smollm2
    return tiny_model(request.param), tok


def ids_of(model_and_tok):
    model, tok = model_and_tok
    tpl = PromptTemplate(tok)
    return tpl.prefix_ids, [tpl.fact_ids(f) for f in FACTS], tpl.query_ids(QUESTION)


@torch.no_grad()
def test_rerotated_keys_equal_model_keys_at_arbitrary_positions(model_and_tok):
    model, tok = model_and_tok
    ids = torch.tensor(tok("The quick brown fox jumps over the lazy dog near the river bank.",
                           add_special_tokens=False)["input_ids"])[None]
    positions = (torch.arange(ids.shape[1]) * 7 + 1234)[None]  # arbitrary, non-contiguous
    with capture_pre_rope(model) as (keys, _):
        out = model(input_ids=ids, position_ids=positions, use_cache=True)
    rope = ChunkedRope(model.config)
    for layer, k_pre in enumerate(keys):
        expected = out.past_key_values.layers[layer].keys[0].transpose(0, 1)  # [T, H, D] post-RoPE
        got = rope.rotate(k_pre[0], positions[0])
        assert (got - expected).abs().max().item() < 1e-5, f"layer {layer}"


@torch.no_grad()
def test_theorem1_joint_memory_injected_equals_prompt_injection(model_and_tok):
    model, tok = model_and_tok
    prefix, facts, query = ids_of(model_and_tok)
    memory = prefix + [t for f in facts for t in f]
    encoder = PreRopeEncoder(model, tok)
    comp = compose(ChunkedRope(model.config), [encoder.encode(memory)], query)
    assert comp.prompt_ids == memory + query and comp.memory_len == len(memory)

    full = model(input_ids=torch.tensor([comp.prompt_ids])).logits[0, len(memory):]
    injected = query_logits(model, comp)
    assert (injected - full).abs().max().item() < 1e-4
    assert greedy_with_injection(model, comp, 32) == greedy_prompt(model, comp.prompt_ids, 32)


@torch.no_grad()
def test_chunks_encoded_apart_equal_block_diagonal_reference(model_and_tok):
    model, tok = model_and_tok
    prefix, facts, query = ids_of(model_and_tok)
    encoder = PreRopeEncoder(model, tok)
    chunks = encoder.encode_batch([(c, ()) for c in [prefix] + facts], progress=False)
    comp = compose(ChunkedRope(model.config), chunks, query)

    lengths = [len(prefix)] + [len(f) for f in facts]
    mask = block_diagonal_mask(lengths, len(query))
    reference = model(input_ids=torch.tensor([comp.prompt_ids]), attention_mask=mask,
                      position_ids=torch.arange(len(comp.prompt_ids))[None]).logits[0, comp.memory_len:]
    assert (query_logits(model, comp) - reference).abs().max().item() < 1e-4
    # Encoding apart is NOT the same as joint prompt injection (otherwise this test proves nothing).
    joint = model(input_ids=torch.tensor([comp.prompt_ids])).logits[0, comp.memory_len:]
    assert (reference - joint).abs().max().item() > 1e-3


@torch.no_grad()
def test_corollary2_windows_holding_preceding_facts_equal_joint_prompt(model_and_tok):
    model, tok = model_and_tok
    prefix, facts, query = ids_of(model_and_tok)
    encoder = PreRopeEncoder(model, tok)
    items = [(prefix, ())] + [(f, [prefix] + facts[:i]) for i, f in enumerate(facts)]
    comp = compose(ChunkedRope(model.config), encoder.encode_batch(items, batch_size=2, progress=False), query)
    joint = model(input_ids=torch.tensor([comp.prompt_ids])).logits[0, comp.memory_len:]
    assert (query_logits(model, comp) - joint).abs().max().item() < 1e-4


@torch.no_grad()
def test_neighbour_windows_of_facts_added_together_equal_joint_prompt(model_and_tok):
    """PromptTemplate.neighbour_windows (the service's window rule for facts added together) are text: encoded
    with w >= the facts before, and composed in the order they were added, they are the joint prompt."""
    model, tok = model_and_tok
    prefix, facts, query = ids_of(model_and_tok)
    windows = PromptTemplate.neighbour_windows(FACTS, len(FACTS))
    assert [len(win) for win in windows] == [0, 1, 2]
    encoder = PreRopeEncoder(model, tok)
    items = [(prefix, ())] + [(f, [prefix, *win]) for f, win in zip(facts, windows)]
    comp = compose(ChunkedRope(model.config), encoder.encode_batch(items, batch_size=2, progress=False), query)
    joint = model(input_ids=torch.tensor([comp.prompt_ids])).logits[0, comp.memory_len:]
    assert (query_logits(model, comp) - joint).abs().max().item() < 1e-4
    assert PromptTemplate.neighbour_windows(FACTS, 1)[2] == (PromptTemplate.render_fact(FACTS[1]),)
    with pytest.raises(ValueError, match="window size"):
        PromptTemplate.neighbour_windows(FACTS, -1)


def test_a_steps_tokens_shrink_as_its_attention_grows(smollm2):
    """A step's work counts each token's attention over the positions before it against its layer's weights:
    SmolLM2-135M's balance is 3,072 positions (3,538,944 weights a layer / 2 x 9 heads x 64), so a step of
    STEP_TOKENS' work forwards 246 tokens at a window's start and 111 at position 3,900; each size is the most that
    fits, at every position and balance."""
    model, _ = smollm2
    assert attention_balance(model) == 3072
    assert (step_tokens(0, 3072), step_tokens(3900, 3072)) == (246, 111)
    for balance in (1, 7, 288, 3072, 1 << 20):
        for start in (0, 1, 255, 4096, 100_000):
            t = step_tokens(start, balance)
            assert t >= 1 and (t == 1 or step_work(t, start, balance) <= STEP_TOKENS)
            assert step_work(t + 1, start, balance) > STEP_TOKENS


@torch.no_grad()
def test_forwards_longer_than_a_step_run_in_steps_and_still_equal_the_joint_prompt(model_and_tok):
    """A forward of more than WHOLE_TOKENS runs in steps through the model's KV cache (so that the encoder pool can
    run other users' facts between them): a chunk whose own tokens span several steps, and a fact behind a window
    of several steps, composed, are the joint prompt; stepping again gives the same bits."""
    model, tok = model_and_tok
    prefix, facts, query = ids_of(model_and_tok)
    encoder = PreRopeEncoder(model, tok)
    head = prefix + [t for _ in range(24) for f in facts for t in f]
    assert len(head) > WHOLE_TOKENS and len(head) % STEP_TOKENS != 0
    last = facts[1]
    forward = encoder.fact_forward(head, last)
    costs, sizes = [], []
    while True:
        costs.append(forward.next_cost)
        before = forward.done
        behind = forward.step()
        sizes.append(forward.done - before)
        if behind is not None:
            break
    # Each step does at most STEP_TOKENS of work, and as much as fits: later steps, attending over more, take fewer
    # tokens; a scheduler is charged each step's work.
    assert sum(sizes) == len(head + last) and len(sizes) >= 3 and sizes[0] > sizes[-2]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    assert costs == [step_work(n, at, encoder.balance) for n, at in zip(sizes, starts)]
    assert all(c <= STEP_TOKENS < step_work(n + 1, at, encoder.balance)
               for c, n, at in zip(costs[:-1], sizes, starts))
    whole = encoder.encode(head)  # its own tokens over several steps
    comp = compose(ChunkedRope(model.config), [whole, behind], query)
    assert comp.prompt_ids == head + last + query
    joint = model(input_ids=torch.tensor([comp.prompt_ids])).logits[0, comp.memory_len:]
    assert (query_logits(model, comp) - joint).abs().max().item() < 1e-4
    again = encoder.fact_forward(head, last).run()
    assert torch.equal(again.k_pre, behind.k_pre) and torch.equal(again.v, behind.v)
    with pytest.raises(RuntimeError, match="run to its end"):
        forward.step()
    # At most WHOLE_TOKENS: one step, the plain forward's bits (the shipped default's facts are this size).
    short = encoder.fact_forward(prefix + facts[0] + facts[2], last)
    n = len(prefix + facts[0] + facts[2] + last)
    assert n <= WHOLE_TOKENS and short.next_cost == step_work(n, 0, encoder.balance)
    plain = encoder._forward([(prefix + facts[0] + facts[2], last)])[0]
    stepped = short.step()
    assert stepped is not None and torch.equal(stepped.k_pre, plain.k_pre) and torch.equal(stepped.v, plain.v)


@torch.no_grad()
def test_a_facts_kv_does_not_depend_on_what_it_is_encoded_with(model_and_tok):
    """Bit for bit, by default: a fact re-encoded after a loss, in whatever call, writes the same KV under the same
    version key (ENCODE_BATCH_SIZE: one fact per forward; batched by 8, 39 of 40 facts differed in the last bits on
    an AMX Xeon, enough to flip a greedy answer)."""
    model, tok = model_and_tok
    prefix, facts, _ = ids_of(model_and_tok)
    encoder = PreRopeEncoder(model, tok)
    items = [(facts[0], ()), (facts[1], [prefix]), (facts[2], [prefix, facts[0], facts[1]])]
    together = encoder.encode_batch(items, progress=False)
    other_call = encoder.encode_batch([(prefix, ()), *reversed(items)], progress=False)[1:][::-1]
    for (fact, window), got, again in zip(items, together, other_call):
        alone = encoder.encode(fact, window)
        assert got.token_ids.tolist() == list(fact)
        for enc in (got, again):
            assert torch.equal(enc.k_pre, alone.k_pre) and torch.equal(enc.v, alone.v)


@torch.no_grad()
def test_batched_encoding_with_padding_matches_one_at_a_time(model_and_tok):
    """Facts sharing a forward (right-padded to one width, no attention mask) get their own KV, to the kernels'
    rounding: the padding after a fact is never attended to."""
    model, tok = model_and_tok
    prefix, facts, _ = ids_of(model_and_tok)
    encoder = PreRopeEncoder(model, tok)
    items = [(facts[0], ()), (facts[1], [prefix]), (facts[2], [prefix, facts[0], facts[1]])]
    for (fact, window), got in zip(items, encoder.encode_batch(items, batch_size=3, progress=False)):
        alone = encoder.encode(fact, window)
        assert got.token_ids.tolist() == list(fact)
        torch.testing.assert_close(got.k_pre, alone.k_pre, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.v, alone.v, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="batch_size"):
        encoder.encode_batch(items, batch_size=0, progress=False)
