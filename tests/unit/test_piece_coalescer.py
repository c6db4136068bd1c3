"""A streamed answer in fewer pieces (services/engine_replica/answering.py PieceCoalescer, EngineReplicaConfig
.stream_interval): each choice's first piece goes out at once, later ones gather `stream_interval` tokens, nothing
is lost or reordered, and the answer's end comes after every held piece. Through Answering.stream with an engine
double that streams one token per step (no vLLM engine)."""
from __future__ import annotations

import asyncio
import types

import pytest

from inferscale_core.types import Mode
from inferscale_server.engine_replica.answering import Answering, PieceCoalescer
from inferscale_server.messages import DEFAULT_STREAM_INTERVAL, AnswerEnd, AnswerPiece, AnswerRequest


def coalesce(interval: int, pieces: list[tuple[AnswerPiece, int, bool]]) -> list[AnswerPiece]:
    c = PieceCoalescer(interval)
    out = [p for piece, tokens, finished in pieces if (p := c.add(piece, tokens, finished)) is not None]
    return out + c.flush()


def test_interval_one_sends_every_piece_as_it_came():
    pieces = [(AnswerPiece(f"t{i} "), 1, False) for i in range(5)]
    assert coalesce(1, pieces) == [p for p, _, _ in pieces]


@pytest.mark.parametrize("tokens, expected", [(8, ["t0 ", "t1 t2 t3 t4 ", "t5 t6 t7 "]),
                                              (9, ["t0 ", "t1 t2 t3 t4 ", "t5 t6 t7 t8 "]),
                                              (1, ["t0 "])])
def test_the_first_piece_goes_alone_then_interval_tokens_at_a_time(tokens, expected):
    out = coalesce(4, [(AnswerPiece(f"t{i} "), 1, False) for i in range(tokens)])
    assert [p.text for p in out] == expected


def test_pieces_of_several_tokens_count_their_tokens():
    """A piece the engine made of several tokens (its output merged while the replica was busy) counts them all."""
    out = coalesce(4, [(AnswerPiece("a"), 1, False), (AnswerPiece("bcd"), 3, False), (AnswerPiece("e"), 1, False),
                       (AnswerPiece("f"), 1, False)])
    assert [p.text for p in out] == ["a", "bcde", "f"]


def test_choices_are_gathered_apart_with_their_logprobs_and_flushed_when_they_finish():
    """n = 2: each choice's first piece at once, its logprobs concatenated in order, a finished choice sent at once
    (not held until the other finishes), what is left sent by choice."""
    def lp(tag):
        return [{"token": tag, "logprob": -0.5}]

    seq = [(AnswerPiece("A0", 0, lp("A0")), 1, False), (AnswerPiece("B0", 1, lp("B0")), 1, False),
           (AnswerPiece("A1", 0, lp("A1")), 1, False), (AnswerPiece("B1", 1, lp("B1")), 1, False),
           (AnswerPiece("A2", 0, lp("A2")), 1, True), (AnswerPiece("B2", 1, lp("B2")), 1, False)]
    c = PieceCoalescer(8)
    sent = [(i, c.add(p, n, f)) for i, (p, n, f) in enumerate(seq)]
    assert [(i, p.text) for i, p in sent if p is not None] == [(0, "A0"), (1, "B0"), (4, "A1A2")]
    finished_a = sent[4][1]
    assert finished_a is not None and [e["token"] for e in finished_a.logprobs] == ["A1", "A2"]
    rest = c.flush()
    assert [(p.index, p.text, [e["token"] for e in p.logprobs]) for p in rest] == [(1, "B1B2", ["B1", "B2"])]
    assert c.flush() == []


class OneTokenEngine:
    """The ServingEngine's `stream` as vLLM gives it: one token's text per step, then the Answer."""

    def __init__(self, words: list[str]):
        self.words = words

    def max_model_len(self) -> int:
        return 4096

    async def stream(self, p, sp):
        from inferscale_core.requests import Answer

        for w in self.words:
            await asyncio.sleep(0)
            yield w, None
        yield "", Answer(text="".join(self.words), token_ids=list(range(len(self.words))), fact_ids=[], mode=Mode.KV,
                         k=0, w=0, prompt_len=10, memory_len=0, num_cached_tokens=0, retrieve_s=0.0, ttft_s=0.001,
                         finish_reason="length")


@pytest.mark.parametrize("interval", [1, DEFAULT_STREAM_INTERVAL])
def test_an_answer_streams_in_pieces_of_the_interval_and_ends_after_them(interval):
    from inferscale_server.admission import Admission

    words = [f"w{i} " for i in range(20)]
    metrics = types.SimpleNamespace(ttft=types.SimpleNamespace(observe=lambda *a, **k: None))
    answering = Answering(OneTokenEngine(words), Admission(10_000, 2.0), metrics, stream_interval=interval)
    p = types.SimpleNamespace(prompt_ids=list(range(10)))
    req = AnswerRequest("u", "q?", [], 20, 0.0, Mode.KV)

    async def run():
        return [x async for x in answering.stream(p, req, 0.0, {})]

    out = asyncio.run(run())
    pieces, end = out[:-1], out[-1]
    assert isinstance(end, AnswerEnd) and all(isinstance(x, AnswerPiece) for x in pieces)
    assert "".join(x.text for x in pieces) == "".join(words) and end.completion_tokens == 20
    assert pieces[0].text == words[0]  # the first token is never held
    # 1 + ceil(19 / interval) pieces: 20 at interval 1, 4 at 8 (the first, 8, 8, the last 3 before the end)
    assert len(pieces) == 1 + -(-19 // interval)
