"""VectorIndex: exact top-k against a numpy brute force, batching, user isolation, replace/remove, errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from inferscale_core.errors import InvalidIdError, UnknownFactError, UnknownUserError
from inferscale_core.index import VectorIndex

DIM = 32


def brute_force(emb: np.ndarray, ids: list[str], query: np.ndarray, k: int) -> list[tuple[str, float]]:
    e = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    q = query / np.linalg.norm(query)
    scores = e @ q
    order = np.argsort(-scores)[:k]
    return [(ids[i], float(scores[i])) for i in order]


def filled(n: int, seed: int = 0, user: str = "alice") -> tuple[VectorIndex, np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((n, DIM)).astype(np.float32)
    ids = [f"fact-{i}" for i in range(n)]
    index = VectorIndex(DIM)
    for fid, e in zip(ids, emb):
        index.add(user, fid, e)
    return index, emb, ids


@pytest.mark.parametrize("k", [1, 5, 40])
def test_top_k_matches_brute_force(k):
    index, emb, ids = filled(40, seed=k)
    queries = np.random.default_rng(100 + k).standard_normal((10, DIM)).astype(np.float32)
    for q in queries:
        got = index.search("alice", q, k)
        want = brute_force(emb, ids, q, k)
        assert [f for f, _ in got] == [f for f, _ in want]
        np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-5, atol=1e-6)
        scores = [s for _, s in got]
        assert scores == sorted(scores, reverse=True)


def test_batched_search_equals_single_searches():
    index, _, _ = filled(25, seed=3)
    queries = torch.randn(7, DIM, generator=torch.Generator().manual_seed(4))
    batched = index.search("alice", queries, 6)
    assert len(batched) == 7
    for q, result in zip(queries, batched):
        single = index.search("alice", q, 6)
        assert [f for f, _ in single] == [f for f, _ in result]
        np.testing.assert_allclose([s for _, s in single], [s for _, s in result], rtol=1e-5, atol=1e-6)


def test_k_larger_than_user_facts_returns_all():
    index, _, ids = filled(3)
    got = index.search("alice", np.ones(DIM), 10)
    assert sorted(f for f, _ in got) == sorted(ids)


def test_scores_are_cosine():
    index = VectorIndex(3)
    index.add("u", "x", [10.0, 0.0, 0.0])  # unnormalized on input; cosine on output
    index.add("u", "xy", [1.0, 1.0, 0.0])
    got = dict(index.search("u", [2.0, 0.0, 0.0], 2))
    assert got["x"] == pytest.approx(1.0, abs=1e-6)
    assert got["xy"] == pytest.approx(2 ** -0.5, abs=1e-6)


def test_user_isolation_with_identical_embeddings():
    index = VectorIndex(DIM)
    same = np.random.default_rng(0).standard_normal(DIM)
    index.add("alice", "alice-fact", same)
    index.add("bob", "bob-fact", same)
    index.add("bob", "bob-other", -same)
    assert [f for f, _ in index.search("alice", same, 10)] == ["alice-fact"]
    assert [f for f, _ in index.search("bob", same, 10)] == ["bob-fact", "bob-other"]
    index.remove_user("bob")
    with pytest.raises(UnknownUserError, match="'bob'"):
        index.search("bob", same, 1)
    assert [f for f, _ in index.search("alice", same, 10)] == ["alice-fact"]


def test_replace_and_remove():
    index, emb, ids = filled(20, seed=7)
    target = np.random.default_rng(8).standard_normal(DIM).astype(np.float32)
    index.add("alice", "fact-5", target)  # replace: the id now points at the new vector
    assert index.size("alice") == 20
    best, score = index.search("alice", target, 1)[0]
    assert best == "fact-5" and score == pytest.approx(1.0, abs=1e-5)

    index.remove("alice", "fact-5")
    index.remove("alice", "fact-0")  # removing moves the last row: the rest must stay correct
    assert index.size("alice") == 18
    emb[5] = target
    keep = [i for i in range(20) if i not in (0, 5)]
    q = np.random.default_rng(9).standard_normal(DIM)
    got = index.search("alice", q, 18)
    assert [f for f, _ in got] == [f for f, _ in brute_force(emb[keep], [ids[i] for i in keep], q, 18)]
    with pytest.raises(UnknownFactError, match="'fact-5'"):
        index.remove("alice", "fact-5")
    for i in keep:
        index.remove("alice", ids[i])
    assert index.size("alice") == 0 and index.users() == []


def test_add_many_grows_and_matches_add():
    rng = np.random.default_rng(11)
    emb = rng.standard_normal((100, DIM)).astype(np.float32)  # > initial capacity: exercises growth
    ids = [f"f{i}" for i in range(100)]
    a, b = VectorIndex(DIM), VectorIndex(DIM)
    a.add_many("u", ids, emb)
    for fid, e in zip(ids, emb):
        b.add("u", fid, e)
    q = rng.standard_normal((3, DIM))
    assert [[f for f, _ in r] for r in a.search("u", q, 15)] == [[f for f, _ in r] for r in b.search("u", q, 15)]
    assert a.nbytes("u") == 100 * DIM * 4 and a.nbytes() == 100 * DIM * 4 and a.nbytes("other") == 0


def test_total_bytes_follow_adds_replaces_and_removes():
    """nbytes() is a running total (the retrieval replica checks its budget on every request): it equals the sum over
    users after every kind of change, a replaced fact counted once, a refused add not at all."""
    rng = np.random.default_rng(12)
    index = VectorIndex(DIM)

    def total_is_the_sum():
        assert index.nbytes() == sum(index.size(u) for u in index.users()) * DIM * 4

    index.add_many("a", [f"f{i}" for i in range(20)], rng.standard_normal((20, DIM)))
    index.add_many("b", ["x", "y"], rng.standard_normal((2, DIM)))
    total_is_the_sum()
    index.add("a", "f3", rng.standard_normal(DIM))  # a replace: no new row
    index.add_many("b", ["y", "z"], rng.standard_normal((2, DIM)))  # one replace, one new row
    assert index.nbytes() == 23 * DIM * 4
    total_is_the_sum()
    with pytest.raises(ValueError):
        index.add_many("b", ["w"], np.zeros((1, DIM)))  # refused before anything is written
    index.remove("a", "f0")
    index.remove_user("b")
    assert index.nbytes() == 19 * DIM * 4
    total_is_the_sum()
    for i in range(1, 20):
        index.remove("a", f"f{i}")
    assert index.nbytes() == 0 and index.users() == []


def test_errors_name_the_problem():
    index, _, _ = filled(3)
    with pytest.raises(ValueError, match=r"shape \(31,\), expected \[32\]"):
        index.add("alice", "x", np.ones(DIM - 1))
    with pytest.raises(ValueError, match=r"expected \[N, 32\]"):
        index.search("alice", np.ones((2, DIM + 1)), 1)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        index.search("alice", np.ones(DIM), 0)
    with pytest.raises(UnknownUserError, match="'nobody'"):
        index.search("nobody", np.ones(DIM), 1)
    with pytest.raises(ValueError, match="all-zero"):
        index.add("alice", "z", np.zeros(DIM))
    with pytest.raises(ValueError, match="NaN"):
        index.search("alice", np.full(DIM, np.nan), 1)
    with pytest.raises(ValueError, match="2 fact ids but 3 embeddings"):
        index.add_many("alice", ["a", "b"], np.ones((3, DIM)))
    with pytest.raises(InvalidIdError, match="user_id"):
        index.add("", "x", np.ones(DIM))
    with pytest.raises(InvalidIdError, match="fact_id.*path separator"):
        index.add("alice", "a/b", np.ones(DIM))
    with pytest.raises(ValueError, match="positive int"):
        VectorIndex(0)
    assert index.size("alice") == 3
