"""Memory facade on SmolLM2 + the packaged MiniLM embedder: store and index stay consistent, users are isolated,
everything comes back after a restart, bad input is named."""
import pytest
import torch

from bench.hf_inject import greedy_with_injection
from inferscale_core.errors import InferScaleError, UnknownFactError, UnknownUserError
from inferscale_core.memory import Memory

ALICE = ["Alice adopted a grey cat named Miso in March.", "Alice works as a nurse at the city hospital.",
         "Alice's favourite food is ramen."]
BOB = ["Bob plays bass guitar in a jazz band.", "Bob has a grey cat named Pixel."]


@pytest.fixture()
def memory(smollm2, tmp_path):
    model, tok = smollm2
    return Memory(model=model, tokenizer=tok, store_dir=tmp_path / "mem")


def test_add_search_isolation_and_answer(memory):
    a_ids = memory.add("alice", ALICE)
    b_ids = memory.add("bob", BOB)
    hits = memory.search("alice", "What is the name of the cat?", k=5)
    assert [h.fact_id for h in hits][0] == a_ids[0]
    assert {h.fact_id for h in hits} <= set(a_ids)  # never Bob's cat, though it is just as relevant
    assert {h.fact_id for h in memory.search("bob", "cat name", k=5)} <= set(b_ids)

    order = memory.retrieve("alice", "What is the name of Alice's cat?", k=2)
    assert order[-1] == a_ids[0]  # the best fact sits next to the query
    comp = memory.compose("alice", order, "What is the name of Alice's cat?")
    assert comp.prompt_ids == memory.prompt_ids("alice", order, "What is the name of Alice's cat?")
    # Facts were encoded behind the instruction prefix (the default): the real model answers from them.
    answer = memory.tokenizer.decode(greedy_with_injection(memory.model, comp, 16))
    assert "Miso" in answer

    # The other serving order: the same facts, in the order Alice stored them (a later update keeps its place).
    everything = memory.retrieve("alice", "What is the name of Alice's cat?", k=3)
    memory.update("alice", a_ids[0], "Alice adopted a grey cat named Miso in April.")
    stored = memory.retrieve("alice", "What is the name of Alice's cat?", k=3, order="stored")
    assert stored == a_ids and sorted(stored) == sorted(everything)
    with pytest.raises(ValueError, match="serving order must be one of"):
        memory.retrieve("alice", "cat", k=2, order="newest")


def test_update_delete_keep_store_and_index_consistent(memory):
    ids = memory.add("alice", ALICE)
    rec = memory.update("alice", ids[2], "Alice's favourite food is sushi.")
    assert rec.version == 2 and "sushi" in rec.text
    stored = memory.store.get("alice", ids[2])
    expected = memory.encoder.encode(memory.template.fact_ids(rec.text), memory._context([]))
    assert stored.token_ids.tolist() == expected.token_ids.tolist()
    assert torch.equal(stored.k_pre, expected.k_pre) and torch.equal(stored.v, expected.v)
    assert memory.search("alice", "sushi", k=1)[0].fact_id == ids[2]

    memory.delete("alice", ids[0])
    assert not memory.store.contains("alice", ids[0]) and not memory.index.contains("alice", ids[0])
    assert ids[0] not in {h.fact_id for h in memory.search("alice", "cat", k=10)}
    with pytest.raises(UnknownFactError, match=ids[0]):
        memory.get("alice", ids[0])
    memory.delete_user("alice")
    with pytest.raises(UnknownUserError, match="alice"):
        memory.search("alice", "cat", k=1)
    assert "alice" not in memory.store.users() and memory.index.size("alice") == 0


def test_restart_brings_every_fact_back_bit_exact(memory, smollm2, tmp_path):
    ids = memory.add("alice", ALICE, windows=[[], ["Bob: how is work?"], []])
    kv = {i: memory.store.get("alice", i) for i in ids}
    model, tok = smollm2
    again = Memory(model=model, tokenizer=tok, store_dir=tmp_path / "mem")
    assert {r.fact_id for r in again.get_all("alice")} == set(ids)
    for i in ids:
        assert torch.equal(again.store.get("alice", i).k_pre, kv[i].k_pre)
        assert torch.equal(again.store.get("alice", i).v, kv[i].v)
    assert again.get("alice", ids[1]).window == ["Bob: how is work?"]
    assert again.search("alice", "nurse hospital", k=1)[0].fact_id == ids[1]


def test_bad_input_is_named(memory):
    memory.add("alice", ALICE[:1])
    with pytest.raises(ValueError, match="empty"):
        memory.add("alice", ["   "])
    with pytest.raises(ValueError, match="limit"):
        memory.add("alice", ["word " * 400])
    with pytest.raises(ValueError, match="k must be"):
        memory.search("alice", "cat", k=0)
    with pytest.raises(UnknownUserError):
        memory.search("nobody", "cat", k=1)
    with pytest.raises(InferScaleError):
        memory.add("bad/user", ["x"])
    with pytest.raises(ValueError, match="reserved"):
        memory.add("__inferscale_shared__", ["x"])
